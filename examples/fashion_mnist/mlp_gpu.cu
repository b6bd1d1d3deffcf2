// The demo's model on a CUDA device: the three matrix products through cuBLAS (row-major
// matrices seen as their column-major transposes), bias/ReLU/softmax/update as small kernels,
// everything on the loader's consumer stream so it is ordered after each batch's copy.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <memory>
#include <string>
#include <vector>

#include "mlp_gpu.h"

namespace demo::gpu {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(s)));
}

__global__ void bias_relu(float* h, const float* b, int rows, int cols, bool relu) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const float v = h[i] + b[i % cols];
  h[i] = relu ? fmaxf(v, 0.0f) : v;
}

// One thread per row: softmax, loss, correct count, and d(loss)/d(logits) / B in place.
__global__ void softmax_xent(float* logits, const long long* labels, int rows, int k, double* loss, int* correct, int* bad) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float* z = logits + static_cast<long long>(r) * k;
  const long long label = labels[r];
  if (label < 0 || label >= k) {
    atomicAdd(bad, 1);
    return;
  }
  float top = z[0];
  int arg = 0;
  for (int j = 1; j < k; ++j)
    if (z[j] > top) top = z[j], arg = j;
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += exp(static_cast<double>(z[j] - top));
  atomicAdd(loss, log(sum) - (z[label] - top));
  if (arg == label) atomicAdd(correct, 1);
  for (int j = 0; j < k; ++j) z[j] = static_cast<float>((exp(static_cast<double>(z[j] - top)) / sum - (j == label)) / rows);
}

__global__ void relu_backward(float* dh, const float* h, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && h[i] <= 0.0f) dh[i] = 0.0f;
}

__global__ void column_sums(const float* m, float* out, int rows, int cols) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float s = 0;
  for (int r = 0; r < rows; ++r) s += m[static_cast<long long>(r) * cols + j];
  out[j] = s;
}

__global__ void sgd_momentum(float* w, float* v, const float* g, int n, float lr, float momentum) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  v[i] = momentum * v[i] + g[i];
  w[i] -= lr * v[i];
}

int blocks(long long n) { return static_cast<int>((n + 255) / 256); }

struct Buffer {
  float* p = nullptr;
  std::size_t n = 0;
  ~Buffer() { cudaFree(p); }
  void ensure(std::size_t count) {
    if (count <= n) return;
    cudaFree(p);
    p = nullptr;
    check(cudaMalloc(&p, count * sizeof(float)), "cudaMalloc");
    n = count;
  }
};

}  // namespace

struct Model {
  Config c;
  cudaStream_t stream;
  cublasHandle_t blas = nullptr;
  Buffer w1, b1, w2, b2, v_w1, v_b1, v_w2, v_b2, g_w1, g_b1, g_w2, g_b2, h, dh, z;
  double* loss = nullptr;
  int* counts = nullptr;
  long long samples = 0;

  void reset_sums() {
    check(cudaMemsetAsync(loss, 0, sizeof(double), stream), "cudaMemsetAsync");
    check(cudaMemsetAsync(counts, 0, 2 * sizeof(int), stream), "cudaMemsetAsync");
  }
};

