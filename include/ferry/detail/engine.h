// ferry/detail/engine.h — the type-erased pipeline under DataLoader<D>. Not for direct use.
//
// Note [Engine design]
// The engine knows nothing of sample or batch types: the templated DataLoader implements
// Producer (fetch + collate one batch) and hands batches across as Payloads. That keeps threads,
// queues and oneTBB inside src/ (compiled once, third-party headers private) while the per-type
// code stays inline in the loader.
//
// Per epoch, the consumer thread dispatches jobs to the workers through task queues: map-style
// datasets use one shared queue (any worker takes the next batch, which balances slow samples);
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
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <utility>

#include "ferry/core/dataset.h"
#include "ferry/core/sampler.h"
#include "ferry/core/trace.h"

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
  T& get() noexcept { return *static_cast<T*>(ptr_.get()); }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  using Ptr = std::unique_ptr<void, void (*)(void*)>;
  Ptr ptr_{nullptr, nullptr};
};

/// One batch to produce.
struct Job {
  std::uint64_t key = 0;                   ///< position in the epoch's key sequence
  std::int64_t batch = 0;                  ///< batch index (map-style) or the worker's j-th batch (stream)
  std::span<const std::size_t> indices;    ///< map-style: the batch's sample indices
};

/// What a worker hands the producer along with a job.
class JobContext {
 public:
  JobContext(const WorkerInfo& worker, StageMeter& stage, const std::atomic<bool>& cancelled,
             std::shared_ptr<void>& stream)
      : worker(worker), stage(stage), stream(stream), cancelled_(cancelled) {}
  const WorkerInfo& worker;
  StageMeter& stage;
  /// True once the epoch is being torn down: return an empty Payload promptly.
  bool cancelled() const noexcept { return cancelled_.load(std::memory_order_relaxed); }
  /// Per-worker, per-epoch state (the worker's open stream); starts empty each epoch.
  std::shared_ptr<void>& stream;
  /// The sample being fetched, named in error messages.
  std::optional<std::size_t> current_sample;
  /// Stream mode: dataset positions read so far by this worker (named in errors).
  std::span<const std::size_t> stream_indices;

 private:
  const std::atomic<bool>& cancelled_;
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
};

struct EngineOptions {
  int num_workers = 0;
  int prefetch_factor = 2;
  bool in_order = true;
  bool persistent_workers = false;
  bool streaming = false;
  std::chrono::milliseconds timeout{0};
  std::uint64_t seed = 0;
  TraceRecorder* trace = nullptr;  ///< per-batch timelines (may be null)
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

  /// Starts an epoch; `plan` is null in stream mode. Throws ferry::Error if one is live.
  void begin_epoch(std::uint64_t epoch, std::shared_ptr<const BatchPlan> plan);
  /// The next batch, or an empty Payload at the end of the epoch. Throws WorkerError (the batch at
  /// this position failed; the epoch goes on with the next) or TimeoutError.
  Payload next();
  /// Ends the live epoch, finished or not (idempotent). See Note [Shutdown order].
  void end_epoch() noexcept;
  /// Ends the epoch and joins every worker (idempotent).
  void shutdown() noexcept;
  /// Makes a next() blocked on another thread return an empty Payload promptly, and the workers
  /// drop the epoch's remaining work. The only member safe to call from another thread while
  /// next() runs; the owner calls end_epoch() after that thread is done with the engine.
  void interrupt() noexcept;
  bool epoch_live() const noexcept;
  /// Nanoseconds the workers (or, with no workers, the thread producing inline) have spent in
  /// `stage`, summed over threads, since the engine started.
  std::int64_t stage_ns(Stage stage) const noexcept;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

/// Builds a WorkerError around the exception being handled; call only inside a catch block.
std::exception_ptr wrap_current_exception(int worker, std::int64_t batch, std::span<const std::size_t> indices,
                                          Stage stage, std::optional<std::size_t> sample, bool stream);

/// Logs `message` at warning level once per process for each distinct `key`.
void warn_once(const char* key, const std::string& message);
/// Logs at debug level.
void log_debug(const std::string& message);

}  // namespace ferry::detail
