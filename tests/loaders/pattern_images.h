// pattern_images: uint8 image tensors for the device gather's transform tests (CPU and GPU).
// Apart from files.h, which the fuzz targets include without ferry's headers.
#pragma once

#include <cstdint>

#include "ferry/core/tensor.h"

namespace ferry::test {

/// n uint8 images of h x w (x c when c > 0: HWC), a pattern that differs between rows, columns
/// and images.
inline Tensor pattern_images(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c) {
  Tensor t = Tensor::empty(DType::UInt8, c ? Shape{n, h, w, c} : Shape{n, h, w});
  for (std::size_t i = 0; i < t.nbytes(); ++i)
    static_cast<std::uint8_t*>(t.raw())[i] = static_cast<std::uint8_t>(i * 37 + i / 97);
  return t;
}

}  // namespace ferry::test
