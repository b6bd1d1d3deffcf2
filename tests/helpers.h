// Test helpers shared by the suites: counting allocators and instance-counted samples.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <vector>
#include <chrono>
#include <thread>

#include "ferry/ferry.h"

namespace ferry::test {

// A BatchAllocator that counts live buffers, so a leaked batch fails the test.
class CountingAllocator final : public BatchAllocator {
 public:
  Storage allocate(std::size_t nbytes) override {
    Storage s = Storage::allocate(nbytes);
    allocations.fetch_add(1);
    live.fetch_add(1);
    auto* counter = &live;
    // Wrap the owner so its release is counted.
    std::shared_ptr<void> owner(new std::shared_ptr<void>(s.owner()), [counter](void* p) {
      delete static_cast<std::shared_ptr<void>*>(p);
      counter->fetch_sub(1);
    });
    return Storage::wrap(s.data(), nbytes, s.device(), std::move(owner));
  }
  std::atomic<long> allocations{0};
  std::atomic<long> live{0};
};

// A sample that counts its live instances.
struct Tracked {
  static inline std::atomic<long> alive{0};
  std::size_t index = 0;
  explicit Tracked(std::size_t i = 0) : index(i) { alive.fetch_add(1); }
  Tracked(const Tracked& o) : index(o.index) { alive.fetch_add(1); }
  Tracked& operator=(const Tracked&) = default;
  ~Tracked() { alive.fetch_sub(1); }
};

// Iterates one epoch by hand, calling on_batch(batch) for each batch; a WorkerError is recorded
// (its message, then on_error's suffix) and iteration goes on with the next batch, as a user who
// skips bad batches would. Returns the error messages in order.
template <class E = WorkerError, class Loader, class OnBatch, class OnError>
std::vector<std::string> iterate_skipping_errors(Loader& loader, OnBatch&& on_batch, OnError&& on_error) {
  std::vector<std::string> errors;
  auto it = loader.begin();
  for (;;) {
    try {
      if (it == loader.end()) break;
      on_batch(*it);
    } catch (const E& e) {
      errors.push_back(std::string(e.what()) + on_error(e));
      continue;  // the failed batch is consumed; go on with the next
    }
    ++it;
  }
  return errors;
}
template <class E = WorkerError, class Loader, class OnBatch>
std::vector<std::string> iterate_skipping_errors(Loader& loader, OnBatch&& on_batch) {
  return iterate_skipping_errors<E>(loader, on_batch, [](const E&) { return std::string(); });
}

// Waits (polling) until pred() holds or `limit` passes; returns pred().
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A one-shot gate: wait() blocks until open().
class Gate {
 public:
  void open() {
    std::lock_guard l(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock l(mu_);
    cv_.wait(l, [&] { return open_; });
  }
  // Whether it opened within `d`.
  template <class Duration>
  bool wait_for(Duration d) {
    std::unique_lock l(mu_);
    return cv_.wait_for(l, d, [&] { return open_; });
  }
  bool is_open() {
    std::lock_guard l(mu_);
    return open_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;  // guarded by mu_
};

// A stream of 0..n-1 split round-robin over the workers: worker w reads w, w + W, w + 2W, ...
// (so the value at position p of worker w's stream is w + p * W).
struct RoundRobinInts {
  std::size_t n;
  struct S {
    std::size_t i, end, step;
    std::optional<std::int64_t> next() {
      if (i >= end) return std::nullopt;
      const std::size_t v = i;
      i += step;
      return static_cast<std::int64_t>(v);
    }
  };
  S open(const WorkerInfo& w) const { return S{static_cast<std::size_t>(w.id), n, static_cast<std::size_t>(w.num_workers)}; }
};

// A stream of 0..n-1; each worker reads its shard_range.
struct CountingStream : DatasetBase<CountingStream> {
  explicit CountingStream(std::size_t size) : n(size) {}
  std::size_t n;
  struct Stream {
    std::size_t next_value, end;
    std::optional<std::int64_t> next() {
      if (next_value == end) return std::nullopt;
      return static_cast<std::int64_t>(next_value++);
    }
  };
  Stream open(const WorkerInfo& w) const {
    auto [b, e] = shard_range(n, w.id, w.num_workers);
    return Stream{b, e};
  }
};

}  // namespace ferry::test
