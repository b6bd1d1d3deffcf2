// ferry/pinning/fence.h — "has the device finished reading this memory?"
//
// A pinned block returns to its pool only when every fence attached to it has completed. On a
// GPU the fence is a CUDA event recorded after the copy that reads the block (EventFence); tests
// on a CPU-only machine hold a ManualFence closed to prove the pool never hands such a block out.
//
// Thread safety: ready() and wait() may be called from any thread, concurrently with open().
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>

#include "ferry/pinning/cuda.h"

namespace ferry {

class Fence {
 public:
  virtual ~Fence() = default;
  /// True once the guarded work is complete. Never goes back to false.
  virtual bool ready() const = 0;
  /// Blocks until ready().
  virtual void wait() const = 0;
};

/// Complete from the start.
class ReadyFence final : public Fence {
 public:
  bool ready() const override { return true; }
  void wait() const override {}
};

/// Complete when open() is called. For tests.
class ManualFence final : public Fence {
 public:
  void open() {
    std::lock_guard l(mu_);
    open_ = true;
    cv_.notify_all();
  }
  bool ready() const override {
    std::lock_guard l(mu_);
    return open_;
  }
  void wait() const override {
    std::unique_lock l(mu_);
    cv_.wait(l, [&] { return open_; });
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool open_ = false;  // guarded by mu_
};

/// A CUDA event recorded on a stream: complete when the stream has passed it.
class EventFence final : public Fence {
 public:
  EventFence(cuda::Event event) : event_(std::move(event)) {}  // NOLINT
  bool ready() const override { return event_.ready(); }
  void wait() const override { event_.synchronize(); }
  const cuda::Event& event() const noexcept { return event_; }

 private:
  cuda::Event event_;
};

}  // namespace ferry
