// ferry/core/faults.h — what the loader does with a damaged or stuck sample, and a fault
// injector to test that on your own pipeline.
//
// DataLoaderOptions::on_error picks the per-sample policy:
//
//   OnError::Raise    (default) the batch fails: WorkerError / DataError / TimeoutError at its
//                     position; the epoch goes on with the next batch.
//   OnError::Skip     the sample is left out; its batch comes with the rest (one row shorter).
//   OnError::Replace  the batch keeps its size: the sample is replaced by another sample of the
//                     same epoch, chosen by a rule that depends only on (seed, epoch, index), so
//                     runs stay identical for any number of workers (see replacement_position()).
//
// Which failures: anything a dataset's get / get_into / a transform throws for one sample, and a
// sample stuck past `timeout` (its worker is abandoned, the batch is made again without it).
// Collate failures and a worker_init_fn failure still fail the batch. Transient I/O errors
// (ferry::IoError with transient(): EINTR, EAGAIN, EIO, ETIMEDOUT) are first retried
// `io_retries` times with doubling backoff; only then do they count.
//
// Every skipped or replaced sample is reported exactly once: counted in loader.stats() (by kind:
// damaged data, I/O, timeout), the first few named with their errors in stats().first_errors,
// and passed to `on_sample_error` if set. `max_errors` / `max_error_fraction` turn a mostly broken
// dataset into an error: the batch during which the limit is passed fails, and so does every
// later batch of that epoch that meets another bad sample.
//
// FaultInjector wraps any dataset and throws, fails transiently, delays or hangs on samples chosen
// by (seed, index) at given rates: the same samples every run, for any worker count.
//
//   ferry::FaultOptions f;
//   f.seed = 3; f.throw_rate = 0.01; f.delay_rate = 0.001; f.delay = std::chrono::seconds(2);
//   ferry::FaultInjector chaotic(my_dataset, f);
//   ferry::DataLoader loader(chaotic, {.batch_size = 64, .num_workers = 4,
//                                      .timeout = std::chrono::milliseconds(500),
//                                      .on_error = ferry::OnError::Replace});
//   ...
//   chaotic.release();   // let samples that hang return (tests end with this)
//
// Thread safety: FaultInjector's get/get_into/open run on many workers at once; its copies share
// one state (the hang gate and the transient-failure counts).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/core/dataset.h"
#include "ferry/core/error.h"
#include "ferry/core/random.h"

