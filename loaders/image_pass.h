// loaders/image_pass.h — the image pass's kernels: one bilinear pass over an image (Note [Fused
// transforms] in loaders/transforms.cpp says what an axis is), with AVX2 and SSE2 paths for RGB. Private
// to ferry_loaders: ImageTransform (transforms.cpp) plans the passes and runs them through these.
#pragma once

#include <cstdint>
#include <vector>

#include "ferry/core/tensor.h"

namespace ferry::detail {

struct Axis {
  std::int64_t c0 = 0, L0 = 0, R = 0, c1 = 0, N = 0;
  bool resized = false, flip = false, padded = false;
  static Axis identity(std::int64_t n) { return {0, n, n, 0, n, false, false, false}; }
  void crop(std::int64_t off, std::int64_t n) {
    c1 = flip ? c1 + N - off - n : c1 + off;
    N = n;
    if (c1 < 0 || c1 + N > R) padded = true;
  }
  void resize(std::int64_t n) {
    c0 += c1;  // only called when !resized && !padded: the window lies inside the source
    L0 = N;
    R = n;
    c1 = 0;
    N = n;
    resized = true;
  }
};

// Per output index: two source indices and a weight, or -1 for padding.
struct Tap {
  std::int64_t i0, i1;
  float w;
};

std::vector<Tap> taps(const Axis& a);

struct Image {  // HWC view
  const void* data;
  DType dtype;
  std::int64_t h, w, c;
};

/// An image tensor's HWC view; an Error names what is not an image (uint8 or float32, [H, W] or
/// [H, W, C], on the host).
Image image_of(const Tensor& t);

/// One bilinear pass from `in` into `out`. Output is HWC, or CHW when `chw`; `round` rounds the
/// interpolated value (uint8 semantics); the value written is a[c] * v + b[c]. In: uint8 or float;
/// Out: uint8 (from uint8), float, Half or BFloat16.
template <class In, class Out>
void run_pass(const Image& in, const Axis& ay, const Axis& ax, Out* out, bool chw, bool round, const float* a, const float* b);

}  // namespace ferry::detail
