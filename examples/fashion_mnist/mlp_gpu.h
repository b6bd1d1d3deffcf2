// The CUDA half of the demo's model, with a plain interface (no ferry or CUDA types) so that
// mlp_gpu.cu compiles with nvcc alone. mlp_gpu_adapter.cpp wraps it as a demo::Mlp.
#pragma once

namespace demo::gpu {

struct Config {
  int in, hidden, classes;
  float lr, momentum;
  int device;
  void* stream;  ///< cudaStream_t: every kernel and cuBLAS call goes there
  /// Data parallel: called in each learning step between the gradients (device arrays of w1, b1,
  /// w2, b2, each `sizes[i]` floats, written in `stream`'s order) and the update, which reads them
  /// after whatever this queues on `stream` (an all-reduce). Null: none.
  void (*reduce_gradients)(void* ctx, float* const grads[4], const long long sizes[4]) = nullptr;
  void* reduce_ctx = nullptr;
};
struct Model;

/// Throws std::runtime_error naming the CUDA or cuBLAS call that failed.
Model* create(const Config& config, const float* w1, const float* b1, const float* w2, const float* b2);
void destroy(Model* model) noexcept;
/// One batch: x [B, in] float32 and y [B] int64, both on the device. learn: SGD step too.
void step(Model* model, const float* x, const long long* y, int batch, bool learn);
/// Sums since the last call (synchronizes the stream), then resets them.
void take(Model* model, double* loss, long long* correct, long long* samples);
/// The 8 parameter arrays (w1, b1, w2, b2, then their momentum), to or from host memory, after the
/// stream's work so far.
void save(Model* model, float* const arrays[8]);
void load(Model* model, const float* const arrays[8]);

}  // namespace demo::gpu
