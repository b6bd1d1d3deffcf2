// Resume (state(), restore(): Note [Resume] in ferry/core/state.h) and statistics, from one
// snapshot of the loader's counters.
#include <algorithm>
#include <string>

#include "core_parts.h"

namespace ferry::detail {

// The DistributedSampler the loader batches (elastic resume), if any.
std::shared_ptr<const DistributedSampler> LoaderCore::Parts::distributed() const {
  if (opt.batch_sampler) return nullptr;
  return std::dynamic_pointer_cast<const DistributedSampler>(opt.sampler);
}

// The plan of `epoch` whose order starts at `segment_start` (DistributedSampler; else 0).
std::shared_ptr<const BatchPlan> LoaderCore::Parts::plan_of(std::uint64_t epoch, std::size_t segment_start) const {
  if (segment_start == 0) return std::make_shared<const BatchPlan>(batch_sampler->epoch_plan(epoch));
  return std::make_shared<const BatchPlan>(
      BatchPlan::lazy(distributed()->order_from(epoch, segment_start), opt.batch_size, opt.drop_last));
}

namespace {
// A plan's hash: FNV-1a's constants, a word at a time, over every index and every batch bound, a
// lazy plan's as a whole one's of the same batches. Past Sampler::kWholeShuffle samples (a lazy
// plan's epoch may be billions), over the count, the bounds' rule and 4,096 samples spread over
// the epoch instead: a resume stays O(1) in the epoch's size (Note [Lazy plans]).
std::uint64_t hash_plan(const BatchPlan& p) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t v) {
    h = (h ^ v) * 1099511628211ull;
    h ^= h >> 29;
  };
  const std::size_t n = p.samples(), batches = p.size();
  if (!p.is_lazy() || n <= Sampler::kWholeShuffle) {
    std::vector<std::size_t> chunk;
    for (std::size_t b = 0; b < batches; ++b) {
      if (!p.is_lazy()) {
        for (std::size_t i : p.batch(b)) mix(i);
        continue;
      }
      p.batch_into(b, chunk);
      for (std::size_t i : chunk) mix(i);
    }
    for (std::size_t b = 0; b <= batches; ++b) mix(p.offset(b));
    return h;
  }
  mix(n);
  mix(batches);
  mix(p.batch_size);
  mix(p.drop_last ? 1 : 0);
  constexpr std::size_t kSpread = 4096;
  for (std::size_t k = 0; k < kSpread; ++k) mix(p.sample_at(n / kSpread * k + n % kSpread * k / kSpread));  // k * n / kSpread
  return h;
}

}  // namespace

LoaderState LoaderCore::save_state() const {
  const Parts& s = *p_;
  LoaderState st;
  st.seed = s.opt.seed;
  st.dataset_size = s.traits.dataset_size;
  const bool live = s.engine.epoch_live();
  if (s.traits.streaming) {
    st.batch_size = s.opt.batch_size;
    st.stream_workers = static_cast<std::uint64_t>(std::max(s.opt.num_workers, 1));
    if ((live && !s.epochs.epoch_exhausted) || s.epochs.stopped_mid_epoch) {
      st.epoch = s.epochs.live_epoch;
      const std::int64_t key = live ? s.engine.next_key() : s.epochs.stopped_key;
      if (key < 0)
        throw Error(
            "DataLoader::state(): a stream delivered out of order (in_order = false) has no position to resume "
            "from mid-epoch; save the state between epochs, or keep in_order");
      if (key > 0 && s.opt.on_error != OnError::Raise)
        throw Error(
            "DataLoader::state(): a stream resumes mid-epoch under on_error = Raise only (Skip and Replace read a "
            "varying number of records per batch); save the state between epochs");
      st.batches = static_cast<std::uint64_t>(key);
    } else {
      st.epoch = live ? s.epochs.live_epoch + 1 : s.epochs.next_epoch;
      if (!live && s.epochs.resume) st.batches = s.epochs.resume->batch;
    }
    return st;
  } else {
    std::shared_ptr<const BatchPlan> plan;
    std::uint64_t k = 0;
    std::size_t segment = 0;
    if ((live || s.epochs.stopped_mid_epoch) && s.epochs.epoch_plan) {
      st.epoch = s.epochs.live_epoch;
      k = std::min<std::uint64_t>(static_cast<std::uint64_t>(s.epochs.epoch_delivered), s.epochs.epoch_plan->size());
      plan = s.epochs.epoch_plan;
      segment = s.epochs.segment_start;
      if (k == plan->size()) {  // every batch received: the next epoch, from its start
        ++st.epoch;
        k = 0;
        plan.reset();
        segment = 0;
      }
    } else if (s.epochs.resume) {
      st.epoch = s.epochs.next_epoch;
      k = s.epochs.resume->batch;
      plan = s.epochs.resume->plan;
      segment = s.epochs.resume->segment_start;
    } else {
      st.epoch = s.epochs.next_epoch;
    }
    const bool hash_cached = plan && plan == s.epochs.epoch_plan;
    if (!plan) plan = s.plan_of(st.epoch, segment);
    st.batches = k;
    st.batches_per_epoch = plan->size();
    st.samples_per_epoch = plan->samples();
    if (hash_cached && !s.epochs.epoch_plan_hash) s.epochs.epoch_plan_hash = hash_plan(*plan);
    st.plan_hash = hash_cached ? *s.epochs.epoch_plan_hash : hash_plan(*plan);
    if (auto d = s.distributed()) {
      st.world_size = d->world_size();
      st.rank = d->rank();
      st.segment_start = segment;
      st.position = d->position_after(segment, plan->offset(k));
    }
    return st;
  }
}

