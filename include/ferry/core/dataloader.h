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
// there TimeoutError ends the stream's epoch, and the next begin() starts afresh. A stage after the
// workers that stalls (the pin thread, a GPU decode's nvJPEG call) fails the batch at hand with
// TimeoutError after twice `timeout`.
//
// Lifetime: one iterator at a time per loader (begin() while one is live throws ferry::Error).
// Destroying the iterator mid-epoch cancels the rest of the epoch; destroying the loader joins its
// threads. Either returns as soon as user code already running in a worker returns, and with a
// timeout, after at most `timeout` past the start of the stuck job (the worker is abandoned). A GPU
// decode inside nvJPEG for over 10 s is left the same way (its memory is never freed).
//
// Thread safety: a DataLoader and its iterator belong to one consumer thread. The dataset's get()
// (and get_batch, get_into, open) and the collate_fn are called from several workers at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/collate/collate.h"
#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/error.h"
#include "ferry/core/faults.h"
#include "ferry/core/options.h"
#include "ferry/core/parallel.h"
#include "ferry/core/sampler.h"
#include "ferry/core/state.h"
#include "ferry/core/stats.h"
#include "ferry/core/trace.h"
#include "ferry/detail/engine.h"
#include "ferry/detail/loader_batch.h"
#include "ferry/detail/loader_core.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/gather.h"
#include "ferry/pinning/pin.h"
#include "ferry/pinning/pool.h"

