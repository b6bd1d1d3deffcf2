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
//                 Also an object-store read past a ReadDeadline (ferry/loaders/storage.h).
//   DataError     a file or record is malformed; names the file and the offset or sample. It
//                 reaches the consumer unwrapped (worker and batch appended to the message).
//   Interrupted   DataLoaderOptions::wait_poll asked the consumer's wait for a batch to stop (a
//                 front-end noticed Ctrl-C); nothing is lost, the next call waits again.
//   IoError       a DataError from the operating system (open, read, map) with its errno; the
//                 transient ones (EINTR, EAGAIN, EIO, ETIMEDOUT: network file systems) are
//                 retried by the loader before they count (DataLoaderOptions::io_retries). Like a
//                 DataError it reaches the consumer unwrapped, still an IoError.
//   OptionError   a loader option is out of its range or conflicts with another; the message
//                 names the option and the value given. Thrown when the loader is made, before
//                 any worker starts (Python: also a ValueError, as PyTorch raises).
//
// Thread safety: exception objects are immutable after construction.
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

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
  WorkerError(const std::string& message, int worker, std::int64_t batch) : Error(message), worker_(worker), batch_(batch) {}
  /// The worker that failed: its id, kInline (-1) when num_workers == 0 (the consumer thread ran
  /// the batch), or kPinThread (-2) when pinning the batch failed.
  int worker() const noexcept { return worker_; }
  static constexpr int kInline = -1;
  static constexpr int kPinThread = -2;
  /// The index of the batch within its epoch.
  std::int64_t batch() const noexcept { return batch_; }
  /// The exception user code threw.
  std::exception_ptr original() const noexcept { return nested_ptr(); }

 private:
  int worker_;
  std::int64_t batch_;
};

/// A DataLoaderOptions value out of its range, or options that conflict (ferry::detail::
/// normalize_options, the one place that checks them); the message names the option.
class OptionError : public Error {
 public:
  using Error::Error;
};

/// A stage produced nothing within the configured timeout, or a read outlived its ReadDeadline.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// DataLoaderOptions::wait_poll returned true while the consumer waited for a batch. No batch is
/// lost: the loader's next call waits for the same batch again.
class Interrupted : public Error {
 public:
  using Error::Error;
};

/// Malformed or unreadable input data: a file, a record, a header field. The message reads
/// "<file>: at byte <offset>: <what>" (the offset where it makes sense). Thrown inside the pipeline,
/// it reaches the consumer as a DataError (not wrapped in WorkerError), with the worker, batch and
/// samples appended to the message, so `catch (const ferry::DataError&)` can skip bad data.
class DataError : public Error {
 public:
  static constexpr std::uint64_t kNoOffset = ~std::uint64_t{0};
  /// A data error in `file` at byte `offset` (kNoOffset when no offset applies).
  DataError(std::string file, std::uint64_t offset, const std::string& what)
      : Error(file + (offset == kNoOffset ? std::string() : ": at byte " + std::to_string(offset)) + ": " + what),
        file_(std::move(file)),
        offset_(offset) {}
  /// The file (or shard, or record) that was bad.
  const std::string& file() const noexcept { return file_; }
  /// The byte offset of the problem, or kNoOffset.
  std::uint64_t offset() const noexcept { return offset_; }
  /// The same error with `context` appended to the message (used by the loader to name the
  /// worker and batch).
  DataError with_context(const std::string& context) const { return DataError(*this, context); }

 private:
  DataError(const DataError& e, const std::string& context)
      : Error(std::string(e.what()) + " [" + context + "]"), file_(e.file_), offset_(e.offset_) {}
  std::string file_;
  std::uint64_t offset_ = kNoOffset;
};

/// A DataError raised by a system call, with its errno. transient() is true for EINTR, EAGAIN,
/// EWOULDBLOCK, EIO and ETIMEDOUT, the errors a network or FUSE file system returns for a moment.
class IoError : public DataError {
 public:
  IoError(std::string file, std::uint64_t offset, const std::string& what, int error_number)
      : DataError(std::move(file), offset, what), errno_(error_number) {}
  /// The errno of the failed call.
  int error_number() const noexcept { return errno_; }
  /// Whether retrying the same call may succeed.
  bool transient() const noexcept;
  /// The same error, still an IoError, with `context` appended to the message (DataError's).
  IoError with_context(const std::string& context) const { return IoError(*this, context); }

 private:
  IoError(const IoError& e, const std::string& context) : DataError(e.DataError::with_context(context)), errno_(e.errno_) {}
  int errno_;
};

}  // namespace ferry
