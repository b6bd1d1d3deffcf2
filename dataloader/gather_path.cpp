// The device gather's half of the route (gather_path.h; Note [Device gather]).
#include "gather_path.h"

#include <string>
#include <utility>

#include "ferry/core/error.h"
#include "hand_over.h"

namespace ferry::detail {

GatherPath::GatherPath(std::vector<HostRows> fields, int device, std::size_t register_limit)
    : fields_(std::move(fields)), registration_(std::make_unique<RowRegistration>(fields_, device, register_limit)) {
  for (const HostRows& r : fields_)
    if (r.transform && r.transform->flip_p > 0) flip_p_ = r.transform->flip_p;
}

GatherPath::~GatherPath() = default;

std::size_t GatherPath::batch_bytes(std::size_t batch_size) const noexcept {
  std::size_t bytes = 0;
  for (const HostRows& f : fields_) bytes += batch_size * gathered_row_bytes(f);
  return bytes;
}

Tensor GatherPath::index(std::span<const std::size_t> indices, std::size_t dataset_size, BatchAllocator& allocator,
                         std::uint64_t seed, std::uint64_t epoch) const {
  Tensor index = gather_index(indices, dataset_size, allocator, RowFlips{flip_p_, seed, epoch});
  if (const HostRows& f = fields_.front(); f.window) {
    // Windows (RowWindow): each word is the sample's window start, the same for every field
    // (gather_unavailable refuses fields that mix windows and rows).
    std::int64_t* word = index.data<std::int64_t>();
    for (std::size_t k = 0; k < indices.size(); ++k) {
      const std::uint64_t start = f.window->start(indices[k], seed, epoch);
      for (const HostRows& g : fields_)
        if (start > static_cast<std::uint64_t>(g.rows - g.window->length - g.window->shift))
          throw Error("device gather: sample " + std::to_string(indices[k]) + "'s window starts at element " +
                      std::to_string(start) + ", past the last that fits " + g.name + " (" + std::to_string(g.rows) +
                      " elements)");
      word[k] = static_cast<std::int64_t>(start);
    }
  }
  return index;
}

void GatherPath::flush(DeviceStage& stage) {
  if (held_.empty()) return;
  std::vector<std::shared_ptr<const EventFence>*> slots = std::move(held_);
  held_.clear();
  std::vector<std::shared_ptr<const EventFence>> fences;
  try {
    fences = stage.issue_held();
    if (fences.size() != slots.size())
      throw Error("DataLoader: " + std::to_string(slots.size()) + " batches held for one launch, " +
                  std::to_string(fences.size()) + " issued");
  } catch (...) {
    // Every held batch fails at its hand-over (deliver rethrows the fence's error): none of them
    // may reach the consumer unwritten.
    const std::exception_ptr error = std::current_exception();
    for (std::shared_ptr<const EventFence>* slot : slots) {
      auto failed = EventFence::deferred(cuda::Event::create(stage.device()));
      failed->recorded(error);  // never recorded on a stream: waiting on it returns at once
      *slot = std::move(failed);
    }
    throw;
  }
  for (std::size_t k = 0; k < slots.size(); ++k) *slots[k] = std::move(fences[k]);
}

Payload GatherPath::batch(DeviceStage& stage, TypedBatches& typed, const Tensor& index, bool hold) {
  auto aligned = [](std::size_t b) { return (b + 63) / 64 * 64; };
  const std::size_t rows = static_cast<std::size_t>(index.size(0));
  // Up to gather_index_in_launch rows the indices travel in the kernel's launch; a larger
  // batch's go to the device first (from their pinned block).
  const bool in_launch = index.size(0) <= DeviceStage::gather_index_in_launch;
  std::size_t bytes = in_launch ? 0 : aligned(index.nbytes());
  for (const HostRows& f : fields_) bytes += aligned(rows * gathered_row_bytes(f));
  stage.begin(bytes, hold);  // held batches: small, several to a launch and to a buffer
  std::vector<Tensor> fields;
  fields.reserve(fields_.size());
  try {
    const Tensor index_dev = in_launch ? index : stage.move(index);
    for (std::size_t k = 0; k < fields_.size(); ++k) {
      const HostRows& f = fields_[k];
      if (f.window)
        fields.push_back(stage.gather_windows(index_dev, registration_->device_rows(k), f.dtype, f.rows, *f.window));
      else
        fields.push_back(stage.gather_rows(index_dev, registration_->device_rows(k), f.row_bytes, f.dtype, f.row_shape,
                                           f.transform ? &*f.transform : nullptr));
    }
    Payload p = Payload::make(DeviceBatch{typed.from_fields(std::move(fields)), nullptr});
    DeviceBatch& d = p.get<DeviceBatch>();  // on the heap: a held batch's slot stays put
    bool held = false;
    if (hold) {
      held = stage.end_held();
      if (!held && !held_.empty()) {  // no room left: the held launch goes first
        flush(stage);
        held = stage.end_held();
      }
    }
    if (held)
      held_.push_back(&d.copied);
    else
      d.copied = stage.end();
    return p;
  } catch (...) {
    stage.abort();
    throw;
  }
}

}  // namespace ferry::detail
