// ferry/detail/engine.h — the type-erased pipeline under DataLoader<D>. Not for direct use.
//
// Note [Engine design]
// The engine knows nothing of sample or batch types: the templated DataLoader implements
// Producer (fetch + collate one batch) and hands batches across as Payloads. That keeps threads,
// queues and oneTBB inside src/ (compiled once, third-party headers private) while the per-type
// code stays inline in the loader.
//
// Per epoch, the consumer thread dispatches jobs to the workers through task queues: map-style
// datasets use one shared queue (any worker takes the next batch, which balances slow samples),
// or with round_robin one queue per worker as PyTorch assigns them (batch b to worker b mod W);
// streams use one queue per worker (worker w must produce its own stream's batches). Job keys are
// batch indices (map-style) or j * num_workers + w (the j-th batch of worker w's stream), so the
// in-order sequence is the key sequence and stream batches interleave round-robin, as PyTorch's.
// At most prefetch_factor * num_workers jobs are in flight; results wait in a reorder window of
// that many slots until their turn. Failures travel as data (an exception_ptr in the result) and
// are rethrown by next() at the failed batch's position.
//
// Note [Shutdown order]
// end_epoch(): mark the epoch cancelled (workers stop between samples and drop its queued jobs),
// then, for non-persistent workers, close the task queues and join every worker. shutdown() does
// the same for persistent workers. A worker inside user code finishes that call first; nothing
// else is waited for. The epoch's state is shared by its queued jobs, so it dies with the last.
//
// Note [Abandoned workers]
// With a timeout, a worker is never waited for longer than `timeout` past the start of its job:
// a call that never returns (a dead mount) must not hang the consumer, the destructor or exit.
// Such a worker is abandoned: a compare-and-swap on its control block (Busy -> Abandoned, raced
// against the worker's own Busy -> Idle) decides once whether its result counts; its thread is
// detached, and a fresh worker takes its slot. The abandoned thread holds shared ownership of
// everything it may still touch: its control block, its task queue, the epoch (through its task)
// and the loader's state (Producer::keep_alive()), so nothing is freed under it; if its call ever
// returns it sees it was abandoned, drops its result and exits. Map-style: while the consumer
// waits, every worker that has been on one batch for `timeout` is abandoned (a worker that started
// its batch later gets its own full `timeout`: its current sample is not known to be stuck), and
// its batch either fails at its position with TimeoutError, or, when the producer takes
// skip/replace (EngineOptions::redispatch_stuck) and the stuck sample is known, is dispatched
// again with that sample named in Job::stuck. Streams cannot be re-read past a call that has
// not returned: there a timeout is raised as before and the stuck worker is abandoned when the
// epoch ends. Without a keep-alive (or without a timeout) workers are joined as before.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/core/dataset.h"
#include "ferry/core/sampler.h"
#include "ferry/core/trace.h"
#include "ferry/detail/numa.h"

