// ferry/detail/loader_core.h — the compiled part of ferry::DataLoader. Not for direct use.
//
// DataLoader<Dataset, CollateFn> (ferry/core/dataloader.h) keeps only what needs the dataset's and
// the batch's types: fetching samples, collating them, visiting a batch's tensors. Everything
// else is here, compiled once in dataloader/: the options (checked by normalize_options before
// anything starts), the engine and its workers, the per-sample error policy, the route a batch
// takes to the consumer (Route), the pools, resume and statistics.
//
// The typed loader hands the core two things: a Producer (the engine's workers call it to make a
// batch) and TypedBatches (the route calls it to visit a batch's tensors, or to make a batch of
// gathered fields). Both are the typed loader's state, which owns the core and outlives it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/options.h"
#include "ferry/core/state.h"
#include "ferry/core/stats.h"
#include "ferry/detail/engine.h"
#include "ferry/detail/io_counters.h"

namespace ferry {

class DeviceStage;    // ferry/pinning/device.h
class ParallelFor;    // ferry/core/parallel.h
class PinContext;     // ferry/pinning/pin.h
class PinnedPool;     // ferry/pinning/pool.h
class SampleContext;  // ferry/core/dataset.h
class Tensor;         // ferry/core/tensor.h
class EventFence;     // ferry/pinning/fence.h
namespace cuda {
class Stream;  // ferry/pinning/cuda.h
}

namespace detail {

/// The way a batch travels from the worker that made it to the consumer: one choice, made when
/// the loader is built (LoaderCore::route()).
enum class Route {
  Workers,         ///< the engine's queue straight to the consumer (no pinning, no device)
  Pinned,          ///< a pin thread copies each batch into a pinned block (pin_memory)
  PinnedToDevice,  ///< pinned, then the consumer's thread issues each batch's copy to the device
                   ///< up to device_prefetch batches ahead (device)
  DeviceIssued,    ///< the pin thread issues the device work itself: the device gather (workers
                   ///< make index batches) or GPU decode (workers make compressed batches)
};
const char* route_name(Route r) noexcept;

/// What the typed loader knows about its dataset and batch at compile time.
struct LoaderTraits {
  bool streaming = false;        ///< an iterable dataset (no sampler, no plan)
  bool across_workers = false;   ///< a stream that fills batches across workers (detail::fills_across_workers)
  bool direct = false;           ///< batches written by get_into (make_batch)
  bool default_collate = true;   ///< no collate_fn
  bool pinnable = false;         ///< the batch can be pinned (ferry::PinMemory or collated fields)
  bool truncatable = false;      ///< a direct batch can drop rows (on_error = Skip)
  bool gpu_decode = false;       ///< the dataset decodes its images on the device
  std::size_t dataset_size = 0;  ///< a map-style dataset's size; a stream's size() or 0
};

/// The typed loader's side of the route.
class TypedBatches {
 public:
  virtual ~TypedBatches() = default;
  /// Visits every tensor of the batch in `batch` with ctx: pins it, or moves it to the device.
  virtual void walk(Payload& batch, PinContext& ctx) = 0;
  /// The device gather's batch from its fields (one device tensor a field, in host_rows() order).
  virtual Payload from_fields(std::vector<Tensor>&& fields) = 0;
};

/// Rows of a batch the error policy delivered.
struct Rows {
  bool complete = true;  ///< false: the epoch was cancelled
  std::size_t kept = 0;  ///< rows delivered (fewer than the batch's samples when some were skipped)
};

/// fn(row, index, ctx): fetches sample `index` into row `row`.
using SampleFn = std::function<void(std::size_t row, std::size_t index, SampleContext& ctx)>;

class LoaderCore {
 public:
  /// Checks and completes the options (normalize_options), starts nothing.
  LoaderCore(DataLoaderOptions options, const LoaderTraits& traits, Producer& producer, TypedBatches& typed);
  ~LoaderCore();
  LoaderCore(const LoaderCore&) = delete;
  LoaderCore& operator=(const LoaderCore&) = delete;

  /// Chooses the route and builds its stages. `gather`: the dataset's fields when the device
  /// gather can make the batches; `gather_refused`: why it cannot (nullopt: not considered).
  void build_route(std::vector<HostRows> gather, std::optional<std::string> gather_refused);

  const DataLoaderOptions& options() const noexcept;
  Route route() const noexcept;
  /// Where workers write batches (pinned in direct pin_mode, else recycled pageable memory).
  BatchAllocator& allocator() const noexcept;
  /// The intra-batch pool (intra_batch_threads), or null.
  ParallelFor* intra_pool() const noexcept;
  /// Whether the device gather makes the batches (workers make only index batches).
  bool gathering() const noexcept;

  // --- Worker side (any worker thread) ---
  /// Device gather: the job's batch as its sample indices (and row flips), for the pin thread.
  Payload gather_index(const Job& job, JobContext& ctx);
  /// Calls fn for every sample of the job's batch under the error policy (retries of transient
  /// I/O errors, Raise / Skip / Replace, stuck samples), in order on this worker or across the
  /// intra-batch pool. `compact`: skipped samples leave no hole. A failure that fails the batch is
  /// rethrown with ctx's current sample naming it.
  Rows for_each_sample(const Job& job, JobContext& ctx, bool compact, const SampleFn& fn);
  /// Whether the job's samples may be fetched by the typed loader's inline loop: on_error = Raise,
  /// no intra-batch pool, no sample listed as stuck.
  bool simple_policy(const Job& job) const noexcept;
  /// The inline loop's sample at `row` threw (the exception in flight): retries a transient I/O
  /// error io_retries times with backoff through fn; rethrows what remains.
  void retry_sample(std::size_t row, std::size_t index, JobContext& ctx, const SampleFn& fn);
  /// A stream's record at `position` failed (the exception in flight): under Raise rethrows it,
  /// else reports it and returns; throws after 1024 failures in a row.
  void stream_record_failed(JobContext& ctx, std::int64_t batch, std::size_t position, std::size_t failures_in_a_row);
  /// Streams: the first batch key of `epoch` when it is the resumed epoch (0: from the start).
  std::uint64_t stream_resume_key(std::uint64_t epoch) const noexcept;
  void init_worker(const WorkerInfo& worker);
  /// This loader's object-store counters: a worker makes them current while it makes a batch.
  IoCounters* io_counters() noexcept;
  void sample_abandoned(std::size_t sample);

  // --- Consumer side (the consumer's thread) ---
  /// Starts the next epoch (restore()'s position, or a fresh plan). Throws while one is live.
  void begin_epoch();
  /// The next batch; empty at the end of the epoch. Rethrows the batch's error at its position.
  Payload next();
  /// Ends the live epoch (the iterator is gone), keeping its position for state().
  void end_epoch() noexcept;
  /// Stops the pin thread and the workers (idempotent); the typed loader calls it first.
  void stop() noexcept;
  std::size_t batches_per_epoch() const;
  LoaderState save_state() const;
  void restore_state(const LoaderState& state);
  std::uint64_t next_epoch() const noexcept;
  void set_epoch(std::uint64_t epoch) noexcept;
  LoaderStats stats() const;
  void reset_stats();
  bool pinned() const noexcept;
  const std::shared_ptr<PinnedPool>& pinned_pool() const noexcept;
  const DeviceStage* device_stage() const noexcept;
  const cuda::Stream* stream() const noexcept;

  struct Parts;  // loader/core.cpp

 private:
  std::unique_ptr<Parts> p_;
};

}  // namespace detail
}  // namespace ferry
