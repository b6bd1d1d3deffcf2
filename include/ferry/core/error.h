// ferry/core/error.h — the exceptions ferry throws.
//
// Every failure ferry reports derives from ferry::Error (itself a std::runtime_error), so
// `catch (const ferry::Error&)` catches all of them. The specific types tell where it happened:
//
//   WorkerError   a dataset, transform, collate or worker_init_fn threw inside the pipeline; it is
//                 rethrown on the consumer thread at that batch's position. The message names the
//                 worker, the batch index, the stage and the sample indices; the original exception
//                 is nested (std::rethrow_if_nested(e), or e.original()).
//   TimeoutError  no batch arrived within DataLoaderOptions::timeout; names the stage that stalled.
//   DataError     a file or record is malformed; names the file and the offset or sample.
//
// Thread safety: exception objects are immutable after construction.
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

namespace ferry {

/// Base class of every exception ferry throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// User code inside the pipeline failed. Constructed inside the catch block that caught the
/// original, which std::nested_exception captures.
class WorkerError : public Error, public std::nested_exception {
 public:
  WorkerError(const std::string& message, int worker, std::int64_t batch)
      : Error(message), worker_(worker), batch_(batch) {}
  /// The worker that failed; -1 when num_workers == 0 (the consumer thread ran the batch).
  int worker() const noexcept { return worker_; }
  /// The index of the batch within its epoch.
  std::int64_t batch() const noexcept { return batch_; }
  /// The exception user code threw.
  std::exception_ptr original() const noexcept { return nested_ptr(); }

 private:
  int worker_;
  std::int64_t batch_;
};

/// A stage produced nothing within the configured timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// Malformed input data (a file, a record, a header field).
class DataError : public Error {
 public:
  using Error::Error;
};

}  // namespace ferry
