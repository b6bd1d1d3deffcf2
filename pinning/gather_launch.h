// The device gather's launches, one a size of the index parameters: declared here, each
// instantiated in its own translation unit (gather_launch.cu.in, made once a variant by
// pinning/CMakeLists.txt), so that nvcc compiles the six kernels in parallel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gather_kernel.h"

namespace ferry::detail::gather_impl {

/// One kernel launch gathering `fields` (gather.cu's launch_gather checks them): the host indices
/// in the launch's parameters, N of them at most, as Index words (std::uint32_t: narrow).
template <int N, class Index>
void launch(const std::int64_t* host_index, std::int64_t host_rows, const GatherField* fields, int nfields, cudaStream_t stream);

#define FERRY_GATHER_LAUNCH(N, Index) \
  extern template void launch<N, Index>(const std::int64_t*, std::int64_t, const GatherField*, int, cudaStream_t)
FERRY_GATHER_LAUNCH(0, std::uint32_t);
FERRY_GATHER_LAUNCH(256, std::uint32_t);
FERRY_GATHER_LAUNCH(1024, std::uint32_t);
FERRY_GATHER_LAUNCH(3072, std::uint32_t);
FERRY_GATHER_LAUNCH(kGatherNarrowIndexInLaunch, std::uint32_t);
FERRY_GATHER_LAUNCH(kGatherIndexInLaunch, std::int64_t);
#undef FERRY_GATHER_LAUNCH

}  // namespace ferry::detail::gather_impl
