// ferry/loaders/sample.h — the sample and batch types the image loaders produce.
//
// IdxDataset, ImageFolder and the tar-shard image decoder yield LabeledSample; the loader's
// default collate turns a batch of them into a LabeledBatch (images stacked, labels as int64):
//
//   for (ferry::LabeledBatch& b : loader) {
//     b.image;   // [B, ...] uint8, or float32 after to_float()
//     b.label;   // [B] int64
//   }
//
// Both pin and move to the device as a whole (the pin thread and the device stage walk the fields).
#pragma once

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "ferry/collate/collate.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// One image (or any tensor) and its class index.
struct LabeledSample {
  Tensor image;
  std::int64_t label = 0;
};

/// A collated batch of LabeledSamples.
struct LabeledBatch {
  Tensor image;  ///< [B, ...]
  Tensor label;  ///< [B] int64
  /// GPU decode (ImageFolderOptions::decode = Gpu), until the device stage: the batch's compressed
  /// images in one pinned block (uint8) and one row per image (int64 [B, kEncodedIndexWords]: where
  /// its bytes are and its transform's plan). The device stage decodes them into `image` and
  /// clears both; the consumer never sees them.
  Tensor encoded{};
  Tensor encoded_index{};
  /// Pins (or moves to the device) both tensors; called by the pin thread and the device stage
  /// with a ferry::PinContext (a template so this header needs no pinning header). On the device,
  /// encoded images are decoded (PinContext::decode_images).
  template <class PinContext>
  void pin_memory(PinContext& ctx) {
    if (encoded.defined() && ctx.to_device()) {
      const Tensor index_on_device = ctx.pin(encoded_index);
      image = ctx.decode_images(encoded, encoded_index, index_on_device);
      label = ctx.pin(label);
      if (!ctx.measuring()) {
        encoded = Tensor();
        encoded_index = Tensor();
      }
      return;
    }
    image = ctx.pin(image);
    label = ctx.pin(label);
    encoded = ctx.pin(encoded);
    encoded_index = ctx.pin(encoded_index);
  }
  /// The device gather's batch (ferry/core/rows.h, FieldsBatch): image and label, in that order.
  static constexpr std::size_t kGatheredFields = 2;
  static LabeledBatch from_fields(std::vector<Tensor>&& fields) {
    LabeledBatch b;
    b.image = std::move(fields.at(0));
    b.label = std::move(fields.at(1));
    return b;
  }
  /// Keeps the first `rows` rows (views of the same buffers); used by on_error = Skip.
  void truncate_rows(std::size_t rows) {
    const auto n = static_cast<std::int64_t>(rows);
    if (image.defined()) image = image.narrow(0, n);
    label = label.narrow(0, n);
    if (encoded_index.defined()) encoded_index = encoded_index.narrow(0, n);
  }
};

template <>
struct CollateFields<LabeledSample> {
  using batch_type = LabeledBatch;
  static constexpr auto fields = std::make_tuple(std::pair{&LabeledSample::image, &LabeledBatch::image},
                                                 std::pair{&LabeledSample::label, &LabeledBatch::label});
};

}  // namespace ferry
