// The compiled part of DataLoader: the options, the engine, the route a batch takes, resume and
// statistics (ferry/detail/loader_core.h). The per-sample error policy is in policy.cpp.
#include "ferry/detail/loader_core.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>

#include "core_parts.h"
#include "thread.h"

namespace ferry::detail {

const char* route_name(Route r) noexcept {
  switch (r) {
    case Route::Workers: return "workers";
    case Route::Pinned: return "pinned";
    case Route::PinnedToDevice: return "pinned, then copied to the device";
    case Route::DeviceIssued: return "device work issued by the pin thread";
  }
  return "?";
}

namespace {

EngineOptions engine_options(const DataLoaderOptions& o, const LoaderTraits& t, std::shared_ptr<const Placement> placement) {
  const bool streaming = t.streaming;
  EngineOptions e;
  e.placement = std::move(placement);
  e.num_workers = o.num_workers;
  e.prefetch_factor = o.prefetch_factor;
  e.in_order = o.in_order;
  e.round_robin = o.round_robin;
  e.persistent_workers = o.persistent_workers;
  e.streaming = streaming;
  e.shared_stream = streaming && t.across_workers;
  e.timeout = o.timeout;
  e.redispatch_stuck = o.on_error != OnError::Raise;
  e.seed = o.seed;
  e.batch_size = o.batch_size;
  e.next_epoch_ahead = o.prefetch_next_epoch;
  e.trace = o.trace.get();
  e.wait_poll.fn = o.wait_poll;
  e.wait_poll.period = std::max(std::chrono::microseconds(o.wait_poll_period), std::chrono::microseconds(1000));
  return e;
}

std::unique_ptr<ParallelFor> make_intra_pool(const DataLoaderOptions& o, std::shared_ptr<const Placement> placement) {
  if (o.intra_batch_threads <= 1) return nullptr;
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return std::make_unique<ParallelFor>(std::min(o.intra_batch_threads * std::max(o.num_workers, 1), hw), std::move(placement));
}

// Note [NUMA placement]: null unless the loader has a device on a host of several nodes.
std::shared_ptr<const Placement> make_placement(const DataLoaderOptions& o) {
  if (!o.device || !o.numa_placement || !cuda::available()) return nullptr;
  auto p = std::make_shared<const Placement>(placement_for_device(*o.device));
  log_debug("DataLoader: NUMA: " + p->reason);
  return p->placed() ? p : nullptr;
}

std::shared_ptr<const BatchSampler> make_batch_sampler(const DataLoaderOptions& o, const LoaderTraits& t) {
  if (t.streaming) return nullptr;
  if (o.batch_sampler) return o.batch_sampler;
  std::shared_ptr<const Sampler> sampler = o.sampler;
  if (!sampler) {
    if (o.shuffle)
      sampler = std::make_shared<RandomSampler>(t.dataset_size, o.seed);
    else
      sampler = std::make_shared<SequentialSampler>(t.dataset_size);
  }
  return std::make_shared<BatchSampler>(std::move(sampler), o.batch_size, o.drop_last, /*lazy=*/true);  // Note [Lazy plans]
}

}  // namespace

LoaderCore::Parts::Parts(DataLoaderOptions o, const LoaderTraits& t, Producer& producer, TypedBatches& typed)
    : traits(t),
      opt(normalize_options(std::move(o), t.streaming)),
      typed(typed),
      batch_sampler(make_batch_sampler(opt, t)),
      placement(make_placement(opt)),
      pool(make_intra_pool(opt, placement)),
      allocator(opt.allocator ? opt.allocator.get() : &pageable_allocator()),
      faults({opt.max_errors, opt.max_error_fraction}, opt.on_sample_error),
      engine(engine_options(opt, t, placement), producer) {}

LoaderCore::Parts::~Parts() {
  stop();
  if (gather) {
    // Gathers still running read the registered arrays: finish them before unregistering.
    try {
      device_stage->copy_stream().synchronize();
    } catch (...) {
    }
    gather.reset();
  }
}

// The pin thread and workers stop before anything they use is destroyed. Idempotent.
void LoaderCore::Parts::stop() noexcept {
  // Joins the thread making the next plan (Parts may outlive the loader: an abandoned worker keeps it).
  epochs.plan_ahead.reset();
  if (hand_over) hand_over->clear();
  if (pin_stage) pin_stage->stop();
  engine.shutdown();
}

LoaderCore::LoaderCore(DataLoaderOptions options, const LoaderTraits& traits, Producer& producer, TypedBatches& typed)
    : p_(std::make_unique<Parts>(std::move(options), traits, producer, typed)) {}

LoaderCore::~LoaderCore() = default;

// --- The route (Note [Device stage], Note [Device gather]) ---

void LoaderCore::build_route(std::vector<HostRows> gather, std::optional<std::string> gather_refused) {
  Parts& s = *p_;
  const DataLoaderOptions& opt = s.opt;
  if (s.traits.gpu_decode && !opt.device)
    throw Error(
        "DataLoader: the dataset decodes its images on the GPU (decode=gpu), which the device stage does: set "
        "DataLoaderOptions::device (--device N in the ferry tool, device= in Python)");
  if (s.traits.gpu_decode && !s.traits.default_collate)
    throw Error("DataLoader: GPU decode needs the default collate; a collate_fn cannot take compressed images");
  if (s.traits.direct && opt.on_error == OnError::Skip && !s.traits.truncatable)
    throw Error(
        "DataLoaderOptions: on_error=Skip needs a batch type that can drop rows (a Tensor, a "
        "std::vector<Tensor>, or a member truncate_rows(std::size_t)); this dataset's direct batch has "
        "none: use OnError::Replace, or add truncate_rows");
  if (opt.trace) opt.trace->name_track(TraceRecorder::kConsumerTrack, "consumer");
  if (opt.device && !cuda::available())  // the options' own rules: normalize_options
    throw CudaError("DataLoader: device=cuda:" + std::to_string(*opt.device) + " needs CUDA, which is unavailable (" +
                    cuda::unavailable_reason() + ")");
  if (gather_refused) s.choose_gather(std::move(gather), std::move(*gather_refused));
  if (s.gathering())
    s.setup_gather();
  else if (opt.pin_memory)
    s.setup_pinning();
  if (opt.trace && s.producers() == 0) opt.trace->name_track(TraceRecorder::kInlineTrack, "batches made inline (no workers)");
  if (!opt.allocator && s.allocator == &pageable_allocator()) {
    // Batches on the host: recycle their buffers too. A fresh buffer over glibc's mmap
    // threshold (32 MiB) is mapped anew, and first-touching its pages cost 3x the collate
    // itself on 38.5 MB batches (one minor fault a 4 KiB page; bench_multi_gpu's host row).
    // The cap on what is kept grows, unset, to every batch the workers and the consumer may hold.
    s.allocator = s.pageable_cache(opt.pinned_memory_limit.value_or(DataLoaderOptions::kDefaultPinnedMemoryLimit),
                                   s.in_flight() + 2, "the workers and the consumer", !opt.pinned_memory_limit);
  }
  if (opt.device && s.pin_stage) {
    DeviceStageOptions d;
    d.device = *opt.device;
    d.pack = opt.device_pack;
    d.consumer_stream = opt.consumer_stream;
    d.high_priority = opt.high_priority_copies;
    d.decode_threads = opt.gpu_decode_threads;
    s.device_stage = std::make_unique<DeviceStage>(d, s.pinned_pool);
  }
  // The route: chosen here, once; the stages it names exist (Note [Device stage]).
  if (!s.pin_stage)
    s.route = Route::Workers;
  else if (!s.device_stage)
    s.route = Route::Pinned;
  else if (s.gathering() || s.traits.gpu_decode)  // the pin thread issues the gathers or the decode
    s.route = Route::DeviceIssued;
  else
    s.route = Route::PinnedToDevice;
  if (s.device_stage)
    s.hand_over = std::make_unique<DeviceHandOver>(*s.pin_stage, *s.device_stage, s.typed, opt.device_prefetch,
                                                   s.engine.wait_poll(), opt.timeout, s.gathering());
  log_debug(describe_options(opt, s.traits.streaming) + "; route: " + route_name(s.route));
}

BatchAllocator* LoaderCore::Parts::pageable_cache(std::size_t limit, std::size_t depth, const char* what, bool may_grow) {
  PinnedPoolOptions po;  // recycled pageable batch buffers: a cache that never waits
  po.limit_bytes = limit;
  po.backend = pageable_backend();
  po.hard_limit = false;
  collate_pool = std::make_shared<PinnedPool>(po);
  cache_blocks = std::make_unique<DepthCheckedAllocator>(*collate_pool, depth, what, may_grow);
  return cache_blocks.get();
}

std::size_t LoaderCore::Parts::in_flight() const noexcept {
  return static_cast<std::size_t>(opt.prefetch_factor) * static_cast<std::size_t>(std::max(opt.num_workers, 1));
}

bool LoaderCore::Parts::make_pinned_pool() {
  pinned_pool = opt.pinned_pool;
  if (pinned_pool) return true;
  if (!gathering() && !cuda::available()) {
    warn_once("pin_memory-no-cuda", "DataLoader: pin_memory=true but CUDA is unavailable (" + cuda::unavailable_reason() +
                                        "); delivering pageable batches");
    return false;
  }
  PinnedPoolOptions po;
  po.limit_bytes = opt.pinned_memory_limit.value_or(DataLoaderOptions::kDefaultPinnedMemoryLimit);
  po.numa_node = placement ? placement->node : -1;
  pinned_pool = std::make_shared<PinnedPool>(po);
  return true;
}

// Device gather (Note [Device gather]): whether it makes this loader's batches; registers the
// dataset's arrays when it does.
void LoaderCore::Parts::choose_gather(std::vector<HostRows> fields, std::string why) {
  if (why.empty()) {
    try {
      gather = std::make_unique<GatherPath>(fields, *opt.device, opt.register_memory_limit);
      return;
    } catch (const Error& e) {
      why = e.what();
    }
  }
  // Rows offered but not gathered (registration refused, no kernel): a surprise worth a warning;
  // a mapped file under Auto is the documented choice, said at debug level only.
  bool mapped = false;
  for (const HostRows& r : fields) mapped = mapped || r.mapped_file;
  const bool offered = !fields.empty() && !(mapped && opt.gather == Gather::Auto);
  if (opt.gather == Gather::Device) throw Error("DataLoader: gather = Device cannot make this loader's batches: " + why);
  if (offered && opt.gather == Gather::Auto)
    warn_once("gather-fallback", "DataLoader: the device gather is not used (" + why +
                                     "); batches take the host path (workers copy rows into pinned blocks)");
  log_debug("DataLoader: host path: " + why);
}

void LoaderCore::Parts::setup_gather() {
  // A batch is its indices here: a worker would only write them, and its hand-over to the pin
  // thread costs more than the writing (bench_gather, (b) with 1 worker: 0.85 of the link on 1.2
  // busy cores, where the pin thread writing them reaches the link on 0.5-0.6; bench/RESULTS.md
  // "Device gather: no workers for batches of indices"). So no worker starts.
  if (opt.num_workers > 0) {
    engine.without_workers();
    if (opt.worker_init_fn)
      warn_once("gather-workers", "DataLoader: the device gather writes each batch's indices on the pin thread; num_workers=" +
                                      std::to_string(opt.num_workers) + " starts no worker, and worker_init_fn is not called");
    log_debug("DataLoader: device gather: num_workers=" + std::to_string(opt.num_workers) +
              " starts no worker (the pin thread writes each batch's indices)");
  }
  pool.reset();  // no samples are made: an intra-batch pool (intra_batch_threads) would sit idle
  make_pinned_pool();
  allocator = pinned_pool.get();  // index blocks of batches too large for the gather's launch
  // The pin thread issues each batch's index copy and gathers, so the consumer's thread only
  // takes finished batches (issuing there left the GPU idle between synchronized steps):
  // Route::DeviceIssued.
  // Small batches ready together go in one launch (PinGroup, DeviceStage::end_held): a
  // launch, its events and its hand-over cost the pin thread about as much as a 0.8 MB batch
  // takes the link (Note [Device gather]).
  // Small batches run deeper: a launch of several and the link kept busy between them need more
  // batches in flight than pin_depth + device_prefetch (4 by default) give, and they cost little
  // device memory. Up to kGatherDepthMax batches (24: 256-row batches of rows below 2^31 then
  // fill one launch of 6,144 narrow indices a group, or two of 3,072 wide ones; 16 made launches
  // of 12 and 4), or kGatherDepthBytes of them.
  const std::size_t batch_bytes = gather->batch_bytes(static_cast<std::size_t>(opt.batch_size));
  const std::size_t by_bytes = kGatherDepthBytes / std::max<std::size_t>(batch_bytes, 1);
  const int depth =
      std::max(opt.pin_depth + opt.device_prefetch, static_cast<int>(std::min<std::size_t>(by_bytes, kGatherDepthMax)));
  pin_stage = std::make_unique<PinStage>(
      engine,
      [this](Payload& p, std::int64_t batch) {
        const std::int64_t t0 = opt.trace ? now_ns() : 0;
        p = gather->batch(*device_stage, typed, p.get<GatherIndex>().index, true);
        if (opt.trace && opt.trace->wants(batch))
          opt.trace->span(TraceRecorder::kPinTrack, "issue the gather", batch, t0, now_ns());
      },
      depth, opt.timeout, opt.trace.get(), placement, PinGroup{depth, [this] { gather->flush(*device_stage); }});
}

void LoaderCore::Parts::setup_pinning() {
  if (!make_pinned_pool()) return;
  if (!traits.pinnable)
    throw Error(
        "DataLoader: pin_memory=true, but the batch type has no pin_memory: give it a member "
        "`void pin_memory(ferry::PinContext&)` or specialize ferry::PinMemory");
  const bool issue_on_pin_thread = traits.gpu_decode;  // Route::DeviceIssued
  if (opt.pin_threads > 1) pin_copy_pool = std::make_unique<ParallelFor>(opt.pin_threads, placement);
  const std::size_t behind =
      static_cast<std::size_t>(opt.pin_depth) + (opt.device ? static_cast<std::size_t>(opt.device_prefetch) : 0) + 2;
  const bool may_grow = !opt.pinned_pool && !opt.pinned_memory_limit;
  pin_blocks = std::make_unique<DepthCheckedAllocator>(*pinned_pool, behind, "the pin thread", may_grow);
  if (opt.pin_mode == DataLoaderOptions::PinMode::Direct) {
    direct_blocks = std::make_unique<DepthCheckedAllocator>(*pinned_pool, behind + in_flight(), "direct pin_mode", may_grow);
    allocator = direct_blocks.get();
  } else if (!opt.allocator) {
    allocator = pageable_cache(pinned_pool->limit_bytes(), in_flight() + 1, "the workers", may_grow);
  }
  pin_stage = std::make_unique<PinStage>(
      engine,
      [this, issue_on_pin_thread](Payload& p, std::int64_t batch) {
        const std::int64_t t0 = opt.trace ? now_ns() : 0;
        PinContext ctx(*pin_blocks, pin_copy_pool.get());
        typed.walk(p, ctx);
        if (opt.trace && opt.trace->wants(batch)) {
          char args[96];
          std::snprintf(args, sizeof args, "\"block\":\"%p\",\"bytes\":%zu", ctx.block(), ctx.bytes_copied());
          opt.trace->span(TraceRecorder::kPinTrack, ctx.bytes_copied() ? "pin (copy)" : "pin (already pinned: direct)", batch, t0,
                          now_ns(), args);
        }
        if (device_stage && issue_on_pin_thread) {
          // GPU decode: the copies are issued here and the decode queued to the decoder's threads
          // (nvJPEG's hardware backend holds the thread that calls it for the whole decode: Note
          // [Decode threads]), never on the consumer's thread.
          const std::int64_t t1 = opt.trace ? now_ns() : 0;
          PinContext dctx(*device_stage);
          typed.walk(p, dctx);
          p = Payload::make(DeviceBatch{std::move(p), dctx.device_copy()});
          if (opt.trace && opt.trace->wants(batch))
            opt.trace->span(TraceRecorder::kPinTrack, "issue the copies, queue the GPU decode", batch, t1, now_ns());
        }
      },
      opt.pin_depth + (issue_on_pin_thread ? opt.device_prefetch : 0), opt.timeout, opt.trace.get(), placement);
}

bool LoaderCore::gathering() const noexcept { return p_->gathering(); }

Payload LoaderCore::gather_index(const Job& job, JobContext& ctx) {
  Parts& s = *p_;
  ctx.stage.enter(Stage::Collate);
  // Pinned only when the batch is too large for its indices to travel in the gather's launch.
  BatchAllocator& a =
      job.indices.size() <= static_cast<std::size_t>(DeviceStage::gather_index_in_launch) ? pageable_allocator() : *s.allocator;
  return Payload::make(GatherIndex{s.gather->index(job.indices, s.traits.dataset_size, a, s.opt.seed, ctx.worker.epoch)});
}

// The next batch for the consumer, from the last stage of the route.
Payload LoaderCore::Parts::last_stage_next() {
  switch (route) {
    case Route::Workers: return engine.next();
    case Route::Pinned: return pin_stage->next();
    // The pin thread has issued the batch's copies and gathers or decode; the consumer's stream
    // waits on them here, at hand-over (Note [Device stage]).
    case Route::DeviceIssued: return hand_over->next_issued(epochs.epoch_delivered - 1);
    case Route::PinnedToDevice: return hand_over->next_copied();
  }
  return {};
}

// --- Epochs (consumer thread) ---

void LoaderCore::begin_epoch() {
  Parts& s = *p_;
  std::shared_ptr<const BatchPlan> plan;
  std::uint64_t start = 0;
  if (!s.traits.streaming) {
    if (s.epochs.resume) {  // restore(): the saved epoch, from the batch after the last one received
      plan = s.epochs.resume->plan;
      start = s.epochs.resume->batch;
      s.epochs.segment_start = s.epochs.resume->segment_start;
      s.epochs.resume.reset();
    } else {
      s.epochs.segment_start = 0;
      // The plan the epoch's first batches were made ahead with (prefetch_next_epoch), if this
      // is that epoch; the engine then takes those batches over.
      plan = s.engine.plan_made_ahead(s.epochs.next_epoch);
      if (!plan && s.epochs.plan_ahead && s.epochs.plan_ahead->epoch == s.epochs.next_epoch)
        plan = s.epochs.plan_ahead->plan.get();  // a sampler's error, here
      s.epochs.plan_ahead.reset();
      if (!plan) plan = std::make_shared<const BatchPlan>(s.batch_sampler->epoch_plan(s.epochs.next_epoch));
    }
    s.epochs.epoch_plan = plan;
    s.epochs.epoch_plan_hash.reset();
  } else {
    if (s.epochs.resume) start = s.epochs.resume->batch;  // each worker's stream skips what its batches before used
    s.epochs.resume.reset();
    const std::lock_guard lock(s.epochs.stream_resume_mu);
    s.epochs.stream_resume = {s.epochs.next_epoch, start};
  }
  s.epochs.epoch_exhausted = false;
  s.epochs.stopped_mid_epoch = false;
  if (!s.stats.origin_ns) s.stats.origin_ns = now_ns();  // before any stage starts work
  s.faults.begin_epoch(s.epochs.next_epoch, plan ? plan->samples() : s.traits.dataset_size);
  s.engine.begin_epoch(s.epochs.next_epoch, std::move(plan), start);
  s.epochs.epoch_delivered = static_cast<std::int64_t>(start);
  s.epochs.live_epoch = s.epochs.next_epoch;
  if (s.opt.prefetch_next_epoch) {
    const std::uint64_t next = s.epochs.next_epoch + 1;
    if (s.traits.streaming) {
      // No plan: a stream that fills batches across workers sends the next epoch's jobs once this
      // one's end is known (the engine does nothing for other streams).
      s.engine.prefetch_next(next, nullptr);
    } else if (!s.batch_sampler->plans_ahead()) {
      // A sampler asked in its epoch's turn (a user's Python sampler: DistributedSampler after
      // set_epoch, a RandomSampler drawing from a generator the loop also draws from): neither its
      // plan nor its batches are made ahead.
    } else if (s.engine.prefetches_next()) {
      s.engine.prefetch_next(next, std::make_shared<const BatchPlan>(s.batch_sampler->epoch_plan(next)));
    } else {
      // A plan takes a few ns an index (bench_plan: a million-index epoch, 2.7-3.5 ms on a
      // 2-core machine), which would otherwise hold up the next epoch's start.
      s.epochs.plan_ahead = EpochBook::PlanAhead{next, std::async(std::launch::async, [sampler = s.batch_sampler, next] {
                                                   name_this_thread("ferry-plan");  // else it shows as the consumer, its maker
                                                   return std::make_shared<const BatchPlan>(sampler->epoch_plan(next));
                                                 })};
    }
  }
  if (s.pin_stage) s.pin_stage->start();
  if (s.hand_over) s.hand_over->clear();
  ++s.epochs.next_epoch;
}

// The next batch for the consumer, timing the wait (stats, trace).
Payload LoaderCore::next() {
  Parts& s = *p_;
  const std::int64_t t0 = now_ns();
  if (!s.stats.origin_ns) s.stats.origin_ns = t0;
  TraceRecorder* trace = s.opt.trace.get();
  const std::int64_t batch = s.epochs.epoch_delivered;
  if (trace && s.stats.last_delivered_ns && trace->wants(batch - 1))
    trace->span(TraceRecorder::kConsumerTrack, "consumer holds batch", batch - 1, s.stats.last_delivered_ns, t0);
  struct Timer {
    Parts& s;
    std::int64_t t0, batch;
    ~Timer() {
      const std::int64_t t1 = now_ns();
      s.stats.wait_ns += t1 - t0;
      s.stats.last_delivered_ns = t1;
      if (s.opt.trace && s.opt.trace->wants(batch)) {
        try {
          s.opt.trace->span(TraceRecorder::kConsumerTrack, "wait for batch", batch, t0, t1);
        } catch (...) {
        }
      }
    }
  } timer{s, t0, batch};
  ++s.epochs.epoch_delivered;  // a failed batch takes its position too
  Payload p;
  try {
    p = s.last_stage_next();
  } catch (const Interrupted&) {
    --s.epochs.epoch_delivered;  // no batch taken: the next call waits for the same one
    throw;
  }
  if (p) {
    ++s.stats.delivered_batches;
  } else {
    s.stats.last_delivered_ns = 0;
    s.epochs.epoch_exhausted = true;
  }
  return p;
}

void LoaderCore::end_epoch() noexcept {
  Parts& s = *p_;
  // An epoch left early (break): state() keeps its position until begin(), set_epoch() or
  // restore(), as it did while the iterator lived.
  s.epochs.stopped_mid_epoch = s.engine.epoch_live() && !s.epochs.epoch_exhausted;
  s.stats.last_delivered_ns = 0;
  if (s.hand_over) s.hand_over->clear();
  if (s.pin_stage) s.pin_stage->stop();  // the pin thread, which also calls the engine, is gone after this
  if (s.epochs.stopped_mid_epoch) s.epochs.stopped_key = s.engine.next_key();
  s.engine.end_epoch();
}

void LoaderCore::stop() noexcept { p_->stop(); }

std::size_t LoaderCore::batches_per_epoch() const {
  const Parts& s = *p_;
  if (!s.traits.streaming) return s.batch_sampler->size();
  const std::size_t n = s.traits.dataset_size, b = s.opt.batch_size;
  return s.opt.drop_last ? n / b : (n + b - 1) / b;
}

std::uint64_t LoaderCore::next_epoch() const noexcept { return p_->epochs.next_epoch; }

void LoaderCore::set_epoch(std::uint64_t epoch) noexcept {
  p_->epochs.next_epoch = epoch;
  p_->epochs.stopped_mid_epoch = false;
}

// --- Accessors ---

const DataLoaderOptions& LoaderCore::options() const noexcept { return p_->opt; }
Route LoaderCore::route() const noexcept { return p_->route; }
BatchAllocator& LoaderCore::allocator() const noexcept { return *p_->allocator; }
ParallelFor* LoaderCore::intra_pool() const noexcept { return p_->pool.get(); }
std::uint64_t LoaderCore::stream_resume_key(std::uint64_t epoch) const noexcept {
  const EpochBook& e = p_->epochs;
  const std::lock_guard lock(e.stream_resume_mu);
  return e.stream_resume.epoch == epoch ? e.stream_resume.key : 0;
}
void LoaderCore::init_worker(const WorkerInfo& worker) {
  if (p_->opt.worker_init_fn) p_->opt.worker_init_fn(worker);
}
void LoaderCore::sample_abandoned(std::size_t sample) { p_->faults.mark_stuck(sample); }
IoCounters* LoaderCore::io_counters() noexcept { return &p_->io; }
bool LoaderCore::pinned() const noexcept { return p_->pin_stage != nullptr; }
const std::shared_ptr<PinnedPool>& LoaderCore::pinned_pool() const noexcept { return p_->pinned_pool; }
const DeviceStage* LoaderCore::device_stage() const noexcept { return p_->device_stage.get(); }
const cuda::Stream* LoaderCore::stream() const noexcept {
  return p_->device_stage ? &p_->device_stage->consumer_stream() : nullptr;
}

}  // namespace ferry::detail