namespace ferry {

/// The per-sample error policy (DataLoaderOptions::on_error).
enum class OnError : std::uint8_t { Raise, Skip, Replace };

/// One damaged or stuck sample, as reported to DataLoaderOptions::on_sample_error.
struct SampleError {
  enum class Kind : std::uint8_t {
    Data,     ///< the dataset threw (a DataError, or any other exception)
    Io,       ///< an IoError that was still failing after io_retries retries
    Timeout,  ///< stuck past `timeout`: its worker was abandoned
  };
  enum class Action : std::uint8_t { Skipped, Replaced };
  std::uint64_t epoch = 0;
  std::int64_t batch = 0;  ///< the batch it belonged to (a worker's own stream: its j-th batch)
  std::size_t index = 0;   ///< dataset index (stream: position in the epoch's, or the worker's own, stream)
  bool stream = false;     ///< whether `index` is a stream position
  int worker = 0;
  Kind kind = Kind::Data;
  Action action = Action::Skipped;
  std::optional<std::size_t> replacement;  ///< Replace: the dataset index used instead
  std::string message;                     ///< the error's what()
  /// "sample 17 of batch 4 (epoch 0) skipped: <message>".
  std::string describe() const;
};

const char* kind_name(SampleError::Kind kind) noexcept;

/// OnError::Replace's rule: the t-th candidate (t = 0, 1, ...) for a failed sample `index` of
/// epoch `epoch` is the sample at this position of the epoch's sample list (the sampler's order,
/// `epoch_size` samples). The first candidate that is not the failed sample and fetches
/// successfully is used; after 16 failed candidates the batch fails.
std::size_t replacement_position(std::uint64_t seed, std::uint64_t epoch, std::size_t index, unsigned t,
                                 std::size_t epoch_size) noexcept;

/// Where FaultInjector puts faults.
struct FaultOptions {
  std::uint64_t seed = 0;
  double throw_rate = 0;       ///< samples that throw DataError every time
  double transient_rate = 0;   ///< samples that throw a transient IoError (EIO) on their first
  int transient_failures = 1;  ///<   `transient_failures` fetches, then succeed
  double delay_rate = 0;       ///< samples that sleep `delay` before returning normally
  std::chrono::milliseconds delay{0};
  double hang_rate = 0;                   ///< samples that block until release()
  std::vector<std::size_t> hang_indices;  ///< these block until release() too (map-style index
                                          ///< or stream key)
};

/// What FaultInjector does to one sample.
enum class Fault : std::uint8_t { None, Throw, Transient, Delay, Hang };

namespace detail {
/// The fault of `key` under `o` (one uniform draw keyed by (o.seed, key) picks at most one).
Fault fault_for(const FaultOptions& o, std::uint64_t key) noexcept;

/// State shared by an injector's copies: the hang gate and transient attempt counts.
class FaultState {
 public:
  explicit FaultState(FaultOptions o) : opt(std::move(o)) {}
  const FaultOptions opt;
  Fault fault(std::uint64_t key) const noexcept;
  /// Applies key's fault on the calling thread: throws, sleeps or blocks as chosen. `what` names
  /// the dataset in messages.
  void apply(std::uint64_t key, const char* what);
  void release();
  std::size_t hanging() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  std::size_t hanging_ = 0;
  std::unordered_map<std::uint64_t, int> transient_seen_;
};
}  // namespace detail

/// A dataset that behaves as `base` except on the samples FaultOptions picks. Map-style (keeps
/// direct mode when the base has it) and iterable (keyed by (worker id << 40) + stream position,
/// as MappedIterable; a throwing record is read from the base first, so it is lost, not shifted).
template <class D>
class FaultInjector : public DatasetBase<FaultInjector<D>> {
 public:
  FaultInjector(D base, FaultOptions options)
      : base_(std::move(base)), state_(std::make_shared<detail::FaultState>(std::move(options))) {}

  std::size_t size() const requires requires(const D& d) { d.size(); }
  { return base_.size(); }
  auto get(std::size_t i, SampleContext& ctx) const requires MapDataset<D> {
    state_->apply(i, "FaultInjector");
    return fetch(base_, i, ctx);
  }
  auto make_batch(std::size_t rows, BatchAllocator& a) const requires DirectDataset<D> { return base_.make_batch(rows, a); }
  template <class B>
  requires DirectDataset<D>
  void get_into(std::size_t i, B& batch, std::size_t row, SampleContext& ctx) const {
    state_->apply(i, "FaultInjector");
    base_.get_into(i, batch, row, ctx);
  }

  class Stream {
   public:
    auto next() {
      auto s = inner_.next();
      if (s) state_->apply((static_cast<std::uint64_t>(worker_) << 40) + position_++, "FaultInjector stream");
      return s;
    }

   private:
    friend class FaultInjector;
    using Inner = std::decay_t<decltype(std::declval<const D&>().open(std::declval<const WorkerInfo&>()))>;
    Stream(Inner inner, std::shared_ptr<detail::FaultState> st, int worker)
        : inner_(std::move(inner)), state_(std::move(st)), worker_(worker) {}
    Inner inner_;
    std::shared_ptr<detail::FaultState> state_;
    int worker_;
    std::uint64_t position_ = 0;
  };
  Stream open(const WorkerInfo& w) const requires IterableDataset<D> { return Stream(base_.open(w), state_, w.id); }

  /// The fault of map-style index i (or stream key (worker << 40) + position).
  Fault fault(std::uint64_t key) const noexcept { return state_->fault(key); }
  /// Lets every sample that hangs (now or later) return. Idempotent.
  void release() const { state_->release(); }
  /// Samples blocked in a hang right now.
  std::size_t hanging() const { return state_->hanging(); }
  const D& base() const noexcept { return base_; }

 private:
  D base_;
  std::shared_ptr<detail::FaultState> state_;
};

}  // namespace ferry
