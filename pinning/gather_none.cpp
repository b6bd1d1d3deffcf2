// The device gather without nvcc: the loader takes the host path (Gather::Auto) or says why not.
#include "ferry/pinning/cuda.h"
#include "gather_kernel.h"

namespace ferry::detail {

bool gather_built() noexcept { return false; }

void launch_gather(const std::int64_t*, std::int64_t, const GatherField*, int, void*) {
  throw CudaError("device gather: this build of ferry has no gather kernel (CMake found no CUDA compiler)");
}

}  // namespace ferry::detail