namespace ferry::detail {

/// A type-erased, move-only batch.
class Payload {
 public:
  Payload() = default;
  template <class T>
  static Payload make(T&& value) {
    using V = std::decay_t<T>;
    Payload p;
    p.ptr_ = Ptr(new V(std::forward<T>(value)), [](void* q) { delete static_cast<V*>(q); });
    return p;
  }
  template <class T>
  T& get() noexcept {
    return *static_cast<T*>(ptr_.get());
  }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  using Ptr = std::unique_ptr<void, void (*)(void*)>;
  Ptr ptr_{nullptr, nullptr};
};

/// A sample the consumer gave up on (its worker was abandoned while fetching it).
struct StuckSample {
  std::size_t index = 0;
  std::string message;  ///< "stuck for 512 ms in stage 'fetch' on worker 2 (abandoned)"
};

/// One batch to produce.
struct Job {
  std::uint64_t key = 0;                 ///< position in the epoch's key sequence
  std::int64_t batch = 0;                ///< batch index (map-style, shared streams) or the worker's j-th batch (stream)
  std::span<const std::size_t> indices;  ///< map-style: the batch's sample indices
  const BatchPlan* plan = nullptr;       ///< map-style: the epoch's plan (its every sample: sample_at)
  /// A lazy plan's batch: the indices `indices` views, computed as the job was made.
  std::shared_ptr<const std::vector<std::size_t>> owned;
  int attempt = 0;                                        ///< > 0: dispatched again after a worker was abandoned
  std::shared_ptr<const std::vector<StuckSample>> stuck;  ///< samples not to fetch again (may be null)
};

/// What a worker hands the producer along with a job.
class JobContext {
 public:
  JobContext(const WorkerInfo& worker, StageMeter& stage, const std::atomic<bool>& cancelled, std::shared_ptr<void>& stream,
             const std::atomic<int>* abandoned = nullptr, std::atomic<std::int64_t>* published_sample = nullptr)
      : worker(worker), stage(stage), stream(stream), cancelled_(cancelled), state_(abandoned), published_(published_sample) {}
  const WorkerInfo& worker;
  StageMeter& stage;
  /// True once the epoch is being torn down or this worker was abandoned: return promptly.
  bool cancelled() const noexcept {
    return cancelled_.load(std::memory_order_relaxed) || (state_ && state_->load(std::memory_order_relaxed) == 2);
  }
  /// Per-worker, per-epoch state (the worker's open stream); starts empty each epoch.
  std::shared_ptr<void>& stream;
  /// The sample being fetched, named in error messages and timeouts.
  std::optional<std::size_t> current_sample;
  void set_sample(std::optional<std::size_t> sample) noexcept {
    current_sample = sample;
    if (published_) published_->store(sample ? static_cast<std::int64_t>(*sample) : -1, std::memory_order_relaxed);
  }
  /// Stream mode: dataset positions read so far by this worker (named in errors).
  std::span<const std::size_t> stream_indices;
  /// Stream mode: set by a produce() that returns an empty Payload for a batch whose records all
  /// failed under Skip/Replace: the batch is left out and the epoch goes on (not its end).
  bool skipped = false;

