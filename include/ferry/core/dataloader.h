// ferry/core/dataloader.h — PyTorch's DataLoader, in C++, on threads.
//
//   ferry::DataLoader loader(ferry::TensorDataset({images, labels}),
//                            {.batch_size = 256, .shuffle = true, .num_workers = 4, .seed = 7});
//   for (int epoch = 0; epoch < 10; ++epoch)
//     for (std::vector<ferry::Tensor>& batch : loader)   // one epoch per pass
//       train_step(batch[0], batch[1]);
//
// What happens: the sampler (which depends only on seed and epoch) cuts the epoch into batches of
// indices; `num_workers` long-lived threads fetch the samples (dataset.get / get_batch / get_into),
// run transforms and collate them into one batch buffer; batches come back in sampler order (or as
// they complete with in_order = false). At most prefetch_factor * num_workers batches are in flight,
// so memory is bounded whatever the consumer's pace. num_workers = 0 does everything on the
// consumer thread.
//
// Errors: an exception in a dataset, transform, collate or worker_init_fn surfaces on the consumer
// thread at that batch's position as ferry::WorkerError (worker, batch, stage and samples named; the
// original nested). The iterator stays usable: advancing it goes on with the next batch. With
// on_error = Skip or Replace a damaged sample costs only itself (ferry/core/faults.h).
//
// Timeouts: with `timeout` set, no batch stays in a worker longer than `timeout` while the consumer
// waits, even if a call never returns: the stuck worker is abandoned (it keeps shared ownership of what it may touch and
// its late result is dropped), a fresh worker takes its slot, and the batch fails at its position
// with ferry::TimeoutError naming worker, batch, sample, stage and time (or, with Skip/Replace, is
// made again without the stuck sample). Streams cannot be read past a call that never returns:
// there TimeoutError ends the stream's epoch, and the next begin() starts afresh.
//
// Lifetime: one iterator at a time per loader (begin() while one is live throws ferry::Error).
// Destroying the iterator mid-epoch cancels the rest of the epoch; destroying the loader joins its
// threads. Either returns as soon as user code already running in a worker returns, and with a
// timeout, after at most `timeout` past the start of the stuck job (the worker is abandoned).
//
// Thread safety: a DataLoader and its iterator belong to one consumer thread. The dataset's get()
// (and get_batch, get_into, open) and the collate_fn are called from several workers at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/collate/collate.h"
#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/error.h"
#include "ferry/core/parallel.h"
#include "ferry/core/sampler.h"
#include "ferry/core/state.h"
#include "ferry/core/stats.h"
#include "ferry/core/trace.h"
#include "ferry/core/faults.h"
#include "ferry/core/options.h"
#include "ferry/detail/engine.h"
#include "ferry/detail/fault_log.h"
#include "ferry/detail/pin_stage.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/gather.h"
#include "ferry/pinning/pin.h"
#include "ferry/pinning/pool.h"

namespace ferry {

namespace detail {
template <class D, class C, bool Streaming, bool Direct, bool Default>
struct LoaderBatch;
template <class D, class C, bool S>
struct LoaderBatch<D, C, S, true, true> {
  using type = std::decay_t<decltype(std::declval<const D&>().make_batch(std::size_t{}, std::declval<BatchAllocator&>()))>;
};
template <class D, class C, bool S>
struct LoaderBatch<D, C, S, false, true> {
  static_assert(Collatable<sample_t<D>>,
                "ferry: no collate rule for this dataset's sample type; specialize ferry::CollateFields<Sample> "
                "(see ferry/collate/collate.h) or pass a collate_fn");
  using type = typename Collate<sample_t<D>>::Batch;
};
template <class D, class C, bool S>
struct LoaderBatch<D, C, S, false, false> {
  using type = std::decay_t<std::invoke_result_t<C&, std::vector<sample_t<D>>&&>>;
};

/// Direct mode with on_error = Skip: a batch made for n rows keeps its first `rows`.
template <class B>
inline constexpr bool kTruncatable = std::is_same_v<B, Tensor> || std::is_same_v<B, std::vector<Tensor>> ||
                                     requires(B& b, std::size_t n) { b.truncate_rows(n); };
template <class B>
void truncate_rows(B& b, std::size_t rows) {
  if constexpr (std::is_same_v<B, Tensor>) {
    b = b.narrow(0, static_cast<std::int64_t>(rows));
  } else if constexpr (std::is_same_v<B, std::vector<Tensor>>) {
    for (Tensor& t : b) t = t.narrow(0, static_cast<std::int64_t>(rows));
  } else if constexpr (requires { b.truncate_rows(rows); }) {
    b.truncate_rows(rows);
  } else {
    (void)b;
    (void)rows;
  }
}

/// Leases from a pinned pool, refusing a batch whose size times the pipeline's depth exceeds the
/// pool's budget: that many batches can be alive at once (in flight, in the reorder window, queued
/// for the pin thread and the device), and a budget below it would stall the in-order batch
/// behind later ones forever. Refusing names the numbers instead of hanging. With `may_grow` (the
/// user left pinned_memory_limit unset and the pool is the loader's own) the budget grows to fit
/// instead, once, within half the machine's memory, and says so at info level.
class DepthCheckedAllocator final : public BatchAllocator {
 public:
  DepthCheckedAllocator(PinnedPool& pool, std::size_t depth, const char* what, bool may_grow)
      : pool_(pool), depth_(depth), what_(what), may_grow_(may_grow) {}
  Storage allocate(std::size_t nbytes) override;

 private:
  PinnedPool& pool_;
  std::size_t depth_;
  const char* what_;
  bool may_grow_;
  std::mutex mu_;
  bool told_ = false;  // guarded by mu_
};

/// Why the device gather cannot make this loader's batches ("" when it can; then `rows` holds the
/// dataset's fields). Registration, which may fail too, comes after (RowRegistration).
template <class Dataset, class Batch>
std::string gather_unavailable(const DataLoaderOptions& o, bool default_collate, const Dataset& ds, std::vector<HostRows>& rows) {
  if (o.gather == Gather::Host) return "gather = Host";
  if (!o.device) return "it needs DataLoaderOptions::device";
  if constexpr (!RowGatherDataset<Dataset>) {
    (void)default_collate;
    (void)ds;
    (void)rows;
    return "the dataset's samples are not rows of host arrays (it has no host_rows(); TensorDataset, NpyDataset and IdxDataset do)";
  } else {
    if (!default_collate) return "a collate_fn runs on the host";
    if (o.allocator) return "DataLoaderOptions::allocator is set (batches in your memory)";
    constexpr bool kTensor = std::is_same_v<Batch, Tensor>;
    if constexpr (!GatheredBatch<Batch>) {
      return "the dataset's batch type is neither a Tensor, a std::vector<Tensor> nor a FieldsBatch";
    } else {
      std::string why;
      rows = ds.host_rows(why);
      if (rows.empty()) return why.empty() ? std::string("the dataset has no rows to gather") : why;
      if (kTensor && rows.size() != 1)
        return "the dataset's batch is one Tensor but host_rows() gave " + std::to_string(rows.size()) + " fields";
      if constexpr (FieldsBatch<Batch>)
        if (rows.size() != Batch::kGatheredFields)
          return "the dataset's batch has " + std::to_string(Batch::kGatheredFields) + " fields but host_rows() gave " +
                 std::to_string(rows.size());
      int flipping = 0;
      for (const HostRows& r : rows) {
        if (r.rows != static_cast<std::int64_t>(ds.size()))
          return r.name + " has " + std::to_string(r.rows) + " rows for a dataset of " + std::to_string(ds.size()) + " samples";
        if (std::string bad = row_transform_problem(r); !bad.empty()) return bad;
        flipping += r.transform && r.transform->flip_p > 0;
      }
      if (flipping > 1) return "more than one field's row transform flips (a sample draws one flip)";
      if (o.gather == Gather::Auto)
        for (const HostRows& r : rows)
          if (r.mapped_file)
            return r.name + " is a memory-mapped file, which gather = Auto leaves to the host path (registering a "
                            "file's mapping did not return on one host; gather = Device gathers it)";
      if (!DeviceStage::can_gather()) return "this build of ferry has no gather kernel (CMake found no CUDA compiler)";
      return "";
    }
  }
}

/// A device-gather batch before the device stage: its sample indices, in a pinned block.
struct GatherIndex {
  Tensor index;  ///< int64 [B]
};
}  // namespace detail

/// The loader. `CollateFn` is DefaultCollate (the rules of ferry/collate/collate.h) or any callable
/// `Batch(std::vector<Sample>&&)`.
template <class Dataset, class CollateFn = DefaultCollate>
  requires(MapDataset<Dataset> || IterableDataset<Dataset>)
class DataLoader {
  static constexpr bool kStreaming = IterableDataset<Dataset> && !MapDataset<Dataset>;
  static constexpr bool kDefaultCollate = std::is_same_v<CollateFn, DefaultCollate>;
  static constexpr bool kDirect = !kStreaming && kDefaultCollate && DirectDataset<Dataset>;

