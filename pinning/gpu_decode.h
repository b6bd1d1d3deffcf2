// pinning/gpu_decode.h — nvJPEG batched decode plus the fused transform kernel (GPU decode).
// Private to ferry_pinning; built only where CMake finds nvJPEG (FERRY_HAVE_NVJPEG).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ferry::detail {

class GpuJpegDecoder {
 public:
  virtual ~GpuJpegDecoder() = default;
  /// Host side, before the index is copied to the device: gives each image its place in the
  /// decoded scratch (index word 29), growing the scratch if needed (constant after warm-up).
  virtual void prepare(std::int64_t* index, int rows) = 0;
  /// On `stream` (a cudaStream_t): decodes the images of `base` (pinned host bytes) into the
  /// scratch, then runs the fused kernel from `index_dev` into `out`. Throws DataError for a JPEG
  /// no backend decodes, CudaError for CUDA failures.
  virtual void run(const std::byte* base, const std::int64_t* index, const std::int64_t* index_dev, int rows, void* out,
                   void* stream) = 0;
  virtual std::string backend() const = 0;
  virtual std::uint64_t allocations() const = 0;
};

/// Whether this build has nvJPEG.
bool gpu_decode_built() noexcept;
/// A decoder on `device`; CudaError without nvJPEG or when nvJPEG cannot start.
std::unique_ptr<GpuJpegDecoder> make_gpu_jpeg_decoder(int device);

}  // namespace ferry::detail
