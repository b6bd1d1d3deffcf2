// Builds without nvJPEG: GPU decode reports that it is not there (DeviceStage::decode_images).
#include "gpu_decode.h"

#include "ferry/pinning/cuda.h"

namespace ferry::detail {

bool gpu_decode_built() noexcept { return false; }

std::unique_ptr<GpuJpegDecoder> make_gpu_jpeg_decoder(int) {
  throw CudaError("GPU decode: this build of ferry has no nvJPEG");
}

}  // namespace ferry::detail