 public:
  using Sample = sample_t<Dataset>;
  using Batch = typename detail::LoaderBatch<Dataset, CollateFn, kStreaming, kDirect, kDefaultCollate>::type;

  /// Throws ferry::Error naming the option when the options contradict each other.
  explicit DataLoader(Dataset dataset, DataLoaderOptions options = {}, CollateFn collate_fn = {})
      : state_(std::make_shared<State>(std::move(dataset), std::move(options), std::move(collate_fn))) {}
  /// Stops the pipeline: joins every worker, or abandons one stuck past `timeout` (which keeps
  /// shared ownership of the loader's state until its call returns, if ever).
  ~DataLoader() {
    if (state_) state_->stop();
  }
  DataLoader(DataLoader&&) noexcept = default;
  DataLoader& operator=(DataLoader&& o) noexcept {
    if (this != &o) {
      if (state_) state_->stop();
      state_ = std::move(o.state_);
    }
    return *this;
  }

  struct sentinel {};

  /// Input iterator over one epoch's batches. Move-only.
 private:
  struct State;  // defined below; the iterator holds a pointer to it

 public:
  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    iterator(iterator&& o) noexcept : state_(std::exchange(o.state_, nullptr)), current_(std::move(o.current_)), fetched_(o.fetched_) {}
    iterator& operator=(iterator&& o) noexcept {
      if (this != &o) {
        release();
        state_ = std::exchange(o.state_, nullptr);
        current_ = std::move(o.current_);
        fetched_ = o.fetched_;
      }
      return *this;
    }
    ~iterator() { release(); }

    /// The current batch. Throws WorkerError if it failed, ferry::Error past the end.
    Batch& operator*() {
      fill();
      if (!current_) throw Error("DataLoader: dereferenced the end of the epoch");
      return *current_;
    }
    Batch* operator->() { return &**this; }
    iterator& operator++() {
      fill();
      current_.reset();
      fetched_ = false;
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(sentinel) { fill(); return !current_; }

   private:
    friend class DataLoader;
    explicit iterator(typename DataLoader::State* s) : state_(s) {}
    void fill() {
      if (fetched_ || !state_) return;
      detail::Payload p = state_->next_payload();  // may throw: the next call fetches the next batch
      fetched_ = true;
      if (p) current_.emplace(std::move(p.template get<Batch>()));
    }
    void release() noexcept {
      current_.reset();
      if (state_) state_->end_epoch();
      state_ = nullptr;
    }
    typename DataLoader::State* state_ = nullptr;
    std::optional<Batch> current_;
    bool fetched_ = false;
  };

  /// Starts the next epoch. Throws ferry::Error if an iterator of this loader is still live.
  iterator begin() {
    State& s = *state_;
    std::shared_ptr<const BatchPlan> plan;
    std::uint64_t start = 0;
    if constexpr (!kStreaming) {
      if (s.resume) {  // restore(): the saved epoch, from the batch after the last one received
        plan = s.resume->plan;
        start = s.resume->batch;
        s.segment_start = s.resume->segment_start;
        s.resume.reset();
      } else {
        s.segment_start = 0;
        // The plan the epoch's first batches were made ahead with (prefetch_next_epoch), if this
        // is that epoch; the engine then takes those batches over.
        plan = s.engine.plan_made_ahead(s.next_epoch);
        if (!plan) plan = std::make_shared<const BatchPlan>(s.batch_sampler->plan(s.next_epoch));
      }
      s.epoch_plan = plan;
      s.epoch_plan_hash.reset();
    } else {
      if (s.resume) start = s.resume->batch;  // each worker's stream skips what its batches before used
      s.resume.reset();
      s.stream_resume_key.store(start, std::memory_order_relaxed);
    }
    s.epoch_exhausted = false;
    s.stopped_mid_epoch = false;
    if (!s.stats_origin_ns) s.stats_origin_ns = now_ns();  // before any stage starts work
    s.faults.begin_epoch(s.next_epoch, plan ? plan->indices.size() : s.stream_size());
    s.engine.begin_epoch(s.next_epoch, std::move(plan), start);
    s.epoch_delivered = static_cast<std::int64_t>(start);
    s.live_epoch = s.next_epoch;
    if constexpr (!kStreaming) {
      if (s.opt.prefetch_next_epoch && s.engine.prefetches_next())
        s.engine.prefetch_next(s.next_epoch + 1, std::make_shared<const BatchPlan>(s.batch_sampler->plan(s.next_epoch + 1)));
    }
    if (s.pin_stage) s.pin_stage->start();
    s.device_queue.clear();
    s.device_end = false;
    ++s.next_epoch;
    return iterator(&s);
  }
  sentinel end() const noexcept { return {}; }

  /// Batches per epoch. Streams: only when the dataset has size() (ferry::Error otherwise).
  std::size_t size() const {
    if constexpr (kStreaming) {
      if constexpr (requires(const Dataset& d) { { d.size() } -> std::convertible_to<std::size_t>; }) {
        const std::size_t n = state_->dataset->size(), b = state_->opt.batch_size;
        return state_->opt.drop_last ? n / b : (n + b - 1) / b;
      } else {
        throw Error("DataLoader::size(): the iterable dataset has no size()");
      }
    } else {
      return state_->batch_sampler->size();
    }
  }
  /// Where the loader stands, to save with a checkpoint (ferry/core/state.h): during an epoch, and
  /// after an epoch left early (its iterator destroyed mid-epoch, as by `break`) until the next
  /// begin(), set_epoch() or restore(), just after the last batch the consumer received
  /// (prefetched batches do not count); between epochs, the start of the epoch the next begin()
  /// runs. Costs one epoch plan between epochs. A stream's mid-epoch state needs in_order and
  /// on_error = Raise (ferry::Error otherwise: its position is not a function of the batch count).
  LoaderState state() const { return state_->save_state(); }
  /// The next begin() continues where `state` stood: its epoch, from the batch after the last one
  /// received, with no consumed sample fetched again. Any num_workers, prefetch, pinning or device.
  /// ferry::Error names what differs when the state is not this loader's (seed, dataset size, the
  /// epoch's batches, rank), and while an iterator is live.
  void restore(const LoaderState& state) { state_->restore_state(state); }
  /// The epoch the next begin() starts (0, 1, 2, ... by default).
  std::uint64_t next_epoch() const noexcept { return state_->next_epoch; }
  /// Sets the epoch the next begin() starts: resume or replay an epoch exactly.
  void set_epoch(std::uint64_t epoch) noexcept {
    state_->next_epoch = epoch;
    state_->stopped_mid_epoch = false;
  }
  const Dataset& dataset() const noexcept { return *state_->dataset; }
  const DataLoaderOptions& options() const noexcept { return state_->opt; }
  /// Whether batches are written by the dataset's get_into (no collate copy).
  static constexpr bool direct() noexcept { return kDirect; }
  /// Whether batches are delivered in pinned memory (pin_memory and a usable pool).
  bool pinned() const noexcept { return state_->pin_stage != nullptr; }
  /// The pinned pool, or null when not pinning.
  const std::shared_ptr<PinnedPool>& pinned_pool() const noexcept { return state_->pinned_pool; }
  /// The device stage (its streams and statistics), or null without `device`.
  const DeviceStage* device_stage() const noexcept { return state_->device_stage.get(); }
  /// Where the loader's time went since the first begin() or reset_stats(): per-stage seconds,
  /// how busy each stage was, and the bottleneck (ferry/core/stats.h).
  LoaderStats stats() const { return state_->stats(); }
  /// Starts the statistics afresh (e.g. after a warm-up epoch).
  void reset_stats() { state_->reset_stats(); }
  /// The stream device batches are ordered on: launch work on it (null without `device`).
  const cuda::Stream* stream() const noexcept {
    return state_->device_stage ? &state_->device_stage->consumer_stream() : nullptr;
  }

