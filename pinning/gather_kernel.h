// pinning/gather_kernel.h — the device gather's kernel (Note [Device gather], ferry/pinning/gather.h).
// Private to ferry_pinning; built where CMake finds nvcc (gather.cu), else a stub (gather_none.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry::detail {

/// Whether this build has the gather kernel.
bool gather_built() noexcept;
/// On `stream` (a cudaStream_t): dst row i = src row index[i], for i < rows, `row_bytes` each.
/// `index` is on the device; `src` a device-mapped host address. Throws CudaError on a failed launch.
void launch_gather(const std::int64_t* index, std::int64_t rows, const void* src, std::size_t row_bytes, void* dst,
                   void* stream);

}  // namespace ferry::detail