 private:
  const std::atomic<bool>& cancelled_;
  const std::atomic<int>* state_;
  std::atomic<std::int64_t>* published_;
};

/// Implemented by DataLoader<D>: the per-type work of one batch.
class Producer {
 public:
  virtual ~Producer() = default;
  /// Runs worker_init_fn (if any) on worker thread `worker.id`.
  virtual void init_worker(const WorkerInfo& worker) = 0;
  /// Map-style: the batch of job.indices. Stream: the worker's next batch, or an empty Payload when
  /// its stream is exhausted. Either: an empty Payload when ctx.cancelled().
  virtual Payload produce(const Job& job, JobContext& ctx) = 0;
  /// Shared ownership of everything produce() touches, held by each worker thread so that an
  /// abandoned worker never sees it freed (Note [Abandoned workers]). Null: never abandon.
  virtual std::shared_ptr<void> keep_alive() { return nullptr; }
  /// Called on the consumer thread when a worker stuck on `sample` is abandoned.
  virtual void sample_abandoned(std::size_t sample) { (void)sample; }
  /// Stream: called on a worker's thread between its jobs, with its stream's state (what its last
  /// produce() left in ctx.stream), every few milliseconds while it returns true: moves the
  /// stream's reads sent ahead along, so that they arrive while the worker waits for its next job
  /// (a worker waits whenever the loader's queue is full). True while some are on their way.
  virtual bool idle(std::shared_ptr<void>& stream) noexcept {
    (void)stream;
    return false;
  }
};

/// DataLoaderOptions::wait_poll, as the engine and the pin stage run it while the consumer waits.
struct WaitPoll {
  std::function<bool()> fn;
  std::chrono::microseconds period{50000};
  /// Set by check() when it throws Interrupted, until the epoch ends: the engine then abandons the
  /// batches still being made instead of waiting for them (Note [Abandoned workers]). The Engine
  /// makes it.
  std::shared_ptr<std::atomic<bool>> interrupted;
  explicit operator bool() const noexcept { return static_cast<bool>(fn); }
  /// Whether check() may throw on this thread (false on a thread under NoWaitPoll).
  bool active() const noexcept;
  /// Runs the poll; throws ferry::Interrupted when it asks the wait to stop.
  void check() const;
};

/// How long the consumer waits for a stage behind the workers (the pin thread, a GPU decode)
/// before it is a TimeoutError: twice DataLoaderOptions::timeout, so that the workers' own
/// timeout (which abandons a stuck worker) comes first; max() without a timeout.
inline std::chrono::microseconds stage_timeout(std::chrono::milliseconds timeout) {
  return timeout.count() > 0 ? std::chrono::duration_cast<std::chrono::microseconds>(timeout) * 2
                             : std::chrono::microseconds::max();
}

/// The consumer's bounded wait: calls try_for(slice) (true: done) in slices of at most the poll's
/// period (or `idle` where nothing bounds it), running the poll between them (ferry::Interrupted
/// propagates: the caller's next call waits again), until `limit` has passed. True when try_for
/// succeeded, false when the limit passed first (the caller raises its TimeoutError).
template <class TryFor>
bool wait_polled(const WaitPoll& poll, std::chrono::microseconds limit, TryFor&& try_for,
                 std::chrono::microseconds idle = std::chrono::microseconds(100000)) {
  using std::chrono::microseconds;
  const bool unbounded = limit == microseconds::max();
  const auto since = std::chrono::steady_clock::now();
  for (;;) {
    const auto waited = std::chrono::duration_cast<microseconds>(std::chrono::steady_clock::now() - since);
    microseconds slice = unbounded ? idle : std::max(limit - waited, microseconds(0));
    if (poll) slice = std::min(slice, poll.period);
    if (try_for(slice)) return true;
    if (poll) poll.check();
    if (!unbounded && std::chrono::steady_clock::now() - since >= limit) return false;
  }
}

struct EngineOptions {
  int num_workers = 0;
  int prefetch_factor = 2;
  bool in_order = true;
  bool persistent_workers = false;
  bool streaming = false;
  /// Map-style: batch b to worker b mod num_workers (DataLoaderOptions::round_robin).
  bool round_robin = false;
  /// Streams that fill batches across workers (Note [One batcher across workers]): job b is the
  /// epoch's batch b, taken by whichever worker is free from one queue; a job whose batch has no
  /// records ends the epoch there. Otherwise worker w's stream makes keys w, w + W, ...
  bool shared_stream = false;
  std::chrono::milliseconds timeout{0};
  /// Map-style: after a timeout, dispatch the stuck batch again without its stuck sample (up to
  /// max_redispatch times) instead of failing it.
  bool redispatch_stuck = false;
  int max_redispatch = 3;
  std::uint64_t seed = 0;
  std::size_t batch_size = 0;  ///< WorkerInfo::batch_size
  /// WorkerInfo::next_epoch_ahead (DataLoaderOptions::prefetch_next_epoch).
  bool next_epoch_ahead = false;
  TraceRecorder* trace = nullptr;  ///< per-batch timelines (may be null)
  /// Where the workers run (Note [NUMA placement] in ferry/detail/numa.h); null: anywhere.
  std::shared_ptr<const Placement> placement;
  /// Run while the consumer waits in next() (and in the pin stage's next()).
  WaitPoll wait_poll;
};

/// The engine of one DataLoader: worker threads, task and result queues, reorder window.
/// Thread safety: all members are called from the one consumer thread that owns the loader.
class Engine {
 public:
  /// `producer` must outlive the engine.
  Engine(EngineOptions options, Producer& producer);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Starts an epoch; `plan` is null in stream mode. Throws ferry::Error if one is live. Map-style
  /// epochs may start at batch `start` of the plan (a resumed epoch: batches before it are never
  /// fetched; batch numbers, sample generators and replacements stay those of the whole epoch).
  void begin_epoch(std::uint64_t epoch, std::shared_ptr<const BatchPlan> plan, std::uint64_t start = 0);
  /// Makes the first batches of the epoch after the live one while the live one's last batches
  /// are consumed: once all the live epoch's jobs are out, `plan`'s jobs follow, as many as the
  /// prefetch window has room for. begin_epoch(epoch, plan) with the same plan (the same pointer)
  /// from batch 0 then takes them over; any other begin_epoch drops them. A stream that fills
  /// batches across workers (shared_stream) passes a null plan: the next epoch's jobs follow once
  /// the live epoch's end is known. Map-style or shared streams, in order, persistent workers, no
  /// timeout; otherwise it does nothing.
  void prefetch_next(std::uint64_t epoch, std::shared_ptr<const BatchPlan> plan);
  /// Whether prefetch_next can apply to this engine's options.
  bool prefetches_next() const noexcept;
  /// The plan of `epoch` if its batches are being made ahead, else null.
  std::shared_ptr<const BatchPlan> plan_made_ahead(std::uint64_t epoch) const noexcept;
  /// Every batch made on next()'s thread (as with num_workers = 0) whatever num_workers says: for
  /// the device gather, whose batches are their indices. Before the first epoch (ferry::Error after).
  void without_workers();
  /// The key of the next batch to deliver (batches are keyed 0, 1, ... in plan or round-robin
  /// order), or -1 when that is not defined (delivered out of order).
  std::int64_t next_key() const noexcept;
  /// The next batch, or an empty Payload at the end of the epoch. Throws WorkerError (the batch at
  /// this position failed; the epoch goes on with the next) or TimeoutError.
  Payload next();
  /// Whether next() would return without waiting on a worker: always with no workers (next()
  /// makes the batch itself) or no live epoch, else when the next batch has arrived or the epoch
  /// has none left. Takes in what the workers finished meanwhile. Call it on next()'s thread.
  bool ready();
  /// Ends the live epoch, finished or not (idempotent). See Note [Shutdown order].
  void end_epoch() noexcept;
  /// Ends the epoch and joins every worker (idempotent).
  void shutdown() noexcept;
  /// Makes a next() blocked on another thread return an empty Payload promptly, and the workers
  /// drop the epoch's remaining work. The only member safe to call from another thread while
  /// next() runs; the owner calls end_epoch() after that thread is done with the engine.
  void interrupt() noexcept;
  bool epoch_live() const noexcept;
  const WaitPoll& wait_poll() const noexcept;
  /// Nanoseconds the workers (or, with no workers, the thread producing inline) have spent in
  /// `stage`, summed over threads, since the engine started.
  std::int64_t stage_ns(Stage stage) const noexcept;
  /// Workers abandoned so far (Note [Abandoned workers]) and TimeoutErrors raised.
  std::uint64_t abandoned_workers() const noexcept;
  std::uint64_t timeouts() const noexcept;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

/// Builds a WorkerError around the exception being handled; call only inside a catch block.
/// stream: indices are stream positions, and batch the worker's j-th batch unless shared_stream
/// (then the epoch's batch, as map-style).
std::exception_ptr wrap_current_exception(int worker, std::int64_t batch, std::span<const std::size_t> indices, Stage stage,
                                          std::optional<std::size_t> sample, bool stream, bool shared_stream = false);

/// Logs `message` at warning level once per process for each distinct `key`.
void warn_once(const char* key, const std::string& message);
/// Logs at debug level.
void log_debug(const std::string& message);
/// Logs at info level.
void log_info(const std::string& message);

}  // namespace ferry::detail
