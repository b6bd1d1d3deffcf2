// The device stage's gather: see pinning/device_gather.h.
#include "device_gather.h"

#include <chrono>
#include <string>
#include <thread>

#include "ferry/detail/pass_math.h"

namespace ferry::detail {

void GatherStage::check_index(const Tensor& index, const char* what) const {
  if (!index.defined() || index.dtype() != DType::Int64 || index.dim() != 1 ||
      (!index.device().is_host() && index.device() != Device::cuda(device_)))
    throw Error(std::string("DeviceStage::") + what +
                ": expected an int64 [B] index on the host or on cuda:" + std::to_string(device_) + ", got " + index.str());
  if (index.device().is_host() && index.size(0) > DeviceStage::gather_index_in_launch)
    throw Error(std::string("DeviceStage::") + what + ": a host index of " + std::to_string(index.size(0)) +
                " rows is more than a launch carries (" + std::to_string(DeviceStage::gather_index_in_launch) +
                "); move it to the device first");
}

namespace {
void check_built() {
  if (!gather_built())
    throw CudaError(
        "DeviceStage: the device gather needs the gather kernel, and this build of ferry was made without a CUDA compiler");
}
}  // namespace

Tensor GatherStage::rows(DeviceBuffers& buffers, const Tensor& index, const void* src, std::size_t row_bytes, DType dtype,
                         const Shape& row_shape, const RowTransform* t) {
  if (!buffers.begun()) throw Error("DeviceStage::gather_rows: no batch begun");
  check_built();
  check_index(index, "gather_rows");
  std::int64_t per_row = 1;
  for (std::int64_t d : row_shape) per_row *= d;
  if (static_cast<std::size_t>(per_row) * itemsize(dtype) != row_bytes)
    throw Error("DeviceStage::gather_rows: a row of " + std::to_string(row_bytes) + " bytes does not hold its shape's elements");
  const std::int64_t rows = index.size(0);
  GatherField field;
  field.src = src;
  field.row_bytes = row_bytes;
  Shape shape{rows};
  std::size_t out_row_bytes = row_bytes;
  if (t) {
    if (std::string why = row_transform_problem(*t, dtype, row_bytes, "DeviceStage::gather_rows"); !why.empty()) throw Error(why);
    field.out_kind = pass_output_of(t->dtype);
    field.chw = t->dtype != DType::UInt8 && !t->channels_last;
    field.flip = t->flip_p > 0;
    field.height = t->height;
    field.width = t->width;
    field.channels = t->channels;
    for (int c = 0; c < RowTransform::kMaxChannels; ++c) {
      field.a[c] = t->a[c];
      field.b[c] = t->b[c];
    }
    out_row_bytes = row_bytes * itemsize(t->dtype);
    field.out_row_bytes = out_row_bytes;
    shape.insert(shape.end(), t->shape.begin(), t->shape.end());
    dtype = t->dtype;
  } else {
    shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  }
  Tensor out = buffers.place(static_cast<std::size_t>(rows) * out_row_bytes, dtype, shape, "gather_rows");
  field.dst = out.raw();
  gathers_.push_back({index, field});
  return out;
}

Tensor GatherStage::windows(DeviceBuffers& buffers, const Tensor& index, const void* src, DType dtype, std::int64_t elements,
                            const RowWindow& w) {
  if (!buffers.begun()) throw Error("DeviceStage::gather_windows: no batch begun");
  check_built();
  check_index(index, "gather_windows");
  if (std::string why = row_window_problem(w, dtype, itemsize(dtype), elements, "DeviceStage::gather_windows"); !why.empty())
    throw Error(why);
  if (index.device().is_host()) {
    const std::int64_t* word = index.data<std::int64_t>();
    for (std::int64_t i = 0; i < index.size(0); ++i)
      if (word[i] < 0 || word[i] > elements - w.length - w.shift)
        throw Error("DeviceStage::gather_windows: window " + std::to_string(i) + " starts at element " + std::to_string(word[i]) +
                    ", past the last that fits an array of " + std::to_string(elements));
  }
  const std::int64_t n = index.size(0);
  GatherField field;
  field.src = src;
  field.row_bytes = itemsize(dtype);
  field.rows = n;
  field.window = w.length;
  field.shift = w.shift;
  field.out_elem_bytes = static_cast<int>(itemsize(w.dtype));
  field.src_signed = !w.is_unsigned;
  Tensor out =
      buffers.place(static_cast<std::size_t>(n * w.length) * itemsize(w.dtype), w.dtype, Shape{n, w.length}, "gather_windows");
  field.dst = out.raw();
  gathers_.push_back({index, field});
  return out;
}

void GatherStage::launch(const cuda::Stream& copy, DeviceStageStats& counters) {
  struct Clear {
    std::vector<Pending>& g;
    ~Clear() { g.clear(); }
  } clear{gathers_};
  for (std::size_t i = 0; i < gathers_.size();) {
    std::size_t j = i;
    std::vector<GatherField> fields;
    while (j < gathers_.size() && gathers_[j].index.raw() == gathers_[i].index.raw() && fields.size() < kMaxGatherFields)
      fields.push_back(gathers_[j++].field);
    const Tensor& index = gathers_[i].index;
    const bool on_host = index.device().is_host();
    for (GatherField& f : fields) {
      f.rows = index.size(0);
      f.index_dev = on_host ? nullptr : index.data<std::int64_t>();
      f.index_offset = 0;
    }
    launch_gather(on_host ? index.data<std::int64_t>() : nullptr, on_host ? index.size(0) : 0, fields.data(),
                  static_cast<int>(fields.size()), copy.native());
    counters.rows_gathered += static_cast<std::uint64_t>(index.size(0)) * fields.size();
    ++counters.gather_launches;
    i = j;
  }
}

bool GatherStage::hold(std::size_t bytes) {
  if (gathers_.empty() || bytes > DeviceBuffers::kHeldBytes || gathers_.size() > static_cast<std::size_t>(kMaxGatherFields))
    return false;
  std::size_t rows = 0;
  bool wide = held_wide_;
  for (std::size_t i = 0; i < gathers_.size(); ++i) {
    const Tensor& index = gathers_[i].index;
    if (!index.device().is_host()) return false;
    if (i == 0 || index.raw() != gathers_[i - 1].index.raw()) {
      const std::int64_t n = index.size(0);
      rows += static_cast<std::size_t>(n);
      wide = wide || !narrow_rows(index.data<std::int64_t>(), n);
    }
  }
  if (rows > static_cast<std::size_t>(kGatherIndexInLaunch)) return false;
  const auto room = static_cast<std::size_t>(wide ? kGatherIndexInLaunch : kGatherNarrowIndexInLaunch);
  if (held_index_.size() + rows > room || held_fields_.size() + gathers_.size() > static_cast<std::size_t>(kMaxGatherFields) ||
      held_bytes_ + bytes > kHeldLaunchBytes)
    return false;
  held_wide_ = wide;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < gathers_.size(); ++i) {
    const Tensor& index = gathers_[i].index;
    if (i == 0 || index.raw() != gathers_[i - 1].index.raw()) {
      offset = static_cast<std::int64_t>(held_index_.size());
      const std::int64_t* d = index.data<std::int64_t>();
      held_index_.insert(held_index_.end(), d, d + index.size(0));
    }
    GatherField f = gathers_[i].field;
    f.rows = index.size(0);
    f.index_dev = nullptr;
    f.index_offset = offset;
    held_fields_.push_back(f);
  }
  held_bytes_ += bytes;
  ++held_batches_;
  gathers_.clear();
  return true;
}