void LoaderCore::restore_state(const LoaderState& st) {
  Parts& s = *p_;
  if (s.engine.epoch_live())
    throw Error("DataLoader::restore(): an iterator of this loader is live; restore before begin() or after the epoch");
  s.epochs.stopped_mid_epoch = false;
  auto differs = [](const char* what, auto saved, auto here) {
    throw Error(std::string("DataLoader::restore(): the state is another loader's: its ") + what + " is " +
                std::to_string(saved) + ", this loader's is " + std::to_string(here));
  };
  if (s.traits.streaming && st.stream_workers == 0)
    throw Error("DataLoader::restore(): the state is a map-style loader's; this loader reads a stream");
  if (!s.traits.streaming && st.stream_workers != 0)
    throw Error("DataLoader::restore(): the state is a stream's; this loader is map-style");
  if (st.seed != s.opt.seed) differs("seed", st.seed, s.opt.seed);
  if (st.dataset_size != s.traits.dataset_size) differs("dataset size", st.dataset_size, s.traits.dataset_size);
  if (s.traits.streaming) {
    if (st.batches > 0) {
      const auto workers = static_cast<std::uint64_t>(std::max(s.opt.num_workers, 1));
      if (st.stream_workers != workers && !s.traits.across_workers)
        differs("number of stream workers (each reads its own shard of the stream)", st.stream_workers, workers);
      if (st.batch_size != s.opt.batch_size) differs("batch size", st.batch_size, s.opt.batch_size);
      if (s.opt.on_error != OnError::Raise)
        throw Error("DataLoader::restore(): a stream resumes mid-epoch under on_error = Raise only");
      s.epochs.resume = EpochBook::Resume{nullptr, st.batches, 0};
    } else {
      s.epochs.resume.reset();
    }
    s.epochs.next_epoch = st.epoch;
  } else {
    const auto d = s.distributed();
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
    } else if (!d && segment != 0) {
      differs("segment start (a DistributedSampler's)", st.segment_start, 0);
    }
    // Another rank's state at the same world size: the ranks step together, so this rank goes on
    // with its own share of the same segment from the same batch (its plan is its own: the hash
    // is the saving rank's, the counts are every rank's).
    const bool other_rank = d && !elastic && st.rank != d->rank();
    auto plan = s.plan_of(st.epoch, segment);
    if (!elastic && (plan->size() != st.batches_per_epoch || plan->samples() != st.samples_per_epoch ||
                     (!other_rank && hash_plan(*plan) != st.plan_hash)))
      throw Error("DataLoader::restore(): epoch " + std::to_string(st.epoch) + "'s batches differ from the saved loader's (" +
                  std::to_string(plan->size()) + " batches of " + std::to_string(plan->samples()) + " samples here, " +
                  std::to_string(st.batches_per_epoch) + " of " + std::to_string(st.samples_per_epoch) +
                  " saved, or the same counts in another order): another sampler, shuffle, batch_size or drop_last, or a "
                  "sampler that is not a function of the epoch");
    s.epochs.next_epoch = st.epoch;
    if (k == 0 && segment == 0)
      s.epochs.resume.reset();
    else
      s.epochs.resume = EpochBook::Resume{std::move(plan), k, segment};
  }
}