Model* create(const Config& c, const float* w1, const float* b1, const float* w2, const float* b2) {
  check(cudaSetDevice(c.device), "cudaSetDevice");
  auto m = std::make_unique<Model>();
  m->c = c;
  m->stream = static_cast<cudaStream_t>(c.stream);
  check(cublasCreate(&m->blas), "cublasCreate");
  check(cublasSetStream(m->blas, m->stream), "cublasSetStream");
  const std::size_t n1 = static_cast<std::size_t>(c.in) * c.hidden, n2 = static_cast<std::size_t>(c.hidden) * c.classes;
  auto upload = [&](Buffer& b, const float* host, std::size_t n) {
    b.ensure(n);
    check(cudaMemcpy(b.p, host, n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  };
  auto zeros = [&](Buffer& b, std::size_t n) {
    b.ensure(n);
    check(cudaMemset(b.p, 0, n * sizeof(float)), "cudaMemset");
  };
  upload(m->w1, w1, n1), upload(m->b1, b1, c.hidden), upload(m->w2, w2, n2), upload(m->b2, b2, c.classes);
  zeros(m->v_w1, n1), zeros(m->v_b1, c.hidden), zeros(m->v_w2, n2), zeros(m->v_b2, c.classes);
  m->g_w1.ensure(n1), m->g_b1.ensure(c.hidden), m->g_w2.ensure(n2), m->g_b2.ensure(c.classes);
  check(cudaMalloc(&m->loss, sizeof(double)), "cudaMalloc");
  check(cudaMalloc(&m->counts, 2 * sizeof(int)), "cudaMalloc");
  m->reset_sums();
  return m.release();
}

void destroy(Model* m) noexcept {
  if (!m) return;
  cudaStreamSynchronize(m->stream);
  cudaFree(m->loss);
  cudaFree(m->counts);
  cublasDestroy(m->blas);
  delete m;
}

namespace {
std::size_t count_of(const Model* m, int k) {
  const std::size_t n1 = static_cast<std::size_t>(m->c.in) * m->c.hidden,
                    n2 = static_cast<std::size_t>(m->c.hidden) * m->c.classes;
  const std::size_t sizes[4] = {n1, static_cast<std::size_t>(m->c.hidden), n2, static_cast<std::size_t>(m->c.classes)};
  return sizes[k % 4];
}
Buffer& buffer_of(Model* m, int k) {
  Buffer* b[8] = {&m->w1, &m->b1, &m->w2, &m->b2, &m->v_w1, &m->v_b1, &m->v_w2, &m->v_b2};
  return *b[k];
}
}  // namespace

void save(Model* m, float* const arrays[8]) {
  check(cudaStreamSynchronize(m->stream), "cudaStreamSynchronize");
  for (int k = 0; k < 8; ++k)
    check(cudaMemcpy(arrays[k], buffer_of(m, k).p, count_of(m, k) * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
}

void load(Model* m, const float* const arrays[8]) {
  check(cudaStreamSynchronize(m->stream), "cudaStreamSynchronize");
  for (int k = 0; k < 8; ++k)
    check(cudaMemcpy(buffer_of(m, k).p, arrays[k], count_of(m, k) * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
}

void take(Model* m, double* loss, long long* correct, long long* samples) {
  int counts[2] = {0, 0};
  check(cudaMemcpyAsync(loss, m->loss, sizeof(double), cudaMemcpyDeviceToHost, m->stream), "cudaMemcpyAsync");
  check(cudaMemcpyAsync(counts, m->counts, sizeof counts, cudaMemcpyDeviceToHost, m->stream), "cudaMemcpyAsync");
  check(cudaStreamSynchronize(m->stream), "cudaStreamSynchronize");
  if (counts[1] != 0) throw std::runtime_error("demo MLP: " + std::to_string(counts[1]) + " labels out of range");
  *correct = counts[0];
  *samples = m->samples;
  m->samples = 0;
  m->reset_sums();
}

void step(Model* m, const float* x, const long long* y, int B, bool learn) {
  const int I = m->c.in, H = m->c.hidden, K = m->c.classes;
  const cudaStream_t s = m->stream;
  m->h.ensure(static_cast<std::size_t>(B) * H);
  m->dh.ensure(static_cast<std::size_t>(B) * H);
  m->z.ensure(static_cast<std::size_t>(B) * K);
  const float one = 1, zero = 0;
  // h = relu(x W1 + b1): column-major, h^T (H x B) = W1^T (H x I) x^T (I x B).
  check(cublasSgemm(m->blas, CUBLAS_OP_N, CUBLAS_OP_N, H, B, I, &one, m->w1.p, H, x, I, &zero, m->h.p, H), "sgemm h");
  bias_relu<<<blocks(static_cast<long long>(B) * H), 256, 0, s>>>(m->h.p, m->b1.p, B, H, true);
  // z = h W2 + b2.
  check(cublasSgemm(m->blas, CUBLAS_OP_N, CUBLAS_OP_N, K, B, H, &one, m->w2.p, K, m->h.p, H, &zero, m->z.p, K), "sgemm z");
  bias_relu<<<blocks(static_cast<long long>(B) * K), 256, 0, s>>>(m->z.p, m->b2.p, B, K, false);
  softmax_xent<<<blocks(B), 256, 0, s>>>(m->z.p, y, B, K, m->loss, m->counts, m->counts + 1);  // z := dz
  check(cudaGetLastError(), "kernel launch");
  m->samples += B;
  if (!learn) return;
  // dW2 = h^T dz: dW2^T (K x H) = dz^T (K x B) h (B x H).
  check(cublasSgemm(m->blas, CUBLAS_OP_N, CUBLAS_OP_T, K, H, B, &one, m->z.p, K, m->h.p, H, &zero, m->g_w2.p, K), "sgemm dW2");
  column_sums<<<blocks(K), 256, 0, s>>>(m->z.p, m->g_b2.p, B, K);
  // dh = dz W2^T, masked by the ReLU: dh^T (H x B) = W2 (H x K) dz^T (K x B).
  check(cublasSgemm(m->blas, CUBLAS_OP_T, CUBLAS_OP_N, H, B, K, &one, m->w2.p, K, m->z.p, K, &zero, m->dh.p, H), "sgemm dh");
  relu_backward<<<blocks(static_cast<long long>(B) * H), 256, 0, s>>>(m->dh.p, m->h.p, B * H);
  // dW1 = x^T dh: dW1^T (H x I) = dh^T (H x B) x (B x I).
  check(cublasSgemm(m->blas, CUBLAS_OP_N, CUBLAS_OP_T, H, I, B, &one, m->dh.p, H, x, I, &zero, m->g_w1.p, H), "sgemm dW1");
  column_sums<<<blocks(H), 256, 0, s>>>(m->dh.p, m->g_b1.p, B, H);
  if (m->c.reduce_gradients) {
    float* const grads[4] = {m->g_w1.p, m->g_b1.p, m->g_w2.p, m->g_b2.p};
    const long long sizes[4] = {static_cast<long long>(I) * H, H, static_cast<long long>(H) * K, K};
    m->c.reduce_gradients(m->c.reduce_ctx, grads, sizes);
  }
  auto update = [&](Buffer& w, Buffer& v, Buffer& g, std::size_t n) {
    sgd_momentum<<<blocks(static_cast<long long>(n)), 256, 0, s>>>(w.p, v.p, g.p, static_cast<int>(n), m->c.lr, m->c.momentum);
  };
  update(m->w1, m->v_w1, m->g_w1, static_cast<std::size_t>(I) * H);
  update(m->b1, m->v_b1, m->g_b1, static_cast<std::size_t>(H));
  update(m->w2, m->v_w2, m->g_w2, static_cast<std::size_t>(H) * K);
  update(m->b2, m->v_b2, m->g_b2, static_cast<std::size_t>(K));
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace demo::gpu
