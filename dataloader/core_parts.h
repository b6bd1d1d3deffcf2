// LoaderCore's parts (dataloader/): what core.cpp (the route, epochs), policy.cpp (the per-sample
// error policy) and resume.cpp (state, restore, statistics) share; the route's owners of their own
// (the device gather, the device hand-over) are in gather_path.h and hand_over.h. Private to this
// folder.
#pragma once

#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ferry/core/error.h"
#include "ferry/core/parallel.h"
#include "ferry/core/rows.h"
#include "ferry/core/sampler.h"
#include "ferry/core/trace.h"
#include "ferry/detail/engine.h"
#include "ferry/detail/fault_log.h"
#include "ferry/detail/loader_core.h"
#include "ferry/detail/numa.h"
#include "ferry/detail/pin_stage.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/gather.h"
#include "ferry/pinning/pin.h"
#include "ferry/pinning/pool.h"
#include "gather_path.h"
#include "hand_over.h"

namespace ferry::detail {

/// Statistics kept on the consumer's thread, and the counters' values at reset_stats().
struct StatsBook {
  std::int64_t origin_ns = 0, wait_ns = 0, last_delivered_ns = 0;
  std::uint64_t delivered_batches = 0;
  struct Base {
    std::int64_t stage_ns[kStageCount] = {};
    std::int64_t pin_ns = 0, wait_ns = 0;
    double copy_ms = 0, decode_ms = 0, gather_ms = 0;
    std::uint64_t images_decoded = 0, rows_gathered = 0;
    FaultCounts faults;
    std::uint64_t timeouts = 0, abandoned = 0;
    std::uint64_t store_requests = 0, store_bytes = 0, store_retries = 0, store_hedges = 0, cache_hits = 0;
  } base;
};

/// Where the loader is in its epochs: what begin/next/end_epoch move along and state() and
/// restore() read and set (core.cpp, resume.cpp). Consumer thread, but for stream_resume (its lock).
struct EpochBook {
  std::int64_t epoch_delivered = 0;  // batches handed over in the live epoch (failed ones too)
  std::uint64_t next_epoch = 0;
  struct Resume {
    std::shared_ptr<const BatchPlan> plan;
    std::uint64_t batch = 0;
    std::size_t segment_start = 0;
  };
  std::optional<Resume> resume;                 // set by restore(), taken by the next begin()
  std::shared_ptr<const BatchPlan> epoch_plan;  // the live (or last) epoch's plan
  mutable std::optional<std::uint64_t> epoch_plan_hash;
  std::size_t segment_start = 0;   // DistributedSampler: see LoaderState
  std::uint64_t live_epoch = 0;    // the epoch the live iterator runs
  bool epoch_exhausted = false;    // the live iterator reached the epoch's end
  bool stopped_mid_epoch = false;  // the last epoch ended early: state() is its position
  std::int64_t stopped_key = 0;    // streams: the engine's next key when it did
  // Streams: the resumed epoch and its first key, set together and read together (one lock: a
  // reader must not see one epoch's number with another's key). Written before the epoch's
  // workers start; a worker abandoned in an earlier epoch's open() may still read them, and a
  // worker making the next epoch's first batches ahead reads them too (that epoch starts at 0).
  struct StreamResume {
    std::uint64_t epoch = 0, key = 0;
  };
  mutable std::mutex stream_resume_mu;
  StreamResume stream_resume;  // under stream_resume_mu
  // The next epoch's plan, made on a thread of its own while this epoch runs (begin_epoch), where
  // the engine does not make the next epoch's first batches ahead itself. Its future joins that
  // thread when dropped.
  struct PlanAhead {
    std::uint64_t epoch = 0;
    std::future<std::shared_ptr<const BatchPlan>> plan;
  };
  std::optional<PlanAhead> plan_ahead;
};

struct LoaderCore::Parts {
  Parts(DataLoaderOptions o, const LoaderTraits& t, Producer& producer, TypedBatches& typed);
  ~Parts();

  void stop() noexcept;
  // The route (core.cpp).
  bool make_pinned_pool();
  /// Recycled pageable batch buffers (collate_pool), kept up to `limit` bytes, the cap grown to
  /// `depth` batches where `may_grow` (cache_blocks, which it returns).
  BatchAllocator* pageable_cache(std::size_t limit, std::size_t depth, const char* what, bool may_grow);
  /// Batches the workers may hold: prefetch_factor x num_workers (one worker where there are none).
  std::size_t in_flight() const noexcept;
  void choose_gather(std::vector<HostRows> fields, std::string why);
  void setup_gather();
  /// The device gather's batches in flight, for small batches (setup_gather).
  static constexpr std::size_t kGatherDepthMax = 24, kGatherDepthBytes = std::size_t{32} << 20;
  void setup_pinning();
  Payload last_stage_next();
  bool gathering() const noexcept { return gather != nullptr; }
  /// The worker threads that make batches: num_workers, or 0 where they are made inline (the
  /// device gather makes them on the pin thread whatever num_workers says).
  int producers() const noexcept { return gathering() ? 0 : opt.num_workers; }
  // Resume (resume.cpp).
  std::shared_ptr<const DistributedSampler> distributed() const;
  std::shared_ptr<const BatchPlan> plan_of(std::uint64_t epoch, std::size_t segment_start) const;
  // The error policy (policy.cpp).
  /// Tries fn on sample i, the first try counted as try `first` (for the backoff and io_retries).
  std::exception_ptr attempt(std::size_t row, std::size_t i, JobContext& ctx, StageMeter* meter, const SampleFn& fn,
                             int first = 0);
  bool retry_after(const std::exception_ptr& e, int a, JobContext& ctx);
  bool fetch_row(const Job& job, JobContext& ctx, std::size_t r, std::size_t row, StageMeter* meter, const SampleFn& fn,
                 std::size_t* used);

  const LoaderTraits traits;
  DataLoaderOptions opt;
  TypedBatches& typed;
  std::shared_ptr<const BatchSampler> batch_sampler;
  std::shared_ptr<const Placement> placement;  // Note [NUMA placement]; null: not placed
  std::unique_ptr<ParallelFor> pool;           // intra_batch_threads
  BatchAllocator* allocator;                   // where workers write batches
  FaultLog faults;
  std::shared_ptr<PinnedPool> pinned_pool;
  std::shared_ptr<PinnedPool> collate_pool;  // copy mode, or no pinning: recycled pageable batch buffers
  std::unique_ptr<DepthCheckedAllocator> pin_blocks, direct_blocks;
  std::unique_ptr<DepthCheckedAllocator> cache_blocks;  // collate_pool's, its cap grown to the pipeline's depth
  std::unique_ptr<ParallelFor> pin_copy_pool;
  StatsBook stats;  // consumer thread
  IoCounters io;    // this loader's object-store reads (its workers add to them)

  EpochBook epochs;  // consumer thread (stream_resume: workers too, under its lock)

  Engine engine;                        // built after, and shut down before, everything it calls into
  std::unique_ptr<PinStage> pin_stage;  // the engine's consumer when pinning; stops first
  std::unique_ptr<DeviceStage> device_stage;
  // The device gather (null: the host path); its registration is undone after the copy stream
  // has finished, in ~Parts.
  std::unique_ptr<GatherPath> gather;
  // The consumer's end of a route with a device stage (null without one). Declared after the
  // stages it takes from: it goes first, with the batches it holds.
  std::unique_ptr<DeviceHandOver> hand_over;
  Route route = Route::Workers;  // chosen once, by build_route; last_stage_next follows it
};

}  // namespace ferry::detail