LoaderStats LoaderCore::stats() const {
  const Parts& c = *p_;
  LoaderStats s;
  s.wall_seconds = c.stats.origin_ns ? static_cast<double>(now_ns() - c.stats.origin_ns) / 1e9 : 0.0;
  s.batches = c.stats.delivered_batches;
  s.workers = std::max(c.producers(), 1);
  s.numa_node = c.placement ? c.placement->node : -1;
  auto secs = [&](Stage st) {
    return static_cast<double>(c.engine.stage_ns(st) - c.stats.base.stage_ns[static_cast<std::size_t>(st)]) / 1e9;
  };
  s.fetch_seconds = secs(Stage::Fetch);
  s.transform_seconds = secs(Stage::Transform);
  s.collate_seconds = secs(Stage::Collate);
  s.pinning = c.pin_stage != nullptr && !c.gathering();
  s.device = c.device_stage != nullptr;
  if (c.pin_stage && !c.gathering()) s.pin_seconds = static_cast<double>(c.pin_stage->pin_ns() - c.stats.base.pin_ns) / 1e9;
  if (c.device_stage) {
    const DeviceStageStats d = c.device_stage->stats();
    s.copy_seconds = (d.copy_ms - c.stats.base.copy_ms) / 1e3;
    s.decode_seconds = (d.decode_ms - c.stats.base.decode_ms) / 1e3;
    s.decode_threads = d.decode_threads;
    s.images_decoded = d.images_decoded - c.stats.base.images_decoded;
    s.gather_seconds = (d.gather_ms - c.stats.base.gather_ms) / 1e3;
    s.rows_gathered = d.rows_gathered - c.stats.base.rows_gathered;
  }
  s.device_gather = c.gathering();
  s.wait_seconds = static_cast<double>(c.stats.wait_ns - c.stats.base.wait_ns) / 1e9;
  const FaultCounts f = c.faults.counts();
  s.samples_skipped = f.skipped - c.stats.base.faults.skipped;
  s.samples_replaced = f.replaced - c.stats.base.faults.replaced;
  s.data_errors = f.data - c.stats.base.faults.data;
  s.io_errors = f.io - c.stats.base.faults.io;
  s.stuck_samples = f.timeout - c.stats.base.faults.timeout;
  s.io_retries = f.retries - c.stats.base.faults.retries;
  s.timeouts = c.engine.timeouts() - c.stats.base.timeouts;
  s.abandoned_workers = c.engine.abandoned_workers() - c.stats.base.abandoned;
  s.first_errors = c.faults.first_errors();
  const auto now = [](const std::atomic<std::uint64_t>& v) { return v.load(std::memory_order_relaxed); };
  s.store_requests = now(c.io.requests) - c.stats.base.store_requests;
  s.store_bytes = now(c.io.bytes) - c.stats.base.store_bytes;
  s.store_retries = now(c.io.retries) - c.stats.base.store_retries;
  s.store_hedges = now(c.io.hedges) - c.stats.base.store_hedges;
  s.cache_hits = now(c.io.cache_hits) - c.stats.base.cache_hits;
  return s;
}

void LoaderCore::reset_stats() {
  Parts& s = *p_;
  for (std::size_t k = 0; k < kStageCount; ++k) s.stats.base.stage_ns[k] = s.engine.stage_ns(static_cast<Stage>(k));
  s.stats.base.pin_ns = s.pin_stage ? s.pin_stage->pin_ns() : 0;
  if (s.device_stage) {
    const DeviceStageStats d = s.device_stage->stats();
    s.stats.base.copy_ms = d.copy_ms;
    s.stats.base.decode_ms = d.decode_ms;
    s.stats.base.images_decoded = d.images_decoded;
    s.stats.base.gather_ms = d.gather_ms;
    s.stats.base.rows_gathered = d.rows_gathered;
  }
  s.stats.base.wait_ns = s.stats.wait_ns;
  s.stats.base.faults = s.faults.counts();
  s.stats.base.timeouts = s.engine.timeouts();
  s.stats.base.abandoned = s.engine.abandoned_workers();
  s.stats.base.store_requests = s.io.requests.load(std::memory_order_relaxed);
  s.stats.base.store_bytes = s.io.bytes.load(std::memory_order_relaxed);
  s.stats.base.store_retries = s.io.retries.load(std::memory_order_relaxed);
  s.stats.base.store_hedges = s.io.hedges.load(std::memory_order_relaxed);
  s.stats.base.cache_hits = s.io.cache_hits.load(std::memory_order_relaxed);
  s.stats.delivered_batches = 0;
  s.stats.origin_ns = now_ns();
}

}  // namespace ferry::detail
