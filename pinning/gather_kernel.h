// pinning/gather_kernel.h — the device gather's kernel (Note [Device gather], ferry/pinning/gather.h).
// Private to ferry_pinning; built where CMake finds nvcc (gather.cu), else a stub (gather_none.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry::detail {

/// Fields one launch gathers at most.
constexpr int kMaxGatherFields = 8;
/// Rows whose indices travel in the launch's own parameters (CUDA takes 32 KB of them on Volta
/// and later): no copy of the index, no pinned block to fence.
constexpr std::int64_t kGatherIndexInLaunch = 3072;

struct GatherField {
  const void* src;  ///< a device-mapped host address: row 0 of the array
  void* dst;        ///< device memory: row 0 of the batch's field
  std::size_t row_bytes;
};

/// Whether this build has the gather kernel.
bool gather_built() noexcept;
/// On `stream` (a cudaStream_t): for each field, dst row i = src row index[i], i < rows. `index`
/// is host memory read at the call (rows <= kGatherIndexInLaunch) when `index_on_host`, else
/// device memory. Throws CudaError on a failed launch.
void launch_gather(const std::int64_t* index, bool index_on_host, std::int64_t rows, const GatherField* fields, int nfields,
                   void* stream);

}  // namespace ferry::detail
