// The device gather: a batch's rows read from mapped host memory into device memory. This file
// is its host side; the kernel is gather_kernels.cuh's, one launch a translation unit.
//
// One launch gathers every field of a batch, or of several batches (DeviceStage::end_held), and
// the indices travel in the launch's parameters (no index copy, no pinned block to fence), which
// is what a small-row batch's host time is made of: as 32-bit words (the row, the flip in the top
// bit) where every row fits 31 bits, up to kGatherNarrowIndexInLaunch of them, else as the
// 64-bit index words, up to kGatherIndexInLaunch. A launch costs the pin thread more the more
// parameters it carries (about 4 us with 64 bytes, 9 us with 28 KB on an H100 host,
// bench/probe_launch), so the narrow words let one launch carry twice the batches.
// Each word (16, 8, 4 or 1 bytes: the widest every row start and both buffers align to) of the
// batch is one element; consecutive threads take consecutive words of a row, so the link sees
// long runs. Reads of mapped host memory take a round trip over the link, so what sets the rate is
// how many are outstanding, not how many threads wait on them: each thread issues kUnroll
// independent loads before it stores any, and the grid is one block of 256 threads a SM. That
// leaves the SMs to the training step running beside it on another stream (a grid of a block
// every 256 words filled every SM with stalled warps and slowed a 10 ms step by 80%, bench_gather).
// A field with a row transform (ferry::RowTransform) is read the same way, word by word; each
// byte of a word is then written where the transform puts it (mirrored when the row's index
// carries kGatherFlipBit, CHW or HWC) as a * v + b in the output's type (pass_math.h, compiled
// without contraction like the CPU pass, so the values are its bits). Its grid is sized by the
// bytes it writes, not the words it reads, up to two blocks a SM (one left a small batch, 784-byte
// Fashion-MNIST rows, on 6 SMs at 34 us of GPU time a batch).
// Rows of 64 KiB and more, untransformed, with their indices on the host, go by the copy engines
// instead (one cudaMemcpyBatchAsync a field: a copy a row), which reach the link where SM loads of
// mapped memory stop near 0.87 of it; smaller rows cost the engines more a copy than they carry.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/pinning/cuda.h"
#include "gather_launch.h"

namespace ferry::detail {
namespace {
using gather_impl::launch;

// Whether this device reads registered host memory at its host address (then a mapped row's
// address is also the host address the copy engines take).
bool host_pointers_usable() {
  thread_local const bool usable = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    const bool ok = cudaDeviceGetAttribute(&v, cudaDevAttrCanUseHostPointerForRegisteredMem, dev) == cudaSuccess && v == 1;
    cudaGetLastError();
    return ok;
  }();
  return usable;
}

// Rows of at least this many bytes go by the copy engines instead of the kernel: a 150,528-byte
// row (3x224x224 uint8) moves at 0.99 of the link that way and 0.86-0.88 by SM loads; a
// 3,136-byte row at 0.16 that way (the engines' cost a copy), so small rows stay with the kernel
// (bench/probe_copy_gather.cpp, H200, CUDA 13.0).
constexpr std::size_t kCopyEngineRowBytes = std::size_t{64} << 10;

// A field's rows copied by the copy engines: one cudaMemcpyBatchAsync of a copy a row, in the
// stream's order (the rows' indices are on the host).
void copy_rows(const std::int64_t* index, const GatherField& f, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  thread_local std::vector<void*> dsts;
  thread_local std::vector<const void*> srcs;
  thread_local std::vector<std::size_t> sizes;
  const auto rows = static_cast<std::size_t>(f.rows);
  dsts.resize(rows);
  srcs.resize(rows);
  sizes.assign(rows, f.row_bytes);
  for (std::size_t r = 0; r < rows; ++r) {
    dsts[r] = static_cast<char*>(f.dst) + r * f.row_bytes;
    srcs[r] = static_cast<const char*>(f.src) + static_cast<std::size_t>(index[r] & ~kGatherFlipBit) * f.row_bytes;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  std::size_t attr_index = 0;
  const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), rows, &attr, &attr_index, 1, stream);
  if (e != cudaSuccess)
    throw CudaError(std::string("device gather: cudaMemcpyBatchAsync of ") + std::to_string(rows) +
                    " rows failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
#else
  (void)index, (void)f, (void)stream;
  throw CudaError("device gather: the copy engines' gather needs CUDA 13");
#endif
}

bool by_copy_engines(const GatherField& f) {
#if CUDART_VERSION >= 13000
  return !f.index_dev && f.out_kind < 0 && f.window == 0 && f.row_bytes >= kCopyEngineRowBytes && f.rows > 0 &&
         host_pointers_usable();
#else
  (void)f;
  return false;
#endif
}

}  // namespace

bool gather_built() noexcept { return true; }

void launch_gather(const std::int64_t* host_index, std::int64_t host_rows, const GatherField* fields, int nfields, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (nfields < 1 || nfields > kMaxGatherFields)
    throw CudaError("device gather: " + std::to_string(nfields) + " fields in one launch");
  for (int k = 0; k < nfields; ++k)
    if (!fields[k].index_dev &&
        (fields[k].rows < 0 || fields[k].index_offset < 0 || fields[k].index_offset + fields[k].rows > host_rows))
      throw CudaError("device gather: field " + std::to_string(k) + "'s rows lie outside the launch's " +
                      std::to_string(host_rows) + " host indices");
  const bool narrow = narrow_rows(host_index, host_rows);  // then put_index writes 32-bit words
  if (host_rows > (narrow ? kGatherNarrowIndexInLaunch : kGatherIndexInLaunch))
    throw CudaError("device gather: " + std::to_string(host_rows) + " host indices do not fit a launch's parameters" +
                    (narrow ? "" : " (rows past 2^31 take 64 bits an index)"));
  // Large untransformed rows with host indices go by the copy engines; the rest by one kernel.
  GatherField rest[kMaxGatherFields];
  int nrest = 0;
  for (int k = 0; k < nfields; ++k) {
    if (by_copy_engines(fields[k]))
      copy_rows(host_index + fields[k].index_offset, fields[k], s);
    else
      rest[nrest++] = fields[k];
  }
  if (nrest == 0) return;
  if (host_rows <= 0)
    launch<0, std::uint32_t>(nullptr, 0, rest, nrest, s);
  else if (!narrow)
    launch<kGatherIndexInLaunch, std::int64_t>(host_index, host_rows, rest, nrest, s);
  else if (host_rows <= 256)
    launch<256, std::uint32_t>(host_index, host_rows, rest, nrest, s);
  else if (host_rows <= 1024)
    launch<1024, std::uint32_t>(host_index, host_rows, rest, nrest, s);
  else if (host_rows <= 3072)
    launch<3072, std::uint32_t>(host_index, host_rows, rest, nrest, s);
  else
    launch<kGatherNarrowIndexInLaunch, std::uint32_t>(host_index, host_rows, rest, nrest, s);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw CudaError(std::string("device gather: kernel launch failed: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                    ")");
}

}  // namespace ferry::detail
