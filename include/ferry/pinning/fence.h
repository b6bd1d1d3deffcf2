// ferry/pinning/fence.h — "has the device finished reading this memory?"
//
// A pinned block returns to its pool only when every fence attached to it has completed. On a
// GPU the fence is a CUDA event recorded after the copy that reads the block (EventFence); tests
// on a CPU-only machine hold a ManualFence closed to prove the pool never hands such a block out.
//
// Thread safety: ready() and wait() may be called from any thread, concurrently with open().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
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
///
/// A deferred fence's event is recorded later, by another thread: GPU decode's threads issue a
/// batch's decode after the thread that ended the batch has moved on (Note [Decode threads] in
/// pinning/gpu_decode.cu). Until that thread calls recorded(), ready() is false and wait(),
/// event() and error() block.
class EventFence final : public Fence {
 public:
  EventFence(cuda::Event event) : event_(std::move(event)), serial_(next_serial()) {}  // NOLINT
  /// A fence whose event another thread records, then says so with recorded().
  static std::shared_ptr<EventFence> deferred(cuda::Event event) {
    auto f = std::make_shared<EventFence>(std::move(event));
    f->pending_ = std::make_shared<Pending>();
    return f;
  }
  /// The recording thread: the event now covers the guarded work; `error`, if any, is why that
  /// work failed (the event then covers what was issued before the failure).
  void recorded(std::exception_ptr error = nullptr) const {
    if (!pending_) return;
    std::lock_guard l(pending_->mu);
    pending_->error = std::move(error);
    pending_->recorded = true;
    pending_->cv.notify_all();
  }
  bool ready() const override {
    if (pending_) {
      std::lock_guard l(pending_->mu);
      if (!pending_->recorded) return false;
    }
    return event_.ready();
  }
  void wait() const override { event().synchronize(); }
  /// Waits at most `limit` for the recording thread's recorded(); true once it has come (at once
  /// for a fence that is not deferred). Lets a waiter bound its wait or check for an interruption.
  bool wait_recorded(std::chrono::microseconds limit) const {
    if (!pending_) return true;
    std::unique_lock l(pending_->mu);
    return pending_->cv.wait_for(l, limit, [&] { return pending_->recorded; });
  }
  /// Distinct for every EventFence made in the process (a fence shared by several batches is
  /// waited for once: DeviceStage::deliver).
  std::uint64_t serial() const noexcept { return serial_; }
  const cuda::Event& event() const {
    await_record();
    return event_;
  }
  /// Why the guarded work failed, or null.
  std::exception_ptr error() const {
    if (!pending_) return nullptr;
    await_record();
    std::lock_guard l(pending_->mu);
    return pending_->error;
  }

 private:
  struct Pending {
    std::mutex mu;
    std::condition_variable cv;
    bool recorded = false;     // guarded by mu
    std::exception_ptr error;  // guarded by mu
  };
  void await_record() const {
    if (!pending_) return;
    std::unique_lock l(pending_->mu);
    pending_->cv.wait(l, [&] { return pending_->recorded; });
  }
  static std::uint64_t next_serial() noexcept;  // one counter for the process (pinning/cuda.cpp)
  cuda::Event event_;
  std::uint64_t serial_;
  std::shared_ptr<Pending> pending_;  // deferred fences only
};

}  // namespace ferry
