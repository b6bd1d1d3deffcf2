#include <chrono>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels.h"

namespace ferry::test {
namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
__device__ std::uint32_t dpattern(std::int64_t index, std::int64_t col) {
  return static_cast<std::uint32_t>(index) * 2654435761u ^ (static_cast<std::uint32_t>(col) * 40503u + 0x9E37u);
}
__global__ void verify(const std::uint32_t* data, const std::int64_t* index, int rows, int cols, unsigned long long* bad) {
  unsigned long long local = 0;
  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < static_cast<long long>(rows) * cols;
       i += gridDim.x * blockDim.x) {
    const int r = static_cast<int>(i / cols), c = static_cast<int>(i % cols);
    local += data[i] != dpattern(index[r], c);
  }
  if (local) atomicAdd(bad, local);
}
__global__ void differ(const std::int64_t* got, const std::int64_t* want, int n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) local += got[i] != want[i];
  if (local) atomicAdd(bad, local);
}
// A fixed amount of arithmetic on every SM (a stand-in for a model's step: its time grows when
// other kernels take SMs from it, unlike spin's clock-based wait).
__global__ void work(float* out, long long iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f;
  for (long long i = 0; i < iters; ++i) a = a * b + 1e-7f;
  if (a == 12345.0f) out[0] = a;  // keeps the loop
}
}  // namespace

void launch_work(void* stream, long long iters, int blocks_per_sm) {
  int sms = 0, dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  work<<<sms * blocks_per_sm, 256, 0, static_cast<cudaStream_t>(stream)>>>(nullptr, iters);
  check(cudaGetLastError(), "work kernel launch");
}

void launch_spin(void* stream, double microseconds) {
  int khz = 0, dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev), "cudaDeviceGetAttribute");
  spin<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<long long>(microseconds * khz / 1000.0));
  check(cudaGetLastError(), "spin kernel launch");
}

void* record_event(void* stream) {
  cudaEvent_t e = nullptr;
  check(cudaEventCreate(&e), "cudaEventCreate");
  check(cudaEventRecord(e, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
  return e;
}

double event_ms(void* a, void* b) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(a)), "cudaEventSynchronize");
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(b)), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a), static_cast<cudaEvent_t>(b)), "cudaEventElapsedTime");
  return ms;
}

void destroy_event(void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

double step_alone_ms(void* stream, double step_ms, int steps) {
  auto s = static_cast<cudaStream_t>(stream);
  for (int k = 0; k < 3; ++k) launch_spin(stream, step_ms * 1000);
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < steps; ++k) {
    launch_spin(stream, step_ms * 1000);
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
}

void launch_check(void* stream, const std::uint32_t* data, const std::int64_t* index, int rows, int cols,
                  unsigned long long* bad) {
  verify<<<64, 256, 0, static_cast<cudaStream_t>(stream)>>>(data, index, rows, cols, bad);
  check(cudaGetLastError(), "verify kernel launch");
}

void launch_count_differences(void* stream, const std::int64_t* got, const std::int64_t* want, int n, unsigned long long* bad) {
  differ<<<4, 256, 0, static_cast<cudaStream_t>(stream)>>>(got, want, n, bad);
  check(cudaGetLastError(), "differ kernel launch");
}

unsigned long long* alloc_counter() {
  unsigned long long* p = nullptr;
  check(cudaMalloc(&p, sizeof(*p)), "cudaMalloc");
  check(cudaMemset(p, 0, sizeof(*p)), "cudaMemset");
  return p;
}
unsigned long long read_counter(unsigned long long* counter) {
  unsigned long long v = 0;
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaMemcpy(&v, counter, sizeof(v), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return v;
}
void free_counter(unsigned long long* counter) { cudaFree(counter); }
}  // namespace ferry::test
