// libFuzzer targets for the loaders' parsers: one binary per format, chosen at compile time
// (FERRY_FUZZ_IDX, _NPY, _TAR, _IMAGE). Any input must either parse or raise ferry::DataError
// (a clear error); anything else (a crash, an ASan/UBSan report, another exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/ferry.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
#if defined(FERRY_FUZZ_IDX)
    (void)ferry::parse_idx(bytes, "fuzz.idx");
#elif defined(FERRY_FUZZ_NPY)
    (void)ferry::parse_npy(bytes, "fuzz.npy");
#elif defined(FERRY_FUZZ_TAR)
    ferry::TarReader reader(bytes, "fuzz.tar");
    while (reader.next()) {
    }
#elif defined(FERRY_FUZZ_IMAGE)
    // Small pixel limit: the fuzzer looks for crashes, not for large images.
    ferry::Tensor t = ferry::decode_image(bytes, "fuzz.img", {.channels = 3, .max_pixels = 1 << 20});
    ferry::Generator g(size);
    (void)ferry::ImageTransform().random_resized_crop(16, 16).horizontal_flip().to_float()(t, g);
#endif
  } catch (const ferry::DataError&) {
    // the expected outcome for malformed input
  }
  return 0;
}
