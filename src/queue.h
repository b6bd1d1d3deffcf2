// src/queue.h — the stage queue: moodycamel's blocking queue behind a sticky close.
//
// moodycamel::BlockingConcurrentQueue is fast and lock-free but has no close(): a consumer
// blocked in wait_dequeue sleeps until an item arrives. StageQueue adds one. close() sets a flag
// and enqueues a sentinel (an empty optional); whichever consumer dequeues the sentinel puts it
// back before returning, so every waiter, present or future, wakes in turn. After close(), pop()
// returns std::nullopt and items still queued are dropped with the queue.
//
// Order: moodycamel is FIFO per producer only. ferry never relies on cross-producer order: batch
// order comes from sequence numbers (the reorder window).
//
// This is the only file that includes moodycamel.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <optional>
#include <utility>

#include <concurrentqueue/blockingconcurrentqueue.h>

namespace ferry::detail {

// moodycamel's default traits. MAX_SEMA_SPINS (how long a waiter spins before it sleeps) was
// measured at 10k, 50k and 200k spins: longer spinning did not lower the engine's per-batch
// overhead on the 2-core machine, so the default stays (bench/RESULTS.md).
struct StageQueueTraits : moodycamel::ConcurrentQueueDefaultTraits {};

// For the hand-over to the training loop (the pin stage's queue): its one consumer is the
// training loop's thread, which either finds a batch ready or waits for one, often for a whole
// batch's time; it sleeps after 100 checks instead of spinning through 10,000 (about 10 us a
// wait) on a core the training loop may want.
struct HandOverTraits : moodycamel::ConcurrentQueueDefaultTraits {
  static const int MAX_SEMA_SPINS = 100;
};

template <class T, class Traits = StageQueueTraits>
class StageQueue {
 public:
  /// Enqueues `item`; returns false (dropping it) when the queue is closed.
  bool push(T item) {
    if (closed_.load(std::memory_order_acquire)) return false;
    q_.enqueue(std::optional<T>(std::move(item)));
    return true;
  }

  /// Blocks until an item arrives or the queue closes (then std::nullopt).
  std::optional<T> pop() {
    std::optional<T> item;
    q_.wait_dequeue(item);
    return accept(std::move(item));
  }

  /// As pop(), giving up after `timeout`: returns {std::nullopt, true} on timeout.
  std::pair<std::optional<T>, bool> pop_for(std::chrono::microseconds timeout) {
    std::optional<T> item;
    const bool got = q_.wait_dequeue_timed(item, timeout);
    return taken(got, std::move(item));
  }

  /// As pop_for() with no wait: the item queued now, if any. pop_for(0) would not do: moodycamel's
  /// semaphore spins (MAX_SEMA_SPINS checks, 10,000 by default: 10-30 us) before any timed wait,
  /// a zero one included.
  std::pair<std::optional<T>, bool> try_pop() {
    std::optional<T> item;
    const bool got = q_.try_dequeue(item);
    return taken(got, std::move(item));
  }

  /// Sticky: wakes every current and future pop(). Idempotent.
  void close() {
    if (!closed_.exchange(true, std::memory_order_acq_rel)) q_.enqueue(std::optional<T>());
  }
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  /// Approximate number of queued items.
  std::size_t size_approx() const { return q_.size_approx(); }

 private:
  // pop_for's and try_pop's answer: the item, or none and whether that was a timeout (an open queue).
  std::pair<std::optional<T>, bool> taken(bool got, std::optional<T> item) {
    if (!got) return {std::nullopt, !closed_.load(std::memory_order_acquire)};
    return {accept(std::move(item)), false};
  }
  std::optional<T> accept(std::optional<T> item) {
    if (!item) {
      q_.enqueue(std::optional<T>());  // pass the sentinel on to the next waiter
      return std::nullopt;
    }
    if (closed_.load(std::memory_order_acquire)) return std::nullopt;
    return item;
  }

  moodycamel::BlockingConcurrentQueue<std::optional<T>, Traits> q_;
  std::atomic<bool> closed_{false};
};

}  // namespace ferry::detail
