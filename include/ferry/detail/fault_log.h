// ferry/detail/fault_log.h — the loader's record of damaged and stuck samples. Not for direct use.
//
// One per DataLoader, shared by its workers: counts by kind and action, the first few errors by
// name, the user's callback, the per-epoch limit, and the samples whose fetch got stuck (those are
// never fetched again by this loader: each try would strand another thread). Errors are rare, so
// a mutex guards it; the per-sample fast path is one relaxed atomic load (is_stuck).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <string>
#include <unordered_set>
#include <vector>

#include "ferry/core/faults.h"

namespace ferry::detail {

/// Counts of a FaultLog (cumulative since the loader started).
struct FaultCounts {
  std::uint64_t skipped = 0, replaced = 0;
  std::uint64_t data = 0, io = 0, timeout = 0;  // by kind
  std::uint64_t retries = 0;                    // transient I/O errors retried
};

class FaultLog {
 public:
  struct Limits {
    std::size_t max_errors = 0;     // per epoch; 0: none
    double max_error_fraction = 0;  // of the epoch's samples; 0: none
  };
  FaultLog(Limits limits, std::function<void(const SampleError&)> callback) : limits_(limits), callback_(std::move(callback)) {}

  /// Starts counting a new epoch of `samples` samples (0: unknown, e.g. a stream without size()).
  /// Errors already reported for this epoch (its batches made ahead) are kept; other epochs' go.
  void begin_epoch(std::uint64_t epoch, std::size_t samples);
  /// Records one skipped or replaced sample: counts it, keeps its message if among the first
  /// kFirst, calls the callback (one call at a time), then throws ferry::Error when the epoch's
  /// limit is passed. A batch made again after its worker was abandoned meets its bad samples a
  /// second time: a map-style (batch, index) already reported this epoch is not reported again.
  void report(const SampleError& e);
  void count_retry() noexcept { retries_.fetch_add(1, std::memory_order_relaxed); }
  bool is_stuck(std::size_t index) const;
  void mark_stuck(std::size_t index);
  FaultCounts counts() const;
  std::vector<std::string> first_errors() const;
  static constexpr std::size_t kFirst = 16;

 private:
  const Limits limits_;
  const std::function<void(const SampleError&)> callback_;
  mutable std::mutex mu_;
  FaultCounts counts_;
  std::atomic<std::uint64_t> retries_{0};
  std::vector<std::string> first_;
  std::uint64_t epoch_ = 0;
  std::size_t epoch_samples_ = 0;
  std::atomic<bool> any_stuck_{false};
  std::unordered_set<std::size_t> stuck_;
  // Per epoch: the live one's, and the next one's while its first batches are made ahead
  // (DataLoaderOptions::prefetch_next_epoch); errors count toward their own epoch's limits.
  struct Tally {
    std::size_t errors = 0;
    std::set<std::pair<std::int64_t, std::size_t>> reported;  // (batch, index), map-style
  };
  std::map<std::uint64_t, Tally> tallies_;
};

/// Whether `e` is a transient I/O error worth retrying (IoError::transient(), or a std::system_error
/// with EINTR, EAGAIN, EIO or ETIMEDOUT).
bool is_transient(const std::exception_ptr& e) noexcept;
/// Whether `e` is an I/O error (IoError or std::system_error).
bool is_io_error(const std::exception_ptr& e) noexcept;
/// e's what(), or a placeholder for exceptions of unknown type.
std::string what_of(const std::exception_ptr& e);

}  // namespace ferry::detail
