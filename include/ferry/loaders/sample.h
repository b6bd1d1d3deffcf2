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
  /// Pins (or moves to the device) both tensors; called by the pin thread and the device stage
  /// with a ferry::PinContext (a template so this header needs no pinning header).
  template <class PinContext>
  void pin_memory(PinContext& ctx) {
    image = ctx.pin(image);
    label = ctx.pin(label);
  }
  /// Keeps the first `rows` rows (views of the same buffers); used by on_error = Skip.
  void truncate_rows(std::size_t rows) {
    image = image.narrow(0, static_cast<std::int64_t>(rows));
    label = label.narrow(0, static_cast<std::int64_t>(rows));
  }
};

template <>
struct CollateFields<LabeledSample> {
  using batch_type = LabeledBatch;
  static constexpr auto fields =
      std::make_tuple(std::pair{&LabeledSample::image, &LabeledBatch::image}, std::pair{&LabeledSample::label, &LabeledBatch::label});
};

}  // namespace ferry
