// probe_copy_gather — can the copy engines gather rows? A batch of 256 rows drawn at random from a
// pinned host array, moved to the device three ways, each back to back for --seconds, beside the
// link (one contiguous pinned batch, cudaMemcpyAsync):
//   * one cudaMemcpyAsync a row (256 calls a batch);
//   * one cudaMemcpyBatchAsync a batch (CUDA 12.8+: the driver takes the 256 copies at once);
//   * the gather kernel is bench_gather's (SM loads of mapped host memory), not repeated here.
// For rows of 3,136 bytes (784 float32) and 150,528 bytes (3x224x224 uint8). Prints batches/s, the
// fraction of the link, and the host's CPU microseconds a batch (the calling thread).
//
//   build/gpu/bench/probe_copy_gather [--seconds 1]
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu_time.h"

namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "probe_copy_gather: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

struct Rate {
  double per_second = 0, cpu_us = 0;
};

// Batches a second of `batch` (which issues one batch on `s`), run back to back for `seconds`.
template <class F>
Rate run(double seconds, cudaStream_t s, F&& batch) {
  for (int k = 0; k < 20; ++k) batch();
  check(cudaStreamSynchronize(s), "warm-up");
  const auto t0 = std::chrono::steady_clock::now();
  long n = 0;
  double issue_cpu = 0;
  for (;;) {
    const double i0 = ferry::bench::thread_cpu_seconds();
    for (int k = 0; k < 50; ++k) batch();
    issue_cpu += ferry::bench::thread_cpu_seconds() - i0;
    n += 50;
    check(cudaStreamSynchronize(s), "a run");  // (the wait's own spinning is not counted as issue time)
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= seconds) break;
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {static_cast<double>(n) / wall, issue_cpu / static_cast<double>(n) * 1e6};
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 1;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--seconds") seconds = std::atof(argv[i + 1]);
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("# probe_copy_gather — %s, CUDA runtime %d, batch 256, %.1f s a row\n\n", prop.name, runtime, seconds);
  std::printf("| rows of | method | batches/s | of the link | host CPU a batch (issue) |\n|---:|---|---:|---:|---:|\n");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const int B = 256;
  for (const std::size_t row : {std::size_t{3136}, std::size_t{150528}}) {
    const std::size_t rows = row < 10000 ? 60000 : 2048;
    void* host = nullptr;
    check(cudaHostAlloc(&host, rows * row, cudaHostAllocPortable), "cudaHostAlloc");
    std::memset(host, 7, rows * row);
    void* dev = nullptr;
    check(cudaMalloc(&dev, B * row), "cudaMalloc");
    std::mt19937 rng(1);
    std::vector<std::vector<std::size_t>> draws(64, std::vector<std::size_t>(B));
    for (auto& d : draws)
      for (auto& r : d) r = rng() % rows;
    std::size_t next = 0;
    const Rate link = run(seconds, s, [&] { check(cudaMemcpyAsync(dev, host, B * row, cudaMemcpyHostToDevice, s), "link"); });
    std::printf("| %zu B | cudaMemcpyAsync of one contiguous batch (the link) | %.0f | 1.00 | %.1f us |\n", row, link.per_second,
                link.cpu_us);
    const Rate each = run(seconds, s, [&] {
      const auto& d = draws[next++ % draws.size()];
      for (int i = 0; i < B; ++i)
        check(cudaMemcpyAsync(static_cast<char*>(dev) + i * row, static_cast<const char*>(host) + d[i] * row, row,
                              cudaMemcpyHostToDevice, s),
              "a row");
    });
    std::printf("| %zu B | cudaMemcpyAsync a row | %.0f | %.2f | %.1f us |\n", row, each.per_second,
                each.per_second / link.per_second, each.cpu_us);
#if CUDART_VERSION >= 12080
    std::vector<void*> dsts(B);
    std::vector<const void*> srcs(B);
    std::vector<std::size_t> sizes(B, row);
    for (int i = 0; i < B; ++i) dsts[i] = static_cast<char*>(dev) + i * row;
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t attr_index = 0;
    const Rate batched = run(seconds, s, [&] {
      const auto& d = draws[next++ % draws.size()];
      for (int i = 0; i < B; ++i) srcs[i] = static_cast<const char*>(host) + d[i] * row;
#if CUDART_VERSION >= 13000
      check(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), B, &attr, &attr_index, 1, s), "cudaMemcpyBatchAsync");
#else
      std::size_t fail = 0;
      check(cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), B, &attr, &attr_index, 1, &fail, s),
            "cudaMemcpyBatchAsync");
#endif
    });
    std::printf("| %zu B | cudaMemcpyBatchAsync a batch | %.0f | %.2f | %.1f us |\n", row, batched.per_second,
                batched.per_second / link.per_second, batched.cpu_us);
#endif
    cudaFree(dev);
    cudaFreeHost(host);
  }
  return 0;
}