 private:
  struct State final : detail::Producer, std::enable_shared_from_this<State> {
    State(Dataset d, DataLoaderOptions o, CollateFn c)
        : dataset(std::make_shared<const Dataset>(std::move(d))),
          opt(detail::normalize_options(std::move(o), kStreaming)),
          collate_fn(std::move(c)),
          batch_sampler(make_batch_sampler()),
          placement(make_placement(opt)),
          pool(make_intra_pool(opt, placement)),
          allocator(opt.allocator ? opt.allocator.get() : &pageable_allocator()),
          faults({opt.max_errors, opt.max_error_fraction}, opt.on_sample_error),
          engine(engine_options(opt, placement), *this) {
      if constexpr (requires(const Dataset& d) { { d.decodes_on_device() } -> std::convertible_to<bool>; })
        issue_on_pin_thread = dataset->decodes_on_device();  // GPU decode: see setup_pinning
      if (issue_on_pin_thread && !opt.device)
        throw Error("DataLoader: the dataset decodes its images on the GPU (ImageFolderOptions::decode = Gpu), which the "
                    "device stage does: set DataLoaderOptions::device");
      if (issue_on_pin_thread && !kDirect)
        throw Error("DataLoader: GPU decode needs the default collate (direct mode); a collate_fn cannot take compressed images");
      if constexpr (kDirect) {
        if (opt.on_error == OnError::Skip && !detail::kTruncatable<Batch>)
          throw Error("DataLoaderOptions: on_error=Skip needs a batch type that can drop rows (a Tensor, a "
                      "std::vector<Tensor>, or a member truncate_rows(std::size_t)); this dataset's direct batch has "
                      "none: use OnError::Replace, or add truncate_rows");
      }
      if (opt.trace) {
        opt.trace->name_track(TraceRecorder::kConsumerTrack, "consumer");
        if (opt.num_workers == 0) opt.trace->name_track(TraceRecorder::kInlineTrack, "batches made inline (num_workers = 0)");
      }
      if (opt.device && !cuda::available())  // the options' own rules: detail::normalize_options
        throw CudaError("DataLoader: device=cuda:" + std::to_string(*opt.device) + " needs CUDA, which is unavailable (" +
                        cuda::unavailable_reason() + ")");
      if constexpr (!kStreaming) choose_gather();
      if (gathering) setup_gather();
      else if (opt.pin_memory) setup_pinning();
      if (!opt.allocator && allocator == &pageable_allocator()) {
        // Batches on the host: recycle their buffers too. A fresh buffer over glibc's mmap
        // threshold (32 MiB) is mapped anew, and first-touching its pages cost 3x the collate
        // itself on 38.5 MB batches (one minor fault a 4 KiB page; bench_multi_gpu's host row).
        PinnedPoolOptions po;
        po.limit_bytes = opt.pinned_memory_limit.value_or(DataLoaderOptions::kDefaultPinnedMemoryLimit);
        po.backend = pageable_backend();
        po.hard_limit = false;
        collate_pool = std::make_shared<PinnedPool>(po);
        allocator = collate_pool.get();
      }
      if (opt.device && (pin_stage || gathering)) {
        DeviceStageOptions d;
        d.device = *opt.device;
        d.pack = opt.device_pack;
        d.consumer_stream = opt.consumer_stream;
        d.high_priority = opt.high_priority_copies;
        d.decode_threads = opt.gpu_decode_threads;
        device_stage = std::make_unique<DeviceStage>(d, pinned_pool);
      }
      detail::log_debug(detail::describe_options(opt, kStreaming));
    }
    ~State() override {
      stop();
      if (registration) {
        // Gathers still running read the registered arrays: finish them before unregistering.
        try {
          device_stage->copy_stream().synchronize();
        } catch (...) {
        }
        registration.reset();
      }
    }

    // Device gather (Note [Device gather]): whether it makes this loader's batches; registers the
    // dataset's arrays when it does.
    void choose_gather() {
      std::string why = detail::gather_unavailable<Dataset, Batch>(opt, kDefaultCollate, *dataset, gather_fields);
      if (why.empty()) {
        try {
          registration = std::make_unique<RowRegistration>(gather_fields, *opt.device, opt.register_memory_limit);
          gathering = true;
          for (const HostRows& r : gather_fields)
            if (r.transform && r.transform->flip_p > 0) gather_flip_p = r.transform->flip_p;
          return;
        } catch (const Error& e) {
          why = e.what();
        }
      }
      // Rows offered but not gathered (registration refused, no kernel): a surprise worth a warning;
      // a mapped file under Auto is the documented choice, said at debug level only.
      bool mapped = false;
      for (const HostRows& r : gather_fields) mapped = mapped || r.mapped_file;
      const bool offered = !gather_fields.empty() && !(mapped && opt.gather == Gather::Auto);
      gather_fields.clear();
      gather_reason = why;
      if (opt.gather == Gather::Device) throw Error("DataLoader: gather = Device cannot make this loader's batches: " + why);
      if (offered && opt.gather == Gather::Auto)
        detail::warn_once("gather-fallback", "DataLoader: the device gather is not used (" + why +
                                                 "); batches take the host path (workers copy rows into pinned blocks)");
      detail::log_debug("DataLoader: host path: " + why);
    }

    void setup_gather() {
      pinned_pool = opt.pinned_pool;
      if (!pinned_pool) {
        PinnedPoolOptions po;
        po.limit_bytes = opt.pinned_memory_limit.value_or(DataLoaderOptions::kDefaultPinnedMemoryLimit);
        po.numa_node = placement ? placement->node : -1;
        pinned_pool = std::make_shared<PinnedPool>(po);
      }
      allocator = pinned_pool.get();  // index blocks of batches too large for the gather's launch
      // The pin thread issues each batch's index copy and gathers, so the consumer's thread only
      // takes finished batches (issuing there left the GPU idle between synchronized steps).
      issue_on_pin_thread = true;
      pin_stage = std::make_unique<detail::PinStage>(engine, [this](detail::Payload& p, std::int64_t batch) {
        if constexpr (GatheredBatch<Batch>) {  // gather_unavailable refused any other before this is made
          const std::int64_t t0 = opt.trace ? now_ns() : 0;
          p = detail::Payload::make(gather_batch(p.template get<detail::GatherIndex>().index));
          if (opt.trace && opt.trace->wants(batch)) opt.trace->span(TraceRecorder::kPinTrack, "issue the gather", batch, t0, now_ns());
        }
      }, opt.pin_depth + opt.device_prefetch, opt.timeout, opt.trace.get(), placement);
    }

    // The pin thread and workers stop before anything they use is destroyed. Idempotent.
    void stop() noexcept {
      device_queue.clear();
      if (pin_stage) pin_stage->stop();
      engine.shutdown();
    }

