// The device gather's kernel: a batch's rows read from mapped host memory into device memory.
//
// One thread moves one word (16, 8, 4 or 1 bytes: the widest every row start and both buffers
// align to) of one row, so small rows (8-byte labels, 3 KB feature rows) keep as many reads in
// flight as large ones; a grid-stride loop covers the batch. Reads cross the link as the GPU asks
// for them, so what matters is how many are outstanding: 256 threads a block and enough blocks for
// every SM keep the link busy (0.9 of a pinned copy's rate in the probe of the issue).
#include <cuda_runtime_api.h>

#include <string>

#include "ferry/pinning/cuda.h"
#include "gather_kernel.h"

namespace ferry::detail {
namespace {

template <class Word>
__global__ void gather_rows(const std::int64_t* __restrict__ index, std::int64_t rows, const Word* __restrict__ src,
                            std::size_t words_per_row, Word* __restrict__ dst) {
  const std::size_t total = static_cast<std::size_t>(rows) * words_per_row;
  for (std::size_t e = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::size_t r = e / words_per_row, w = e - r * words_per_row;
    dst[e] = src[static_cast<std::size_t>(index[r]) * words_per_row + w];
  }
}

template <class Word>
void launch(const std::int64_t* index, std::int64_t rows, const void* src, std::size_t row_bytes, void* dst,
            cudaStream_t stream) {
  const std::size_t words = row_bytes / sizeof(Word), total = static_cast<std::size_t>(rows) * words;
  if (total == 0) return;
  const std::size_t blocks = std::min<std::size_t>((total + 255) / 256, 4096);
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
