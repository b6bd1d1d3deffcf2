// Where the device stage places a batch: see pinning/device_buffers.h.
#include "device_buffers.h"

#include <algorithm>
#include <chrono>

#include "ferry/collate/collate.h"
#include "ferry/detail/engine.h"

namespace ferry::detail {

DeviceBuffers::~DeviceBuffers() {
  if (leak_) return;
  try {
    cuda::DeviceGuard g(device_);
    for (auto& b : buffers_) cuda::device_free(b->ptr);
  } catch (...) {
  }
}

// A free buffer of `want` bytes or up to twice as many, else a new one; the copy stream waits (on
// the device) for its last release, and its last decode, before anything is written into it.
DeviceBuffers::Buffer* DeviceBuffers::lease(std::size_t want) {
  Buffer* best = nullptr;
  {
    std::lock_guard l(mu_);
    for (auto& b : buffers_)
      if (b->free && b->size >= want && b->size <= 2 * want && (!best || b->size < best->size) &&
          (!b->writer || b->writer->wait_recorded(std::chrono::microseconds(0))))
        best = b.get();
    if (best) best->free = false;
  }
  if (!best) {
    cuda::DeviceGuard g(device_);
    auto b = std::make_unique<Buffer>();
    b->ptr = static_cast<std::byte*>(cuda::device_alloc(want));
    b->size = want;
    b->released = cuda::Event::create(device_);
    b->free = false;
    best = b.get();
    std::lock_guard l(mu_);
    buffers_.push_back(std::move(b));
    ++allocations_;
  }
  std::lock_guard l(mu_);
  if (best->has_release) {
    cuda::DeviceGuard g(device_);
    copy_.wait(best->released);  // reuse only behind the consumer's release
  }
  if (best->writer) {
    cuda::DeviceGuard g(device_);
    copy_.wait(best->writer->event());  // and behind the last decode into it (issued: see above)
    best->writer.reset();
  }
  return best;
}

// The reference that returns `b` when its last tensor is dropped.
std::shared_ptr<void> DeviceBuffers::owner_of(Buffer* b, const std::shared_ptr<void>& keep) {
  return std::shared_ptr<void>(b, [this, keep](void* p) { release(static_cast<Buffer*>(p)); });
}

void DeviceBuffers::release(Buffer* b) noexcept {
  std::lock_guard l(mu_);
  try {
    cuda::DeviceGuard g(device_);  // the batch may be dropped on any thread, current on any device
    b->released.record(consumer_);
    b->has_release = true;
  } catch (const std::exception& e) {
    warn_once("device-release",
              std::string("DeviceStage: recording a release event failed: ") + e.what() + "; synchronizing instead");
    try {
      consumer_.synchronize();
    } catch (...) {
    }
    b->has_release = false;
  }
  b->free = true;
}

void DeviceBuffers::begin(std::size_t bytes, bool share, const std::shared_ptr<void>& keep) {
  if (cur_) throw Error("DeviceStage::begin: the previous batch was not ended");
  const std::size_t want = std::max<std::size_t>(bytes, 1);
  if (share && align_up(want) <= kHeldBytes / 2) {
    const std::size_t need = align_up(want);
    if (!shared_owner_ || shared_used_ + need > shared_->size) {
      close_shared();
      shared_ = lease(std::min(kSharedBatches * need, kHeldBytes));
      shared_owner_ = owner_of(shared_, keep);
      shared_used_ = 0;
    }
    cur_ = shared_;
    cur_owner_ = shared_owner_;
    used_ = cur_begin_ = shared_used_;
    cur_end_ = shared_used_ + bytes;
    shared_used_ += need;
    return;
  }
  cur_ = lease(want);
  cur_owner_ = owner_of(cur_, keep);
  used_ = cur_begin_ = 0;
  cur_end_ = bytes;
}

Tensor DeviceBuffers::place(std::size_t bytes, DType dtype, const Shape& shape, const std::string& what) {
  if (!cur_) throw Error("DeviceStage::" + what + ": no batch begun");
  if (used_ + align_up(bytes) > cur_end_) throw Error("DeviceStage::" + what + ": more than begin() reserved");
  Tensor out(Storage::wrap(cur_->ptr, cur_->size, Device::cuda(device_), cur_owner_), dtype, shape, used_);
  used_ += align_up(bytes);
  return out;
}

void DeviceBuffers::set_writer(std::shared_ptr<const EventFence> fence) {
  std::lock_guard l(mu_);
  cur_->writer = std::move(fence);
}

void DeviceBuffers::finish() noexcept {
  cur_owner_.reset();
  cur_ = nullptr;
}

void DeviceBuffers::close_shared() noexcept {
  shared_owner_.reset();
  shared_ = nullptr;
  shared_used_ = 0;
}

std::uint64_t DeviceBuffers::allocations() const {
  std::lock_guard l(mu_);
  return allocations_;
}

}  // namespace ferry::detail