    static detail::EngineOptions engine_options(const DataLoaderOptions& o, std::shared_ptr<const detail::Placement> placement) {
      detail::EngineOptions e;
      e.placement = std::move(placement);
      e.num_workers = o.num_workers;
      e.prefetch_factor = o.prefetch_factor;
      e.in_order = o.in_order;
      e.persistent_workers = o.persistent_workers;
      e.streaming = kStreaming;
      e.timeout = o.timeout;
      e.redispatch_stuck = o.on_error != OnError::Raise;
      e.seed = o.seed;
      e.trace = o.trace.get();
      e.wait_poll.fn = o.wait_poll;
      e.wait_poll.period = std::max(std::chrono::microseconds(o.wait_poll_period), std::chrono::microseconds(1000));
      return e;
    }

    std::shared_ptr<void> keep_alive() override { return this->shared_from_this(); }
    void sample_abandoned(std::size_t sample) override { faults.mark_stuck(sample); }

    std::size_t stream_size() const {
      if constexpr (requires(const Dataset& d) { { d.size() } -> std::convertible_to<std::size_t>; }) return dataset->size();
      else return 0;
    }

    // The next batch for the consumer, timing the wait (stats, trace).
    detail::Payload next_payload() {
      const std::int64_t t0 = now_ns();
      if (!stats_origin_ns) stats_origin_ns = t0;
      TraceRecorder* trace = opt.trace.get();
      const std::int64_t batch = epoch_delivered;
      if (trace && last_delivered_ns && trace->wants(batch - 1))
        trace->span(TraceRecorder::kConsumerTrack, "consumer holds batch", batch - 1, last_delivered_ns, t0);
      struct Timer {
        State& s;
        std::int64_t t0, batch;
        ~Timer() {
          const std::int64_t t1 = now_ns();
          s.wait_ns += t1 - t0;
          s.last_delivered_ns = t1;
          if (s.opt.trace && s.opt.trace->wants(batch)) {
            try {
              s.opt.trace->span(TraceRecorder::kConsumerTrack, "wait for batch", batch, t0, t1);
            } catch (...) {
            }
          }
        }
      } timer{*this, t0, batch};
      ++epoch_delivered;  // a failed batch takes its position too
      detail::Payload p;
      try {
        p = last_stage_next();
      } catch (const Interrupted&) {
        --epoch_delivered;  // no batch taken: the next call waits for the same one
        throw;
      }
      if (p) {
        ++delivered_batches;
      } else {
        last_delivered_ns = 0;
        epoch_exhausted = true;
      }
      return p;
    }

    // The DistributedSampler the loader batches (elastic resume), if any.
    std::shared_ptr<const DistributedSampler> distributed() const {
      if (opt.batch_sampler) return nullptr;
      return std::dynamic_pointer_cast<const DistributedSampler>(opt.sampler);
    }

    // The plan of `epoch` whose order starts at `segment_start` (DistributedSampler; else 0).
    std::shared_ptr<const BatchPlan> plan_of(std::uint64_t epoch, std::size_t segment_start) const {
      if (segment_start == 0) return std::make_shared<const BatchPlan>(batch_sampler->plan(epoch));
      return std::make_shared<const BatchPlan>(make_batches(distributed()->indices_from(epoch, segment_start), opt.batch_size, opt.drop_last));
    }

    LoaderState save_state() const {
      LoaderState st;
      st.seed = opt.seed;
      st.dataset_size = stream_size();
      const bool live = engine.epoch_live();
      if constexpr (kStreaming) {
        st.batch_size = opt.batch_size;
        st.stream_workers = static_cast<std::uint64_t>(std::max(opt.num_workers, 1));
        if ((live && !epoch_exhausted) || stopped_mid_epoch) {
          st.epoch = live_epoch;
          const std::int64_t key = live ? engine.next_key() : stopped_key;
          if (key < 0)
            throw Error("DataLoader::state(): a stream delivered out of order (in_order = false) has no position to resume "
                        "from mid-epoch; save the state between epochs, or keep in_order");
          if (key > 0 && opt.on_error != OnError::Raise)
            throw Error("DataLoader::state(): a stream resumes mid-epoch under on_error = Raise only (Skip and Replace read a "
                        "varying number of records per batch); save the state between epochs");
          st.batches = static_cast<std::uint64_t>(key);
        } else {
          st.epoch = live ? live_epoch + 1 : next_epoch;
          if (!live && resume) st.batches = resume->batch;
        }
        return st;
      } else {
        std::shared_ptr<const BatchPlan> plan;
        std::uint64_t k = 0;
        std::size_t segment = 0;
        if ((live || stopped_mid_epoch) && epoch_plan) {
          st.epoch = live_epoch;
          k = std::min<std::uint64_t>(static_cast<std::uint64_t>(epoch_delivered), epoch_plan->size());
          plan = epoch_plan;
          segment = segment_start;
          if (k == plan->size()) {  // every batch received: the next epoch, from its start
            ++st.epoch;
            k = 0;
            plan.reset();
            segment = 0;
          }
        } else if (resume) {
          st.epoch = next_epoch;
          k = resume->batch;
          plan = resume->plan;
          segment = resume->segment_start;
        } else {
          st.epoch = next_epoch;
        }
        const bool hash_cached = plan && plan == epoch_plan;
        if (!plan) plan = plan_of(st.epoch, segment);
        st.batches = k;
        st.batches_per_epoch = plan->size();
        st.samples_per_epoch = plan->indices.size();
        if (hash_cached && !epoch_plan_hash) epoch_plan_hash = hash_plan(*plan);
        st.plan_hash = hash_cached ? *epoch_plan_hash : hash_plan(*plan);
        if (auto d = distributed()) {
          st.world_size = d->world_size();
          st.rank = d->rank();
          st.segment_start = segment;
          st.position = d->position_after(segment, plan->offsets[k]);
        }
        return st;
      }
    }

    void restore_state(const LoaderState& st) {
      if (engine.epoch_live())
        throw Error("DataLoader::restore(): an iterator of this loader is live; restore before begin() or after the epoch");
      stopped_mid_epoch = false;
      auto differs = [](const char* what, auto saved, auto here) {
        throw Error(std::string("DataLoader::restore(): the state is another loader's: its ") + what + " is " + std::to_string(saved) +
                    ", this loader's is " + std::to_string(here));
      };
      if (kStreaming && st.stream_workers == 0)
        throw Error("DataLoader::restore(): the state is a map-style loader's; this loader reads a stream");
      if (!kStreaming && st.stream_workers != 0) throw Error("DataLoader::restore(): the state is a stream's; this loader is map-style");
      if (st.seed != opt.seed) differs("seed", st.seed, opt.seed);
      if (st.dataset_size != stream_size()) differs("dataset size", st.dataset_size, stream_size());
      if constexpr (kStreaming) {
        if (st.batches > 0) {
          const auto workers = static_cast<std::uint64_t>(std::max(opt.num_workers, 1));
          if (st.stream_workers != workers) differs("number of stream workers (each reads its own shard of the stream)", st.stream_workers, workers);
          if (st.batch_size != opt.batch_size) differs("batch size", st.batch_size, opt.batch_size);
          if (opt.on_error != OnError::Raise)
            throw Error("DataLoader::restore(): a stream resumes mid-epoch under on_error = Raise only");
          resume = Resume{nullptr, st.batches, 0};
        } else {
          resume.reset();
        }
        next_epoch = st.epoch;
      } else {
        const auto d = distributed();
        if (st.world_size && !d)
          throw Error("DataLoader::restore(): the state was saved by a loader with a DistributedSampler (world size " +
                      std::to_string(st.world_size) + "); this loader has none (DataLoaderOptions::sampler)");
        if (!st.world_size && d)
          throw Error("DataLoader::restore(): this loader has a DistributedSampler; the state was saved by a loader without one");
        const bool elastic = d && st.world_size != d->world_size();
        std::size_t segment = static_cast<std::size_t>(st.segment_start);
        std::uint64_t k = st.batches;
        if (elastic) {
          // The group had reached `position` of the epoch's order; the rest is split anew.
          if (st.position > st.dataset_size) differs("position in the epoch", st.position, st.dataset_size);
          segment = static_cast<std::size_t>(st.position);
          k = 0;
        } else if (d && st.rank != d->rank()) {
          differs("rank", st.rank, d->rank());
        } else if (!d && segment != 0) {
          differs("segment start (a DistributedSampler's)", st.segment_start, 0);
        }
        auto plan = plan_of(st.epoch, segment);
        if (!elastic && (plan->size() != st.batches_per_epoch || plan->indices.size() != st.samples_per_epoch ||
                         hash_plan(*plan) != st.plan_hash))
          throw Error("DataLoader::restore(): epoch " + std::to_string(st.epoch) + "'s batches differ from the saved loader's (" +
                      std::to_string(plan->size()) + " batches of " + std::to_string(plan->indices.size()) + " samples here, " +
                      std::to_string(st.batches_per_epoch) + " of " + std::to_string(st.samples_per_epoch) +
                      " saved, or the same counts in another order): another sampler, shuffle, batch_size or drop_last, or a "
                      "sampler that is not a function of the epoch");
        next_epoch = st.epoch;
        if (k == 0 && segment == 0) resume.reset();
        else resume = Resume{std::move(plan), k, segment};
      }
    }

