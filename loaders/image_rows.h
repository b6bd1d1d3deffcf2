// loaders/image_rows.h — private: how ImageFolder and TarImages turn one compressed image into a
// sample or a batch row, decoded on the CPU or left encoded for the device stage (decode = Gpu).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/loaders/image.h"
#include "ferry/loaders/sample.h"
#include "ferry/loaders/transforms.h"

namespace ferry::loaders {

/// A dataset's image settings, by reference (made per call: nothing is copied).
struct ImageRows {
  const ImageTransform& transform;
  int channels;
  std::int64_t max_pixels;
  bool dct_scaling;
  bool gpu;          ///< decode = Gpu: rows are compressed bytes in `encoded`
  std::size_t slot;  ///< gpu: bytes per image in a batch's encoded block
};

/// Error (naming `who`) unless channels == 3 and the transform runs as one pass to a fixed size.
void check_gpu_decode(const std::string& who, int channels, const ImageTransform& transform);
/// Bytes per image in an encoded block whose largest file has `largest` bytes.
inline std::size_t encoded_slot(std::size_t largest) { return (largest + 63) / 64 * 64; }

/// Decodes (and transforms) one image; `name` is used in errors.
LabeledSample image_sample(const ImageRows& rows, std::span<const std::byte> bytes, const std::string& name, std::int64_t label,
                           SampleContext& ctx);
/// A batch of `n` rows (decoded images, or an encoded block and its index under gpu).
LabeledBatch image_batch(const ImageRows& rows, std::size_t n, BatchAllocator& allocator, const std::string& who);
/// Fills row `row` of a batch made by image_batch.
void image_row_into(const ImageRows& rows, std::span<const std::byte> bytes, const std::string& name, std::int64_t label,
                    LabeledBatch& batch, std::size_t row, SampleContext& ctx);

/// This thread's reused buffer for one file's bytes.
std::vector<std::byte>& file_scratch();

}  // namespace ferry::loaders
