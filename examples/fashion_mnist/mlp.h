// A two-layer perceptron (in -> hidden, ReLU -> classes) trained with SGD + momentum on softmax
// cross-entropy: the model of the Fashion-MNIST demo. Two implementations with one interface:
// on the CPU (plain loops over ferry::ParallelFor) and on a CUDA device (cuBLAS for the three
// matrix products, small kernels for bias, ReLU, softmax and the update), built when nvcc is.
// Both start from the same weights (seeded), so a run on either learns the same way.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/ferry.h"

namespace demo {

struct MlpConfig {
  int in = 784, hidden = 256, classes = 10;
  float lr = 0.05f, momentum = 0.9f;
  std::uint64_t seed = 1;
};

/// Sums since the last take(): loss over samples, correct predictions, samples.
struct Metrics {
  double loss = 0;
  std::int64_t correct = 0, samples = 0;
};

class Mlp {
 public:
  virtual ~Mlp() = default;
  /// One SGD step on a batch: images [B, ...] float32 (B x in values), labels [B] int64.
  virtual void train_step(const ferry::Tensor& images, const ferry::Tensor& labels) = 0;
  /// Loss and accuracy of a batch without learning.
  virtual void evaluate(const ferry::Tensor& images, const ferry::Tensor& labels) = 0;
  /// The sums so far (synchronizes with the device), reset to zero.
  virtual Metrics take() = 0;
  virtual const char* where() const = 0;
  /// The parameters and their momentum (a checkpoint), and back.
  virtual struct Checkpoint save() = 0;
  virtual void load(const struct Checkpoint& checkpoint) = 0;
};

/// Initial weights: He-uniform for both layers, zero biases; W1 is [in][hidden], W2 [hidden][classes].
struct Weights {
  std::vector<float> w1, b1, w2, b2;
};

/// What a checkpoint holds of the model: its weights and the momentum of each.
struct Checkpoint {
  Weights w, v;
};
/// Writes `c` to `path` (via a temporary file renamed over it) and reads it back; ferry::Error
/// names the file when it is damaged or was made for another model size.
void write_checkpoint(const std::string& path, const Checkpoint& c, const MlpConfig& config);
Checkpoint read_checkpoint(const std::string& path, const MlpConfig& config);
Weights initial_weights(const MlpConfig& config);

std::unique_ptr<Mlp> make_cpu_mlp(const MlpConfig& config, int threads);
/// Built only with nvcc (FERRY_DEMO_GPU is 1 then; mlp_gpu_adapter.cpp). `stream`: the cudaStream_t
/// the loader orders device batches on (loader.stream()->native()).
/// Data parallel: `fn` is called in each learning step with the batch's gradients (device arrays of
/// w1, b1, w2, b2 and their sizes, in the model's stream order) before the update reads them.
struct GradientReducer {
  void (*fn)(void* ctx, float* const grads[4], const long long sizes[4]) = nullptr;
  void* ctx = nullptr;
};
std::unique_ptr<Mlp> make_gpu_mlp(const MlpConfig& config, int device, void* stream, GradientReducer reduce = {});

}  // namespace demo