    static std::uint64_t hash_plan(const BatchPlan& p) {
      std::uint64_t h = 1469598103934665603ull;  // FNV-1a's constants, a word at a time, over every index and bound
      auto mix = [&](std::uint64_t v) {
        h = (h ^ v) * 1099511628211ull;
        h ^= h >> 29;
      };
      for (std::size_t i : p.indices) mix(i);
      for (std::size_t o : p.offsets) mix(o);
      return h;
    }

    LoaderStats stats() const {
      LoaderStats s;
      s.wall_seconds = stats_origin_ns ? static_cast<double>(now_ns() - stats_origin_ns) / 1e9 : 0.0;
      s.batches = delivered_batches;
      s.workers = std::max(opt.num_workers, 1);
      s.numa_node = placement ? placement->node : -1;
      auto secs = [&](Stage st) { return static_cast<double>(engine.stage_ns(st) - base.stage_ns[static_cast<std::size_t>(st)]) / 1e9; };
      s.fetch_seconds = secs(Stage::Fetch);
      s.transform_seconds = secs(Stage::Transform);
      s.collate_seconds = secs(Stage::Collate);
      s.pinning = pin_stage != nullptr && !gathering;
      s.device = device_stage != nullptr;
      if (pin_stage && !gathering) s.pin_seconds = static_cast<double>(pin_stage->pin_ns() - base.pin_ns) / 1e9;
      if (device_stage) {
        const DeviceStageStats d = device_stage->stats();
        s.copy_seconds = (d.copy_ms - base.copy_ms) / 1e3;
        s.decode_seconds = (d.decode_ms - base.decode_ms) / 1e3;
        s.decode_threads = d.decode_threads;
        s.images_decoded = d.images_decoded - base.images_decoded;
        s.gather_seconds = (d.gather_ms - base.gather_ms) / 1e3;
        s.rows_gathered = d.rows_gathered - base.rows_gathered;
      }
      s.device_gather = gathering;
      s.wait_seconds = static_cast<double>(wait_ns - base.wait_ns) / 1e9;
      const detail::FaultCounts f = faults.counts();
      s.samples_skipped = f.skipped - base.faults.skipped;
      s.samples_replaced = f.replaced - base.faults.replaced;
      s.data_errors = f.data - base.faults.data;
      s.io_errors = f.io - base.faults.io;
      s.stuck_samples = f.timeout - base.faults.timeout;
      s.io_retries = f.retries - base.faults.retries;
      s.timeouts = engine.timeouts() - base.timeouts;
      s.abandoned_workers = engine.abandoned_workers() - base.abandoned;
      s.first_errors = faults.first_errors();
      return s;
    }

    void reset_stats() {
      for (std::size_t k = 0; k < kStageCount; ++k) base.stage_ns[k] = engine.stage_ns(static_cast<Stage>(k));
      base.pin_ns = pin_stage ? pin_stage->pin_ns() : 0;
      if (device_stage) {
        const DeviceStageStats d = device_stage->stats();
        base.copy_ms = d.copy_ms;
        base.decode_ms = d.decode_ms;
        base.images_decoded = d.images_decoded;
        base.gather_ms = d.gather_ms;
        base.rows_gathered = d.rows_gathered;
      }
      base.wait_ns = wait_ns;
      base.faults = faults.counts();
      base.timeouts = engine.timeouts();
      base.abandoned = engine.abandoned_workers();
      delivered_batches = 0;
      stats_origin_ns = now_ns();
    }

    // The next batch for the consumer, from the last stage there is.
    detail::Payload last_stage_next() {
      if (!pin_stage) return engine.next();
      if (!device_stage) return pin_stage->next();
      if (issue_on_pin_thread) {
        // GPU decode: the pin thread has issued the batch's copies and decode; the consumer's
        // stream waits on them here, at hand-over (Note [Device stage]).
        detail::Payload p = pin_stage->next();
        if (!p) return p;
        DeviceBatch& d = p.template get<DeviceBatch>();
        if (d.copied) device_stage->deliver(*d.copied);
        return detail::Payload::make(std::move(d.batch));
      }
      // Issue the copies of up to device_prefetch batches ahead, so batch i+1 transfers while
      // batch i computes. Failures keep their position in the queue.
      while (device_queue.size() < static_cast<std::size_t>(opt.device_prefetch) && !device_end) {
        DeviceItem item;
        try {
          detail::Payload p = pin_stage->next();
          if (!p) {
            device_end = true;
            break;
          }
          Batch& b = p.template get<Batch>();
          PinContext ctx(*device_stage);
          walk(b, ctx);
          item.copied = ctx.device_copy();
          item.batch = std::move(p);
        } catch (const Interrupted&) {
          if (device_queue.empty()) throw;  // nothing to hand over yet; nothing taken
          break;                            // hand over the batch already issued
        } catch (...) {
          item.error = std::current_exception();
        }
        device_queue.push_back(std::move(item));
      }
      if (device_queue.empty()) return {};
      DeviceItem item = std::move(device_queue.front());
      device_queue.pop_front();
      if (item.error) std::rethrow_exception(item.error);
      if (item.copied) device_stage->deliver(*item.copied);  // order the consumer after this copy only
      return std::move(item.batch);
    }

    // Device gather: the batch of `index` (pinned), made by the GPU: the index's copy, then one
    // gather kernel a field, on the copy stream (Note [Device gather]). Runs on the pin thread.
    auto gather_batch(const Tensor& index) {
      auto aligned = [](std::size_t b) { return (b + 63) / 64 * 64; };
      const std::size_t rows = static_cast<std::size_t>(index.size(0));
      // Up to gather_index_in_launch rows the indices travel in the kernel's launch; a larger
      // batch's go to the device first (from their pinned block).
      const bool in_launch = index.size(0) <= DeviceStage::gather_index_in_launch;
      std::size_t bytes = in_launch ? 0 : aligned(index.nbytes());
      for (const HostRows& f : gather_fields) bytes += aligned(rows * f.row_bytes * (f.transform ? itemsize(f.transform->dtype) : 1));
      device_stage->begin(bytes);
      std::vector<Tensor> fields;
      std::shared_ptr<const EventFence> copied;
      try {
        const Tensor index_dev = in_launch ? index : device_stage->move(index);
        for (std::size_t k = 0; k < gather_fields.size(); ++k) {
          const HostRows& f = gather_fields[k];
          fields.push_back(device_stage->gather_rows(index_dev, registration->device_rows(k), f.row_bytes, f.dtype, f.row_shape,
                                                     f.transform ? &*f.transform : nullptr));
        }
        copied = device_stage->end();
      } catch (...) {
        device_stage->abort();
        throw;
      }
      if constexpr (std::is_same_v<Batch, Tensor>) return DeviceBatch{std::move(fields[0]), std::move(copied)};
      else if constexpr (FieldsBatch<Batch>) return DeviceBatch{Batch::from_fields(std::move(fields)), std::move(copied)};
      else return DeviceBatch{std::move(fields), std::move(copied)};  // std::vector<Tensor> (gather_unavailable)
    }

