// The device gather's kernel: a batch's rows read from mapped host memory into device memory.
//
// Each word (16, 8, 4 or 1 bytes: the widest every row start and both buffers align to) of the
// batch is one element; consecutive threads take consecutive words of a row, so the link sees
// long runs. Reads of mapped host memory take a round trip over the link, so what sets the rate is
// how many are outstanding, not how many threads wait on them: each thread issues kUnroll
// independent loads before it stores any, and the grid is one block of 256 threads a SM. That
// leaves the SMs to the training step running beside it on another stream (a grid of a block
// every 256 words filled every SM with stalled warps and slowed a 10 ms step by 80%, bench_gather).
#include <cuda_runtime_api.h>

#include <algorithm>

#include <string>

#include "ferry/pinning/cuda.h"
#include "gather_kernel.h"

namespace ferry::detail {
namespace {

constexpr int kUnroll = 8;

template <class Word>
__global__ void gather_rows(const std::int64_t* __restrict__ index, std::int64_t rows, const Word* __restrict__ src,
                            std::size_t words_per_row, Word* __restrict__ dst) {
  const std::size_t total = static_cast<std::size_t>(rows) * words_per_row;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t base = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; base < total; base += stride * kUnroll) {
    Word v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t e = base + u * stride;
      if (e < total) {
        const std::size_t r = e / words_per_row, w = e - r * words_per_row;
        v[u] = src[static_cast<std::size_t>(index[r]) * words_per_row + w];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::size_t e = base + u * stride;
      if (e < total) dst[e] = v[u];
    }
  }
}

int sm_count() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaGetLastError();
  return sms > 0 ? sms : 16;
}

template <class Word>
void launch(const std::int64_t* index, std::int64_t rows, const void* src, std::size_t row_bytes, void* dst,
            cudaStream_t stream) {
  const std::size_t words = row_bytes / sizeof(Word), total = static_cast<std::size_t>(rows) * words;
  if (total == 0) return;
  thread_local const int sms = sm_count();
  const std::size_t blocks = std::min<std::size_t>((total + 256 * kUnroll - 1) / (256 * kUnroll), static_cast<std::size_t>(sms));
  gather_rows<Word><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(index, rows, static_cast<const Word*>(src), words,
                                                                        static_cast<Word*>(dst));
}

}  // namespace

bool gather_built() noexcept { return true; }

void launch_gather(const std::int64_t* index, std::int64_t rows, const void* src, std::size_t row_bytes, void* dst,
                   void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst) | row_bytes;
  if (a % 16 == 0) launch<uint4>(index, rows, src, row_bytes, dst, s);
  else if (a % 8 == 0) launch<unsigned long long>(index, rows, src, row_bytes, dst, s);
  else if (a % 4 == 0) launch<unsigned>(index, rows, src, row_bytes, dst, s);
  else launch<unsigned char>(index, rows, src, row_bytes, dst, s);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw CudaError(std::string("device gather: kernel launch failed: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace ferry::detail
