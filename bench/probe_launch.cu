// probe_launch — what the host pays for the calls a device-gather launch is made of: a kernel
// launch by the size of its parameters (the gather's indices travel in them: Args<3072> is about
// 28 KB), a 24 KB index staged in pinned memory and copied instead, and the event calls around a
// launch. Each call back to back 20,000 times on one stream (launches: a 132-block kernel that
// does nothing, the stream synchronized every 64 so the queue never fills), the host's wall time
// a call. Run twice; the second pass is the one to read.
//
//   build/gpu/bench/probe_launch
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>

namespace {

template <int B>
struct Params {
  char b[B];
};
template <int B>
__global__ void noop(const __grid_constant__ Params<B> p) {
  if (threadIdx.x == 0 && p.b[0] == 123) printf("x");  // reads the parameters; never true
}

using Clock = std::chrono::steady_clock;
double us(Clock::time_point a, Clock::time_point b, int n) {
  return std::chrono::duration<double, std::micro>(b - a).count() / n;
}

template <int B>
void launches(cudaStream_t s, int n) {
  Params<B> p;
  std::memset(&p, 1, sizeof p);
  for (int i = 0; i < 100; ++i) noop<B><<<132, 256, 0, s>>>(p);
  cudaStreamSynchronize(s);
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    p.b[1] = static_cast<char>(i);
    noop<B><<<132, 256, 0, s>>>(p);
    if (i % 64 == 63) cudaStreamSynchronize(s);
  }
  const auto t1 = Clock::now();
  cudaStreamSynchronize(s);
  std::printf("launch, %6d B of parameters: %.2f us a launch\n", B, us(t0, t1, n));
}

}  // namespace

int main() {
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "probe_launch: no CUDA device\n");
    return 1;
  }
  const int n = 20000;
  for (int pass = 0; pass < 2; ++pass) {
    std::printf("# pass %d\n", pass + 1);
    launches<64>(s, n);
    launches<4096>(s, n);
    launches<8192>(s, n);
    launches<16384>(s, n);
    launches<28000>(s, n);
    launches<32000>(s, n);
  }
  void* h = nullptr;
  void* d = nullptr;
  cudaHostAlloc(&h, 1 << 20, 0);
  cudaMalloc(&d, 1 << 20);
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    char* src = static_cast<char*>(h) + (i % 32) * 24576;
    std::memset(src, i, 24576);
    cudaMemcpyAsync(static_cast<char*>(d) + (i % 32) * 24576, src, 24576, cudaMemcpyHostToDevice, s);
    if (i % 64 == 63) cudaStreamSynchronize(s);
  }
  auto t1 = Clock::now();
  std::printf("24 KB written to pinned memory + cudaMemcpyAsync: %.2f us\n", us(t0, t1, n));
  cudaStreamSynchronize(s);
  cudaEvent_t ev[64];
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    cudaEventCreateWithFlags(&ev[i % 64], cudaEventDisableTiming | cudaEventBlockingSync);
    cudaEventRecord(ev[i % 64], s);
    if (i % 64 == 63) {
      cudaStreamSynchronize(s);
      for (cudaEvent_t& e : ev) cudaEventDestroy(e);
    }
  }
  t1 = Clock::now();
  cudaStreamSynchronize(s);
  for (int i = 0; i < n % 64; ++i) cudaEventDestroy(ev[i]);  // the last, partial round's
  std::printf("cudaEventCreate + cudaEventRecord (+ cudaEventDestroy): %.2f us\n", us(t0, t1, n));
  cudaEventCreateWithFlags(&ev[0], cudaEventDisableTiming);
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) cudaEventRecord(ev[0], s);
  t1 = Clock::now();
  std::printf("cudaEventRecord: %.2f us\n", us(t0, t1, n));
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) cudaEventQuery(ev[0]);
  t1 = Clock::now();
  std::printf("cudaEventQuery: %.2f us\n", us(t0, t1, n));
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) cudaStreamWaitEvent(s, ev[0], 0);
  t1 = Clock::now();
  std::printf("cudaStreamWaitEvent: %.2f us\n", us(t0, t1, n));
  int dev = 0;
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    cudaGetDevice(&dev);
    cudaSetDevice(dev);
  }
  t1 = Clock::now();
  std::printf("cudaGetDevice + cudaSetDevice: %.2f us\n", us(t0, t1, n));
  cudaEventDestroy(ev[0]);
  cudaFree(d);
  cudaFreeHost(h);
  cudaStreamDestroy(s);
  return 0;
}
