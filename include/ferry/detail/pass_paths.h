// ferry/detail/pass_paths.h — which of the CPU image pass's kernels runs, for tests.
//
// The pass (loaders/image_pass.cpp) writes 3-channel uint8 images with AVX2 where the CPU has it
// and with SSE2 otherwise; both give the same values bit for bit. Tests turn the AVX2 kernels off
// to check the other path on a machine that has AVX2. Not for direct use.
#pragma once

namespace ferry::detail {

/// Lets the pass use its AVX2 kernels (the default) or not, process-wide; returns whether they
/// run now (false where the CPU or the build has none).
bool allow_avx2_pass(bool allowed) noexcept;

}  // namespace ferry::detail
