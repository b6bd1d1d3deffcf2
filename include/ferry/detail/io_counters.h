// ferry/detail/io_counters.h — object-store reads counted per loader. Not for direct use.
//
// A loader's worker sets its counters as the thread's current ones while it makes a batch
// (ScopedIo); the object-store client adds to whatever counters the calling thread has (none
// outside a loader's work), beside the process-wide ones (ferry::object_store_stats()). So
// LoaderStats shows what this loader read, not what other loaders of the process did. The same
// scope tells the client when the loader has given up on the work (io_cancelled), so that an
// abandoned worker's request ends at once instead of at its stall limit.
#pragma once

#include <atomic>
#include <cstdint>

namespace ferry::detail {

struct IoCounters {
  std::atomic<std::uint64_t> requests{0}, bytes{0}, retries{0}, hedges{0}, cache_hits{0};
};

/// The calling thread's current counters, or null.
IoCounters* current_io() noexcept;

/// Whether the loader gave up on the calling thread's work (the batch's worker was abandoned at
/// its timeout, or the epoch is ending), or the thread's read deadline (ferry::ReadDeadline) has
/// passed: a read in progress should end now. False outside a loader's work and a deadline.
bool io_cancelled() noexcept;
/// Whether the calling thread's read deadline (ferry::ReadDeadline) has passed, and its limit in
/// milliseconds (0 without one): a read given up for it is a TimeoutError.
bool io_deadline_passed() noexcept;
long long io_deadline_ms() noexcept;

/// Asks whether the work was given up; `arg` is passed back.
using CancelCheck = bool (*)(const void* arg) noexcept;

/// Makes `counters` (and the cancellation check) the thread's current ones for its lifetime
/// (nests).
class ScopedIo {
 public:
  explicit ScopedIo(IoCounters* counters, CancelCheck cancelled = nullptr, const void* arg = nullptr) noexcept;
  ~ScopedIo();
  ScopedIo(const ScopedIo&) = delete;
  ScopedIo& operator=(const ScopedIo&) = delete;

 private:
  IoCounters* previous_;
  CancelCheck previous_check_;
  const void* previous_arg_;
};

/// Adds n to one of the thread's current counters, if it has any.
inline void count_io(std::atomic<std::uint64_t> IoCounters::*field, std::uint64_t n) noexcept {
  if (IoCounters* c = current_io()) (c->*field).fetch_add(n, std::memory_order_relaxed);
}

}  // namespace ferry::detail