    void end_epoch() noexcept {
      // An epoch left early (break): state() keeps its position until begin(), set_epoch() or
      // restore(), as it did while the iterator lived.
      stopped_mid_epoch = engine.epoch_live() && !epoch_exhausted;
      last_delivered_ns = 0;
      device_queue.clear();
      if (pin_stage) pin_stage->stop();  // the pin thread, which also calls the engine, is gone after this
      if (stopped_mid_epoch) stopped_key = engine.next_key();
      engine.end_epoch();
    }

    // Visits every tensor of a batch with ctx (pinning it, or moving it to the device).
    void walk(Batch& b, PinContext& ctx) {
      if constexpr (kPinnable) {
        if constexpr (kCollatedFields) pin_collated_fields<Sample>(b, ctx);
        else pin_memory(b, ctx);
      } else {
        (void)b;
        (void)ctx;
      }
    }

    static constexpr bool kCollatedFields = kDefaultCollate && !kDirect && requires { typename CollateFields<Sample>::batch_type; };
    static constexpr bool kPinnable = kCollatedFields || PinMemory<Batch>::supported;

    void setup_pinning() {
      pinned_pool = opt.pinned_pool;
      if (!pinned_pool) {
        if (!cuda::available()) {
          detail::warn_once("pin_memory-no-cuda", "DataLoader: pin_memory=true but CUDA is unavailable (" +
                                                      cuda::unavailable_reason() + "); delivering pageable batches");
          return;
        }
        PinnedPoolOptions po;
        po.limit_bytes = opt.pinned_memory_limit.value_or(DataLoaderOptions::kDefaultPinnedMemoryLimit);
        po.numa_node = placement ? placement->node : -1;
        pinned_pool = std::make_shared<PinnedPool>(po);
      }
      if constexpr (!kPinnable) {
        throw Error("DataLoader: pin_memory=true, but the batch type has no pin_memory: give it a member "
                    "`void pin_memory(ferry::PinContext&)` or specialize ferry::PinMemory");
      } else {
        if (opt.pin_threads > 1) pin_copy_pool = std::make_unique<ParallelFor>(opt.pin_threads, placement);
        const std::size_t behind = static_cast<std::size_t>(opt.pin_depth) +
                                   (opt.device ? static_cast<std::size_t>(opt.device_prefetch) : 0) + 2;
        const std::size_t in_flight =
            static_cast<std::size_t>(opt.prefetch_factor) * static_cast<std::size_t>(std::max(opt.num_workers, 1));
        const bool may_grow = !opt.pinned_pool && !opt.pinned_memory_limit;
        pin_blocks = std::make_unique<detail::DepthCheckedAllocator>(*pinned_pool, behind, "the pin thread", may_grow);
        if (opt.pin_mode == DataLoaderOptions::PinMode::Direct) {
          direct_blocks =
              std::make_unique<detail::DepthCheckedAllocator>(*pinned_pool, behind + in_flight, "direct pin_mode", may_grow);
          allocator = direct_blocks.get();
        } else if (!opt.allocator) {
          PinnedPoolOptions po;  // recycled pageable collate buffers: a cache that never waits
          po.limit_bytes = pinned_pool->limit_bytes();
          po.backend = pageable_backend();
          po.hard_limit = false;
          collate_pool = std::make_shared<PinnedPool>(po);
          allocator = collate_pool.get();
        }
        pin_stage = std::make_unique<detail::PinStage>(engine, [this](detail::Payload& p, std::int64_t batch) {
          const std::int64_t t0 = opt.trace ? now_ns() : 0;
          PinContext ctx(*pin_blocks, pin_copy_pool.get());
          walk(p.template get<Batch>(), ctx);
          if (opt.trace && opt.trace->wants(batch)) {
            char args[96];
            std::snprintf(args, sizeof args, "\"block\":\"%p\",\"bytes\":%zu", ctx.block(), ctx.bytes_copied());
            opt.trace->span(TraceRecorder::kPinTrack, ctx.bytes_copied() ? "pin (copy)" : "pin (already pinned: direct)", batch, t0,
                            now_ns(), args);
          }
          if (device_stage && issue_on_pin_thread) {
            // GPU decode: the copies are issued here and the decode queued to the decoder's
            // threads (nvJPEG's hardware backend holds the thread that calls it for the whole
            // decode: Note [Decode threads]), never on the consumer's thread.
            const std::int64_t t1 = opt.trace ? now_ns() : 0;
            PinContext dctx(*device_stage);
            walk(p.template get<Batch>(), dctx);
            p = detail::Payload::make(DeviceBatch{std::move(p.template get<Batch>()), dctx.device_copy()});
            if (opt.trace && opt.trace->wants(batch))
              opt.trace->span(TraceRecorder::kPinTrack, "issue the copies, queue the GPU decode", batch, t1, now_ns());
          }
        }, opt.pin_depth + (issue_on_pin_thread ? opt.device_prefetch : 0), opt.timeout, opt.trace.get(), placement);
      }
    }

    static std::unique_ptr<ParallelFor> make_intra_pool(const DataLoaderOptions& o, std::shared_ptr<const detail::Placement> placement) {
      if (o.intra_batch_threads <= 1) return nullptr;
      const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
      return std::make_unique<ParallelFor>(std::min(o.intra_batch_threads * std::max(o.num_workers, 1), hw), std::move(placement));
    }

    // Note [NUMA placement]: null unless the loader has a device on a host of several nodes.
    static std::shared_ptr<const detail::Placement> make_placement(const DataLoaderOptions& o) {
      if (!o.device || !o.numa_placement || !cuda::available()) return nullptr;
      auto p = std::make_shared<const detail::Placement>(detail::placement_for_device(*o.device));
      detail::log_debug("DataLoader: NUMA: " + p->reason);
      return p->placed() ? p : nullptr;
    }

    std::shared_ptr<const BatchSampler> make_batch_sampler() {
      if constexpr (kStreaming) {
        return nullptr;
      } else {
        if (opt.batch_sampler) return opt.batch_sampler;
        std::shared_ptr<const Sampler> sampler = opt.sampler;
        if (!sampler) {
          const std::size_t n = dataset->size();
          if (opt.shuffle) sampler = std::make_shared<RandomSampler>(n, opt.seed);
          else sampler = std::make_shared<SequentialSampler>(n);
        }
        return std::make_shared<BatchSampler>(std::move(sampler), opt.batch_size, opt.drop_last);
      }
    }

    void init_worker(const WorkerInfo& worker) override {
      if (opt.worker_init_fn) opt.worker_init_fn(worker);
    }

    detail::Payload produce(const detail::Job& job, detail::JobContext& ctx) override {
      if constexpr (kStreaming) return produce_stream(ctx);
      else return produce_map(job, ctx);
    }