std::size_t GatherStage::launch_held(const cuda::Stream& copy, DeviceStageStats& counters) {
  const std::size_t n = held_batches_;
  // Emptied however the launch goes; the vectors keep their capacity for the next launch.
  struct Clear {
    GatherStage& s;
    ~Clear() {
      s.held_fields_.clear();
      s.held_index_.clear();
      s.held_batches_ = s.held_bytes_ = 0;
      s.held_wide_ = false;
    }
  } clear{*this};
  launch_gather(held_index_.data(), static_cast<std::int64_t>(held_index_.size()), held_fields_.data(),
                static_cast<int>(held_fields_.size()), copy.native());
  for (const GatherField& f : held_fields_) counters.rows_gathered += static_cast<std::uint64_t>(f.rows);
  ++counters.gather_launches;
  return n;
}

// Left alone, the pin thread runs ahead until the driver's queue is full, and the driver then
// holds it in cudaMemcpyBatchAsync or the launch spinning and yielding: a whole core busy waiting
// for the link. It checks the launch's fence after sleeps of 50 us, each half again as long as the
// last, up to 1 ms: the two launches still queued keep the copy stream busy past the last sleep's
// overshoot. Not a blocking-sync event: each one recorded wakes CUDA's event thread when it
// completes, whoever waits (0.1 to 0.2 of a core at 7,000 launches a second, bench/RESULTS.md),
// and waiting for two launches at a time wakes the pin thread once every other launch.
void GatherStage::throttle() {
  if (launched_.size() < kLaunchesAhead) return;
  const EventFence& target = *launched_[launched_.size() - 1 - kLaunchesLeft];
  std::chrono::microseconds sleep(50);
  while (!target.ready()) {
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 3 / 2, std::chrono::microseconds(1000));
  }
  launched_.erase(launched_.begin(), launched_.end() - kLaunchesLeft);
}

void GatherStage::mark_launch(const cuda::Stream& copy) {
  cuda::Event e = cuda::Event::create(device_, false);
  e.record(copy);
  mark_launch(std::make_shared<EventFence>(std::move(e)));
}

}  // namespace ferry::detail
