// Builds without nvJPEG: GPU decode reports that it is not there (DeviceStage::decode_images).
#include "gpu_decode.h"

namespace ferry::detail {

bool gpu_decode_built() noexcept { return false; }

std::size_t lay_out_decode_scratch(std::int64_t*, int) { return 0; }

std::unique_ptr<GpuJpegDecoder> make_gpu_jpeg_decoder(int, int, bool) {
  throw CudaError("GPU decode: this build of ferry has no nvJPEG");
}

}  // namespace ferry::detail