    detail::Payload produce_map(const detail::Job& job, detail::JobContext& ctx) {
      const Dataset& ds = *dataset;
      const std::span<const std::size_t> idx = job.indices;
      if (gathering) {
        ctx.stage.enter(Stage::Collate);
        // Pinned only when the batch is too large for its indices to travel in the gather's launch.
        BatchAllocator& a = idx.size() <= static_cast<std::size_t>(DeviceStage::gather_index_in_launch) ? pageable_allocator() : *allocator;
        const detail::RowFlips flips{gather_flip_p, opt.seed, ctx.worker.epoch};
        return detail::Payload::make(detail::GatherIndex{detail::gather_index(idx, ds.size(), a, flips)});
      }
      if constexpr (PrefetchDataset<Dataset>) ds.prefetch(idx);  // a hint: errors surface per sample
      if constexpr (kDirect) {
        Batch batch = ds.make_batch(idx.size(), *allocator);
        const Rows rows = for_each_sample(job, ctx, true, [&](std::size_t row, std::size_t i, SampleContext& sc) {
          ds.get_into(i, batch, row, sc);
        });
        if (!rows.complete) return {};
        if (rows.kept < idx.size()) detail::truncate_rows(batch, rows.kept);
        return detail::Payload::make(std::move(batch));
      } else {
        std::vector<Sample> samples;
        bool fetched = false;
        if constexpr (BatchFetchDataset<Dataset>) {
          // With on_error = Skip or Replace, a batch whose get_batch failed is fetched again one
          // sample at a time, so that only the damaged sample costs its row.
          try {
            samples = ds.get_batch(idx);
            if (samples.size() != idx.size())
              throw Error("get_batch returned " + std::to_string(samples.size()) + " samples for " +
                          std::to_string(idx.size()) + " indices");
            fetched = true;
          } catch (...) {
            if (opt.on_error == OnError::Raise || ctx.cancelled()) throw;
            samples.clear();
          }
        }
        if (!fetched) {
          std::vector<std::optional<Sample>> slots(idx.size());
          const Rows rows = for_each_sample(job, ctx, false, [&](std::size_t row, std::size_t i, SampleContext& sc) {
            slots[row].emplace(fetch(ds, i, sc));
          });
          if (!rows.complete) return {};
          samples.reserve(rows.kept);
          for (auto& slot : slots)
            if (slot) samples.push_back(std::move(*slot));
        }
        ctx.set_sample(std::nullopt);
        if (ctx.cancelled()) return {};
        ctx.stage.enter(Stage::Collate);
        return detail::Payload::make(collate_samples(std::move(samples), idx));
      }
    }

    struct Rows {
      bool complete = true;  // false: the epoch was cancelled
      std::size_t kept = 0;  // rows delivered (fewer than the batch's samples when some were skipped)
    };

    // Fetches sample i into `row` through fn(row, i, sc), retrying transient I/O errors; returns
    // the error that remains, if any.
    template <class Fn>
    std::exception_ptr attempt(std::size_t row, std::size_t i, detail::JobContext& ctx, StageMeter* meter, Fn& fn) {
      for (int a = 0;; ++a) {
        SampleContext sc(i, opt.seed, ctx.worker.epoch, ctx.worker, meter);
        try {
          fn(row, i, sc);
          return nullptr;
        } catch (...) {
          std::exception_ptr e = std::current_exception();
          if (a >= opt.io_retries || ctx.cancelled() || !detail::is_transient(e)) return e;
          faults.count_retry();
          std::this_thread::sleep_for(opt.io_retry_backoff * (1 << std::min(a, 16)));
        }
      }
    }

    static bool listed_stuck(const detail::Job& job, std::size_t i, std::string* message = nullptr) {
      if (!job.stuck) return false;
      for (const detail::StuckSample& s : *job.stuck)
        if (s.index == i) {
          if (message) *message = s.message;
          return true;
        }
      return false;
    }

    // Row r of the batch under the error policy; returns whether a sample landed in `row`. Raise
    // rethrows; the limit check in faults.report() may throw too.
    template <class Fn>
    bool fetch_row(const detail::Job& job, detail::JobContext& ctx, std::size_t r, std::size_t row, StageMeter* meter,
                   Fn& fn, std::size_t* used) {
      const std::size_t i = job.indices[r];
      if (used) *used = i;
      std::exception_ptr error;
      std::string stuck_message;
      SampleError::Kind kind = SampleError::Kind::Timeout;
      if (listed_stuck(job, i, &stuck_message)) {
      } else if (opt.on_error != OnError::Raise && faults.is_stuck(i)) {
        stuck_message = "got stuck in an earlier fetch (its worker was abandoned); not fetched again by this loader";
      } else {
        error = attempt(row, i, ctx, meter, fn);
        if (!error) return true;
        kind = detail::is_io_error(error) ? SampleError::Kind::Io : SampleError::Kind::Data;
      }
      if (opt.on_error == OnError::Raise) {
        if (!error) throw TimeoutError("sample " + std::to_string(i) + " " + stuck_message);
        std::rethrow_exception(error);
      }
      SampleError report;
      report.epoch = ctx.worker.epoch;
      report.batch = job.batch;
      report.index = i;
      report.worker = ctx.worker.id;
      report.kind = kind;
      report.message = error ? detail::what_of(error) : stuck_message;
      if (opt.on_error == OnError::Replace) {
        const std::span<const std::size_t> all = job.epoch_indices;
        for (unsigned t = 0; t < 16 && !all.empty(); ++t) {
          const std::size_t c = all[replacement_position(opt.seed, ctx.worker.epoch, i, t, all.size())];
          if (c == i || listed_stuck(job, c) || faults.is_stuck(c)) continue;
          if (meter) ctx.set_sample(c);  // a candidate that gets stuck is the one to leave out next time
          const bool failed = attempt(row, c, ctx, meter, fn) != nullptr;
          if (meter) ctx.set_sample(i);
          if (failed) continue;
          report.action = SampleError::Action::Replaced;
          report.replacement = c;
          if (used) *used = c;
          faults.report(report);
          return true;
        }
        throw Error("on_error=Replace: no replacement found for sample " + std::to_string(i) + " (16 candidates failed); it failed with: " +
                    report.message);
      }
      report.action = SampleError::Action::Skipped;
      faults.report(report);
      return false;
    }

    // Calls fn(row, index, ctx) for every sample of the batch under the error policy, in order on
    // this worker, or across the intra-batch pool (rows are independent: each writes only its own
    // row or slot). `compact`: skipped samples leave no hole (the kept rows come first, in order).
    // A failure that fails the batch is rethrown here with ctx.current_sample naming it.
    template <class Fn>
    Rows for_each_sample(const detail::Job& job, detail::JobContext& ctx, bool compact, Fn&& fn) {
      const std::span<const std::size_t> idx = job.indices;
      Rows out;
      ctx.stage.enter(Stage::Fetch);
      if (!pool || idx.size() < 2) {
        for (std::size_t r = 0; r < idx.size(); ++r) {
          if (ctx.cancelled()) return {false, out.kept};
          ctx.set_sample(idx[r]);
          ctx.stage.enter(Stage::Fetch);
          if (fetch_row(job, ctx, r, compact ? out.kept : r, &ctx.stage, fn, nullptr)) ++out.kept;
        }
        ctx.set_sample(std::nullopt);
        out.complete = !ctx.cancelled();
        return check_not_empty(job, out);
      }
      std::atomic<bool> failed{false};
      std::mutex mu;
      std::exception_ptr error;           // guarded by mu
      std::optional<std::size_t> failing;  // guarded by mu
      std::vector<unsigned char> kept(idx.size(), 0);
      std::vector<std::size_t> used(idx.size());
      const std::size_t parts = static_cast<std::size_t>(opt.intra_batch_threads);
      pool->run(idx.size(), [&](std::size_t begin, std::size_t end) {
        for (std::size_t r = begin; r < end; ++r) {
          if (ctx.cancelled() || failed.load(std::memory_order_relaxed)) return;
          // No stage meter: it belongs to the worker thread, which waits here in 'fetch'.
          try {
            kept[r] = fetch_row(job, ctx, r, r, nullptr, fn, &used[r]) ? 1 : 0;
          } catch (...) {
            std::lock_guard lock(mu);
            if (!error) {
              error = std::current_exception();
              failing = idx[r];
            }
            failed = true;
            return;
          }
        }
      }, (idx.size() + parts - 1) / parts);  // intra_batch_threads parts per batch
      if (error) {
        ctx.set_sample(failing);
        std::rethrow_exception(error);
      }
      out.complete = !ctx.cancelled();
      for (std::size_t r = 0; r < idx.size(); ++r) {
        if (!kept[r]) continue;
        if (compact && out.kept != r) {  // close the hole: fetch this row's sample again, one row up
          ctx.set_sample(used[r]);
          if (std::exception_ptr e = attempt(out.kept, used[r], ctx, &ctx.stage, fn)) std::rethrow_exception(e);
        }
        ++out.kept;
      }
      ctx.set_sample(std::nullopt);
      return check_not_empty(job, out);
    }

