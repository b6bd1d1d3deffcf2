// The device gather's half of the route (Note [Device gather] in ferry/pinning/gather.h): the
// dataset's registered fields, each batch's index words, and the gathers issued from them. The
// route makes one when it gathers; nothing else of the loader reads the fields. Private to this
// folder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ferry/core/rows.h"
#include "ferry/detail/loader_core.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/gather.h"

namespace ferry::detail {

/// A device-gather batch before the device stage: its sample indices, in a pinned block.
struct GatherIndex {
  Tensor index;  ///< int64 [B]
};

class GatherPath {
 public:
  /// Registers `fields` with CUDA on `device` (RowRegistration): Error, naming why, where it
  /// cannot (over `register_limit`, no mapping...).
  GatherPath(std::vector<HostRows> fields, int device, std::size_t register_limit);
  GatherPath(const GatherPath&) = delete;
  GatherPath& operator=(const GatherPath&) = delete;
  /// The registration is undone here: the owner first waits for the copy stream, whose gathers
  /// read the registered arrays.
  ~GatherPath();

  /// Bytes a batch of `batch_size` rows takes on the device (every field).
  std::size_t batch_bytes(std::size_t batch_size) const noexcept;

  /// The index words of a batch of `indices` (a worker's or the pin thread's step): each sample's
  /// row, its flip drawn as (seed, epoch, index) (RowFlips), or its window's start for windowed
  /// fields; Error for a window past a field's end.
  Tensor index(std::span<const std::size_t> indices, std::size_t dataset_size, BatchAllocator& allocator, std::uint64_t seed,
               std::uint64_t epoch) const;

  /// The batch of `index`, made by the GPU on the stage's copy stream: the index's copy when it
  /// is too large to travel in the launch, then one gather a field, now or held beside other
  /// small batches (`hold`; DeviceStage::end_held). A held batch's fence is set by flush(), before
  /// the pin stage hands it over. Runs on the pin thread.
  Payload batch(DeviceStage& stage, TypedBatches& typed, const Tensor& index, bool hold);
  /// Issues the held batches' launch and gives each its fence (or one carrying the launch's
  /// error, rethrown). Pin thread.
  void flush(DeviceStage& stage);

 private:
  std::vector<HostRows> fields_;
  double flip_p_ = 0;  // the flip a sample draws for the fields' row transforms (RowTransform::flip_p)
  std::unique_ptr<RowRegistration> registration_;
  std::vector<std::shared_ptr<const EventFence>*> held_;  // DeviceBatch::copied of the held batches
};

}  // namespace ferry::detail