namespace ferry {

/// The loader. `CollateFn` is DefaultCollate (the rules of ferry/collate/collate.h) or any callable
/// `Batch(std::vector<Sample>&&)`.
///
/// This template holds only what needs the dataset's and the batch's types: fetching samples,
/// collating them, visiting a batch's tensors. The options, the workers, the error policy, the
/// route to the consumer, resume and statistics are compiled once (ferry/detail/loader_core.h).
template <class Dataset, class CollateFn = DefaultCollate>
requires(MapDataset<Dataset> || IterableDataset<Dataset>) class DataLoader {
  static constexpr bool kStreaming = IterableDataset<Dataset> && !MapDataset<Dataset>;
  static constexpr bool kDefaultCollate = std::is_same_v<CollateFn, DefaultCollate>;
  static constexpr bool kDirect = !kStreaming && kDefaultCollate && DirectDataset<Dataset>;
  // A stream that writes its samples into the batch's rows (DirectStreamDataset).
  static constexpr bool kDirectStream = kStreaming && kDefaultCollate && DirectStreamDataset<Dataset>;

 public:
  using Sample = sample_t<Dataset>;
  using Batch = typename detail::LoaderBatch<Dataset, CollateFn, kStreaming, kDirect || kDirectStream, kDefaultCollate>::type;

  /// Throws ferry::Error naming the option when the options contradict each other.
  explicit DataLoader(Dataset dataset, DataLoaderOptions options = {}, CollateFn collate_fn = {})
      : typed_(std::make_shared<Typed>(std::move(dataset), std::move(options), std::move(collate_fn))) {}
  /// Stops the pipeline: joins every worker, or abandons one stuck past `timeout` (which keeps
  /// shared ownership of the loader's state until its call returns, if ever).
  ~DataLoader() {
    if (typed_) typed_->core.stop();
  }
  DataLoader(DataLoader&&) noexcept = default;
  DataLoader& operator=(DataLoader&& o) noexcept {
    if (this != &o) {
      if (typed_) typed_->core.stop();
      typed_ = std::move(o.typed_);
    }
    return *this;
  }

  struct sentinel {};

 private:
  struct Typed;

 public:
  /// Input iterator over one epoch's batches. Move-only.
  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    iterator(iterator&& o) noexcept
        : core_(std::exchange(o.core_, nullptr)), current_(std::move(o.current_)), fetched_(o.fetched_) {}
    iterator& operator=(iterator&& o) noexcept {
      if (this != &o) {
        release();
        core_ = std::exchange(o.core_, nullptr);
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
    bool operator==(sentinel) {
      fill();
      return !current_;
    }

   private:
    friend class DataLoader;
    explicit iterator(detail::LoaderCore* core) : core_(core) {}
    void fill() {
      if (fetched_ || !core_) return;
      detail::Payload p = core_->next();  // may throw: the next call fetches the next batch
      fetched_ = true;
      if (p) current_.emplace(std::move(p.template get<Batch>()));
    }
    void release() noexcept {
      current_.reset();
      if (core_) core_->end_epoch();
      core_ = nullptr;
    }
    detail::LoaderCore* core_ = nullptr;
    std::optional<Batch> current_;
    bool fetched_ = false;
  };

  /// Starts the next epoch. Throws ferry::Error if an iterator of this loader is still live.
  iterator begin() {
    typed_->core.begin_epoch();
    return iterator(&typed_->core);
  }
  sentinel end() const noexcept { return {}; }

  /// Batches per epoch. Streams: only when the dataset has size() (ferry::Error otherwise).
  std::size_t size() const {
    if constexpr (kStreaming && !requires(const Dataset& d) {
                    { d.size() } -> std::convertible_to<std::size_t>;
                  })
      throw Error("DataLoader::size(): the iterable dataset has no size()");
    return typed_->core.batches_per_epoch();
  }
  /// Where the loader stands, to save with a checkpoint (ferry/core/state.h): during an epoch, and
  /// after an epoch left early (its iterator destroyed mid-epoch, as by `break`) until the next
  /// begin(), set_epoch() or restore(), just after the last batch the consumer received
  /// (prefetched batches do not count); between epochs, the start of the epoch the next begin()
  /// runs. Costs one epoch plan between epochs. A stream's mid-epoch state needs in_order and
  /// on_error = Raise (ferry::Error otherwise: its position is not a function of the batch count).
  LoaderState state() const {
    LoaderState s = typed_->core.save_state();
    detail::save_stream_cursor(*typed_->dataset, s);
    return s;
  }
  /// The next begin() continues where `state` stood: its epoch, from the batch after the last one
  /// received, with no consumed sample fetched again. Any num_workers, prefetch, pinning or device.
  /// ferry::Error names what differs when the state is not this loader's (seed, dataset size, the
  /// epoch's batches, rank), and while an iterator is live.
  void restore(const LoaderState& state) {
    typed_->core.restore_state(state);
    detail::restore_stream_cursor(*typed_->dataset, state);
  }
  /// The epoch the next begin() starts (0, 1, 2, ... by default).
  std::uint64_t next_epoch() const noexcept { return typed_->core.next_epoch(); }
  /// Sets the epoch the next begin() starts: resume or replay an epoch exactly.
  void set_epoch(std::uint64_t epoch) noexcept { typed_->core.set_epoch(epoch); }
  const Dataset& dataset() const noexcept { return *typed_->dataset; }
  const DataLoaderOptions& options() const noexcept { return typed_->core.options(); }
  /// Whether batches are written by the dataset's get_into (no collate copy).
  static constexpr bool direct() noexcept { return kDirect; }
  /// Whether batches are delivered in pinned memory (pin_memory and a usable pool).
  bool pinned() const noexcept { return typed_->core.pinned(); }
  /// The pinned pool, or null when not pinning.
  const std::shared_ptr<PinnedPool>& pinned_pool() const noexcept { return typed_->core.pinned_pool(); }
  /// The device stage (its streams and statistics), or null without `device`.
  const DeviceStage* device_stage() const noexcept { return typed_->core.device_stage(); }
  /// Where the loader's time went since the first begin() or reset_stats(): per-stage seconds,
  /// how busy each stage was, and the bottleneck (ferry/core/stats.h).
  LoaderStats stats() const { return typed_->core.stats(); }
  /// Starts the statistics afresh (e.g. after a warm-up epoch).
  void reset_stats() { typed_->core.reset_stats(); }
  /// The stream device batches are ordered on: launch work on it (null without `device`).
  const cuda::Stream* stream() const noexcept { return typed_->core.stream(); }

 private:
  // The typed half: the engine's workers call produce(); the route calls walk() and from_fields().
  // Shared with abandoned workers (Note [Abandoned workers]), which keep it alive.
  struct Typed final : detail::Producer, detail::TypedBatches, std::enable_shared_from_this<Typed> {
    Typed(Dataset d, DataLoaderOptions o, CollateFn c)
        : dataset(std::make_shared<const Dataset>(std::move(d))),
          collate_fn(std::move(c)),
          core(std::move(o), traits(*dataset), *this, *this) {
      std::vector<HostRows> fields;
      std::optional<std::string> refused;
      if constexpr (!kStreaming)
        refused = detail::gather_unavailable<Dataset, Batch>(core.options(), kDefaultCollate, *dataset, fields);
      core.build_route(std::move(fields), std::move(refused));
    }
    ~Typed() override { core.stop(); }  // the workers call into this object: gone before it is

    static detail::LoaderTraits traits(const Dataset& ds) {
      detail::LoaderTraits t;
      t.streaming = kStreaming;
      if constexpr (kStreaming) t.across_workers = detail::fills_across_workers<Dataset>;
      t.direct = kDirect || kDirectStream;
      t.default_collate = kDefaultCollate;
      t.pinnable = kPinnable;
      if constexpr (kDirect || kDirectStream) t.truncatable = detail::kTruncatable<Batch>;
      if constexpr (requires(const Dataset& d) {
                      { d.decodes_on_device() } -> std::convertible_to<bool>;
                    })
        t.gpu_decode = ds.decodes_on_device();
      if constexpr (requires { requires Sample::decoded_on_device; }) t.gpu_decode = true;  // ferry::EncodedImage
      if constexpr (requires(const Dataset& d) {
                      { d.size() } -> std::convertible_to<std::size_t>;
                    })
        t.dataset_size = ds.size();
      return t;
    }

    static constexpr bool kCollatedFields = kDefaultCollate && !kDirect && requires {
      typename CollateFields<Sample>::batch_type;
    };

    // A worker's stream and where it stands (produce_stream; ctx.stream holds it).
    template <class D>
    struct StreamOf {
      using type = std::decay_t<decltype(std::declval<const D&>().open(std::declval<const WorkerInfo&>()))>;
    };
    struct NoStream {
      using type = int;
    };
    struct StreamState {
      typename std::conditional_t<kStreaming, StreamOf<Dataset>, NoStream>::type stream;
      std::vector<std::size_t> positions;
      std::size_t read = 0;
      std::int64_t batch = 0;
    };
    static constexpr bool kPinnable = kCollatedFields || PinMemory<Batch>::supported;

    void walk(detail::Payload& p, PinContext& ctx) override {
      if constexpr (kPinnable) {
        Batch& b = p.template get<Batch>();
        if constexpr (kCollatedFields)
          pin_collated_fields<Sample>(b, ctx);
        else
          pin_memory(b, ctx);
      } else {
        (void)p;
        (void)ctx;
      }
    }

    detail::Payload from_fields(std::vector<Tensor>&& fields) override {
      if constexpr (std::is_same_v<Batch, Tensor>)
        return detail::Payload::make(std::move(fields[0]));
      else if constexpr (FieldsBatch<Batch>)
        return detail::Payload::make(Batch::from_fields(std::move(fields)));
      else if constexpr (std::is_same_v<Batch, std::vector<Tensor>>)
        return detail::Payload::make(std::move(fields));
      else
        throw Error("DataLoader: the device gather cannot make this batch type");  // gather_unavailable refused it
    }

    std::shared_ptr<void> keep_alive() override { return this->shared_from_this(); }
    void sample_abandoned(std::size_t sample) override { core.sample_abandoned(sample); }
    void init_worker(const WorkerInfo& worker) override { core.init_worker(worker); }

    detail::Payload produce(const detail::Job& job, detail::JobContext& ctx) override {
      // Object-store reads count as this loader's, and end at once when it gives up on the job.
      const detail::ScopedIo io(
          core.io_counters(), [](const void* c) noexcept { return static_cast<const detail::JobContext*>(c)->cancelled(); },
          &ctx);
      if constexpr (kStreaming)
        return produce_stream(job, ctx);
      else
        return produce_map(job, ctx);
    }

    detail::Payload produce_map(const detail::Job& job, detail::JobContext& ctx) {
      const Dataset& ds = *dataset;
      const std::span<const std::size_t> idx = job.indices;
      if (core.gathering()) return core.gather_index(job, ctx);  // the device gather makes the batch from its indices
      if constexpr (PrefetchDataset<Dataset>) ds.prefetch(idx);  // a hint: errors surface per sample
      if constexpr (kDirect) {
        Batch batch = ds.make_batch(idx.size(), core.allocator());
        const detail::Rows rows = for_each_sample(
            job, ctx, true, [&](std::size_t row, std::size_t i, SampleContext& sc) { ds.get_into(i, batch, row, sc); });
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
            samples = fetch_batch(ds, idx, ctx.worker);
            if (samples.size() != idx.size())
              throw Error("get_batch returned " + std::to_string(samples.size()) + " samples for " + std::to_string(idx.size()) +
                          " indices");
            fetched = true;
          } catch (...) {
            if (core.options().on_error == OnError::Raise || ctx.cancelled()) throw;
            samples.clear();
          }
        }
        if (!fetched) {
          std::vector<std::optional<Sample>> slots(idx.size());
          const detail::Rows rows = for_each_sample(
              job, ctx, false, [&](std::size_t row, std::size_t i, SampleContext& sc) { slots[row].emplace(fetch(ds, i, sc)); });
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

    // fn(row, index, ctx) for every sample of the batch under the error policy. The common case
    // (on_error = Raise, one thread a batch) runs here, inline; a sample that throws, and every
    // other case, go to the compiled policy (LoaderCore::for_each_sample, retry_sample).
    template <class Fn>
    detail::Rows for_each_sample(const detail::Job& job, detail::JobContext& ctx, bool compact, Fn&& fn) {
      if (!core.simple_policy(job)) return core.for_each_sample(job, ctx, compact, fn);
      const DataLoaderOptions& opt = core.options();
      const std::span<const std::size_t> idx = job.indices;
      ctx.stage.enter(Stage::Fetch);
      for (std::size_t r = 0; r < idx.size(); ++r) {
        if (ctx.cancelled()) return {false, r};
        const std::size_t i = idx[r];
        ctx.set_sample(i);
        ctx.stage.enter(Stage::Fetch);
        SampleContext sc(i, opt.seed, ctx.worker.epoch, ctx.worker, &ctx.stage);
        try {
          fn(r, i, sc);
        } catch (...) {
          core.retry_sample(r, i, ctx, fn);  // transient I/O errors, io_retries times; else rethrows
        }
      }
      ctx.set_sample(std::nullopt);
      return {!ctx.cancelled(), idx.size()};
    }

    // Note [One batcher across workers]: a stream that fills batches across workers makes job b
    // from the epoch's records [bB, (b+1)B), whichever worker takes it; each batch spends its B
    // records (a failed one dropped under Skip and Replace: another would be another batch's).
    static constexpr bool kShared = detail::fills_across_workers<Dataset>;

    detail::Payload produce_stream(const detail::Job& job, detail::JobContext& ctx) {
      if constexpr (kStreaming) {
        const DataLoaderOptions& opt = core.options();
        if (!ctx.stream) {
          ctx.stream = std::make_shared<StreamState>(StreamState{dataset->open(ctx.worker), {}, 0, 0});
          if (const std::uint64_t key = core.stream_resume_key(ctx.worker.epoch)) {
            // A resumed epoch (restore()): the batches before `key` each used batch_size records
            // (shared: the epoch's first `key` batches; else this worker's batches before it).
            auto& fresh = *static_cast<StreamState*>(ctx.stream.get());
            const auto W = static_cast<std::uint64_t>(std::max(opt.num_workers, 1)),
                       w = static_cast<std::uint64_t>(ctx.worker.id);
            const std::uint64_t batches = kShared ? key : key > w ? (key - w + W - 1) / W : 0;
            fresh.read = detail::skip_stream(fresh.stream, static_cast<std::size_t>(batches * opt.batch_size));
            fresh.batch = static_cast<std::int64_t>(batches);
          }
        }
        auto& st = *static_cast<StreamState*>(ctx.stream.get());
        if constexpr (kShared) {
          detail::begin_stream_batch(st.stream, static_cast<std::uint64_t>(job.batch));
          st.batch = job.batch;
          st.read = static_cast<std::size_t>(job.batch) * opt.batch_size;
        }
        // Direct (DirectStreamDataset): the batch is made first and each sample written into its
        // next row; else the samples are kept and collated.
        std::vector<Sample> samples;
        std::optional<Batch> direct;
        if constexpr (kDirectStream)
          direct.emplace(dataset->make_batch(opt.batch_size, core.allocator()));
        else
          samples.reserve(opt.batch_size);
        std::size_t kept = 0;  // rows written, or samples kept
        // The stream's next sample into row `kept` (or kept), false at the stream's end.
        const auto take = [&]() -> bool {
          if constexpr (kDirectStream) {
            return static_cast<bool>(st.stream.next_into(*direct, kept));
          } else {
            std::optional<Sample> s = st.stream.next();
            if (!s) return false;
            samples.push_back(std::move(*s));
            return true;
          }
        };
        st.positions.clear();
        ctx.stream_indices = st.positions;
        // Skip: a batch spends batch_size records, good or bad (reading on while it has none: an
        // empty batch would read as the end of the stream). Replace: it reads on until full.
        // Shared: batch_size records a batch under every policy.
        std::size_t reads = 0, failures_in_a_row = 0;
        bool ended = false;
        while (kept < opt.batch_size &&
               (kShared ? reads < opt.batch_size : opt.on_error != OnError::Skip || reads < opt.batch_size || kept == 0)) {
          if (ctx.cancelled()) return {};
          bool got = false;
          const std::size_t position = st.read;
          try {
            got = take();
          } catch (...) {
            st.positions.push_back(position);  // the failing record names the batch's error
            ctx.stream_indices = st.positions;
            try {
              core.stream_record_failed(ctx, st.batch, position, ++failures_in_a_row);  // rethrows under Raise
            } catch (...) {
              // A stream that fills batches across workers: the failed batch spends its batch_size
              // records, as a good one would, so the batches after it keep their records.
              if constexpr (detail::fills_across_workers<Dataset>)
                for (std::size_t left = opt.batch_size - reads - 1; left > 0; --left, ++st.read) try {
                    if (!take()) break;
                  } catch (...) {
                  }
              throw;
            }
            st.positions.pop_back();
            ctx.stream_indices = st.positions;
            ++st.read;
            ++reads;
            continue;
          }
          failures_in_a_row = 0;
          if (!got) {
            ended = true;
            break;
          }
          ++reads;
          ++kept;
          st.positions.push_back(st.read++);
          ctx.stream_indices = st.positions;
        }
        ++st.batch;
        if (kShared && kept == 0 && !ended) {
          ctx.skipped = true;  // its records all failed under Skip/Replace: left out, not the end
          return {};
        }
        if (kept == 0 || (opt.drop_last && ended && kept < opt.batch_size)) return {};
        if constexpr (kDirectStream) {
          if (kept < opt.batch_size) detail::truncate_rows(*direct, kept);
          return detail::Payload::make(std::move(*direct));
        } else {
          ctx.stage.enter(Stage::Collate);
          return detail::Payload::make(collate_samples(std::move(samples), st.positions));
        }
      } else {
        (void)ctx;
        return {};
      }
    }

    // A stream's reads sent ahead, moved along while the worker waits for its next job.
    bool idle(std::shared_ptr<void>& state) noexcept override {
      if constexpr (kStreaming) {
        try {
          const detail::ScopedIo io(core.io_counters());  // what arrives counts as this loader's
          return detail::progress_stream(static_cast<StreamState*>(state.get())->stream);
        } catch (...) {
          return false;  // the stream's next read meets the error and reports it
        }
      } else {
        (void)state;
        return false;
      }
    }

    Batch collate_samples(std::vector<Sample>&& samples, std::span<const std::size_t> idx) {
      if constexpr (kDefaultCollate)
        return collate<Sample>(std::span<const Sample>(samples), idx, core.allocator(), core.intra_pool());
      else
        return collate_fn(std::move(samples));
    }

    std::shared_ptr<const Dataset> dataset;
    CollateFn collate_fn;
    detail::LoaderCore core;  // built after, and stopped before, what the workers call into
  };

  std::shared_ptr<Typed> typed_;  // shared with abandoned workers (Note [Abandoned workers])
};

}  // namespace ferry