    static Rows check_not_empty(const detail::Job& job, Rows rows) {
      // Bad data, not a broken loader: a DataError, which a loop (and the tool) catches and goes on
      // from; the batch keeps its position, so resume and batch numbers stay the epoch's.
      if (rows.complete && rows.kept == 0 && !job.indices.empty())
        throw DataError("batch " + std::to_string(job.batch), DataError::kNoOffset,
                        "every sample of the batch failed and was skipped: there is nothing to deliver (see "
                        "stats().first_errors); the next batch follows");
      return rows;
    }

    detail::Payload produce_stream(detail::JobContext& ctx) {
      if constexpr (kStreaming) {
        using Stream = std::decay_t<decltype(std::declval<const Dataset&>().open(std::declval<const WorkerInfo&>()))>;
        struct StreamState {
          Stream stream;
          std::vector<std::size_t> positions;
          std::size_t read = 0;
          std::int64_t batch = 0;
        };
        if (!ctx.stream) {
          ctx.stream = std::make_shared<StreamState>(StreamState{dataset->open(ctx.worker), {}, 0, 0});
          if (const std::uint64_t key = stream_resume_key.load(std::memory_order_relaxed)) {
            // A resumed epoch (restore()): this worker's batches before `key` each used batch_size records.
            auto& fresh = *static_cast<StreamState*>(ctx.stream.get());
            const auto W = static_cast<std::uint64_t>(std::max(opt.num_workers, 1)), w = static_cast<std::uint64_t>(ctx.worker.id);
            const std::uint64_t batches = key > w ? (key - w + W - 1) / W : 0;
            fresh.read = detail::skip_stream(fresh.stream, static_cast<std::size_t>(batches * opt.batch_size));
            fresh.batch = static_cast<std::int64_t>(batches);
          }
        }
        auto& st = *static_cast<StreamState*>(ctx.stream.get());
        std::vector<Sample> samples;
        samples.reserve(opt.batch_size);
        st.positions.clear();
        ctx.stream_indices = st.positions;
        // Skip: a batch spends batch_size records, good or bad (reading on while it has none: an
        // empty batch would read as the end of the stream). Replace: it reads on until full.
        std::size_t reads = 0, failures_in_a_row = 0;
        bool ended = false;
        while (samples.size() < opt.batch_size &&
               (opt.on_error != OnError::Skip || reads < opt.batch_size || samples.empty())) {
          if (ctx.cancelled()) return {};
          std::optional<Sample> s;
          const std::size_t position = st.read;
          try {
            s = st.stream.next();
          } catch (...) {
            st.positions.push_back(position);
            ctx.stream_indices = st.positions;
            if (opt.on_error == OnError::Raise) throw;
            st.positions.pop_back();
            ++st.read;
            ++reads;
            std::exception_ptr e = std::current_exception();
            SampleError report;
            report.epoch = ctx.worker.epoch;
            report.batch = st.batch;
            report.index = position;
            report.stream = true;
            report.worker = ctx.worker.id;
            report.kind = detail::is_io_error(e) ? SampleError::Kind::Io : SampleError::Kind::Data;
            report.action = opt.on_error == OnError::Replace ? SampleError::Action::Replaced : SampleError::Action::Skipped;
            report.message = detail::what_of(e);
            faults.report(report);
            if (++failures_in_a_row >= 1024)
              throw Error("the stream failed 1024 times in a row (the last at position " + std::to_string(position) +
                          "): it cannot get past a bad record; the last error: " + report.message);
            continue;
          }
          failures_in_a_row = 0;
          if (!s) {
            ended = true;
            break;
          }
          ++reads;
          samples.push_back(std::move(*s));
          st.positions.push_back(st.read++);
          ctx.stream_indices = st.positions;
        }
        ++st.batch;
        if (samples.empty() || (opt.drop_last && ended && samples.size() < opt.batch_size)) return {};
        ctx.stage.enter(Stage::Collate);
        return detail::Payload::make(collate_samples(std::move(samples), st.positions));
      } else {
        (void)ctx;
        return {};
      }
    }

    Batch collate_samples(std::vector<Sample>&& samples, std::span<const std::size_t> idx) {
      if constexpr (kDefaultCollate) {
        return collate<Sample>(std::span<const Sample>(samples), idx, *allocator, pool.get());
      } else {
        return collate_fn(std::move(samples));
      }
    }

    std::shared_ptr<const Dataset> dataset;
    DataLoaderOptions opt;
    CollateFn collate_fn;
    std::shared_ptr<const BatchSampler> batch_sampler;
    std::shared_ptr<const detail::Placement> placement;  // Note [NUMA placement]; null: not placed
    std::unique_ptr<ParallelFor> pool;
    BatchAllocator* allocator;
    detail::FaultLog faults;
    std::shared_ptr<PinnedPool> pinned_pool;
    std::shared_ptr<PinnedPool> collate_pool;  // copy mode, or no pinning: recycled pageable batch buffers
    std::unique_ptr<detail::DepthCheckedAllocator> pin_blocks, direct_blocks;
    // Statistics and tracing (consumer thread).
    std::int64_t stats_origin_ns = 0, wait_ns = 0, last_delivered_ns = 0, epoch_delivered = 0;
    std::uint64_t delivered_batches = 0;
    struct {
      std::int64_t stage_ns[kStageCount] = {};
      std::int64_t pin_ns = 0, wait_ns = 0;
      double copy_ms = 0, decode_ms = 0, gather_ms = 0;
      std::uint64_t images_decoded = 0, rows_gathered = 0;
      detail::FaultCounts faults;
      std::uint64_t timeouts = 0, abandoned = 0;
    } base;
    std::unique_ptr<ParallelFor> pin_copy_pool;
    std::uint64_t next_epoch = 0;
    // Resume (state(), restore()); consumer thread.
    struct Resume {
      std::shared_ptr<const BatchPlan> plan;
      std::uint64_t batch = 0;
      std::size_t segment_start = 0;
    };
    std::optional<Resume> resume;                   // set by restore(), taken by the next begin()
    std::shared_ptr<const BatchPlan> epoch_plan;    // the live (or last) epoch's plan
    mutable std::optional<std::uint64_t> epoch_plan_hash;
    std::size_t segment_start = 0;                  // DistributedSampler: see LoaderState
    std::uint64_t live_epoch = 0;                   // the epoch the live iterator runs
    bool epoch_exhausted = false;                   // the live iterator reached the epoch's end
    bool stopped_mid_epoch = false;                 // the last epoch ended early: state() is its position
    std::int64_t stopped_key = 0;                   // streams: the engine's next key when it did
    // Streams: the resumed epoch's first key. Written before the epoch's workers start; atomic
    // because a worker abandoned in an earlier epoch's open() may still read it.
    std::atomic<std::uint64_t> stream_resume_key{0};
    detail::Engine engine;  // built after, and shut down before, everything it calls into
    std::unique_ptr<detail::PinStage> pin_stage;  // the engine's consumer when pinning; stops first
    std::unique_ptr<DeviceStage> device_stage;
    // Device gather: the dataset's fields and their registration (undone after the copy stream
    // has finished, in ~State); the reason when it is not used.
    std::vector<HostRows> gather_fields;
    double gather_flip_p = 0;  // the flip a sample draws for the fields' row transforms (RowTransform::flip_p)
    std::unique_ptr<RowRegistration> registration;
    bool gathering = false;
    std::string gather_reason;
    bool issue_on_pin_thread = false;  // GPU decode: the pin thread issues the device work
    struct DeviceBatch {
      Batch batch;
      std::shared_ptr<const EventFence> copied;  // the batch's copies; the consumer waits at hand-over
    };
    struct DeviceItem {
      detail::Payload batch;
      std::shared_ptr<const EventFence> copied;  // the batch's copy; the consumer waits at hand-over
      std::exception_ptr error;
    };
    std::deque<DeviceItem> device_queue;  // copies issued, not yet delivered (consumer thread)
    bool device_end = false;
  };

  std::shared_ptr<State> state_;  // shared with abandoned workers (Note [Abandoned workers])
};

}  // namespace ferry
