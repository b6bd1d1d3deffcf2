// ferry/core/dataset.h — what a dataset is, and the datasets ferry composes for you.
//
// A map-style dataset is any type with
//
//   std::size_t size() const;
//   Sample get(std::size_t index, ferry::SampleContext& ctx) const;   // or get(std::size_t) const
//
// and optionally, for speed:
//
//   std::vector<Sample> get_batch(std::span<const std::size_t> indices) const;   // one call a batch
//                         (or get_batch(indices, const ferry::WorkerInfo&), told the worker and the
//                         epoch; when it throws under on_error = Skip or Replace, the batch is fetched
//                         again with get(), one sample at a time, so a bad sample costs itself)
//   Batch make_batch(std::size_t rows, ferry::BatchAllocator&) const;             // "direct" mode:
//   void get_into(std::size_t index, Batch&, std::size_t row, ferry::SampleContext&) const;
//   void prefetch(std::span<const std::size_t> indices) const;   // called by the worker before it
//                         fetches a batch's samples, on the same thread: a dataset over remote
//                         storage requests them all at once (ImageFolder and TarImages over s3://)
//
// With make_batch + get_into the loader skips collate: it allocates the batch once and each sample
// is written straight into its row (a decoder writing pixels into the batch buffer).
//
// An iterable dataset (a stream) instead has
//
//   Stream open(const ferry::WorkerInfo& worker) const;   // Stream::next() -> std::optional<Sample>
//
// and each worker opens its own stream; it uses worker.id and worker.num_workers to read its own
// share (see ferry::shard_range), so nothing is read twice and nothing is dropped. Each worker then
// batches its own samples: batches depend on the worker count and each worker's last batch may be
// short. A stream that fills batches across the workers instead (every batch full but the epoch's
// last, the same batches for any worker count: Note [One batcher across workers]) reads once for
// all of them: ferry::TarShards does, and so does any stream wrapped in ferry::AcrossWorkers
// (dataset.across_workers()).
//
// Workers call get()/get_batch()/get_into()/open() concurrently on one shared dataset, so these
// must be safe to call from several threads (const and free of unsynchronized caches).
//
// Randomness: ctx.rng() is a Generator keyed by (seed, epoch, sample index), so a transform draws
// the same numbers for a sample whichever worker runs it.
//
//   auto ds = ferry::TensorDataset({images, labels})
//                 .map([](std::vector<ferry::Tensor> s, ferry::SampleContext& ctx) {
//                   if (ctx.rng().bernoulli(0.5)) flip(s[0]);
//                   return s;
//                 });
#pragma once

#include <atomic>
#include <concepts>
#include <map>
#include <mutex>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/error.h"
#include "ferry/core/random.h"
#include "ferry/core/rows.h"
#include "ferry/core/state.h"
#include "ferry/core/tensor.h"
#include "ferry/detail/batch_feed.h"

namespace ferry {

/// What the streams that a loader's workers open share: for one epoch (WorkerInfo::share: a
/// stream that fills batches across the workers keeps its one reader there, made by the first
/// worker to open, dropped when the epoch ends) or for the loader's life (WorkerInfo::loader_share:
/// the next epoch's reader, made ahead). Thread-safe.
class StreamShare {
 public:
  /// The object kept under `key` (the dataset's address), made by make() on the first call.
  template <class T, class Make>
  std::shared_ptr<T> get(const void* key, Make&& make) {
    std::lock_guard l(mu_);
    std::shared_ptr<void>& slot = items_[key];
    if (!slot) slot = std::shared_ptr<T>(make());
    return std::static_pointer_cast<T>(slot);
  }
  /// The loader gave up on this share's work (its epoch ended, or the loader went): the threads
  /// its objects run of their own (a tar stream's readers) read cancelled() and stop, their
  /// object-store reads ending within storage.h's bound, though an abandoned worker may still hold
  /// the object.
  void cancel() noexcept { cancelled_->store(true, std::memory_order_relaxed); }
  /// True once cancel() was called; the token outlives the share.
  std::shared_ptr<const std::atomic<bool>> cancelled() const noexcept { return cancelled_; }

 private:
  std::mutex mu_;
  std::map<const void*, std::shared_ptr<void>> items_;
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
};

/// Which worker is running, as torch.utils.data.get_worker_info(). With num_workers == 0 the
/// consumer thread is worker 0 of 1.
struct WorkerInfo {
  int id = 0;
  int num_workers = 1;
  std::uint64_t seed = 0;   ///< the loader's seed
  std::uint64_t epoch = 0;  ///< the epoch being produced (0 outside an epoch, e.g. in worker_init_fn)
  /// The loader starts the next epoch's work ahead (DataLoaderOptions::prefetch_next_epoch): a
  /// stream may send its next epoch's first reads (epoch + 1) as this epoch ends.
  bool next_epoch_ahead = false;
  /// The loader's batch size (0 outside a loader's epoch).
  std::size_t batch_size = 0;
  /// Shared by the streams of this epoch's workers (null outside a loader's epoch).
  StreamShare* share = nullptr;
  /// Shared by the loader's streams for the loader's life (null outside a loader's epoch).
  StreamShare* loader_share = nullptr;
};

/// The share [begin, end) of `n` items that worker `id` of `count` should read: contiguous,
/// disjoint, covering 0..n-1, sizes differing by at most one.
std::pair<std::size_t, std::size_t> shard_range(std::size_t n, int id, int count);

/// The stage a worker is in; named in TimeoutError and WorkerError messages.
enum class Stage : std::uint8_t { Idle, Fetch, Transform, Collate, WorkerInit, Pin, Copy };
inline constexpr std::size_t kStageCount = 7;
const char* stage_name(Stage stage) noexcept;

class TraceRecorder;

/// What one loader thread is doing, and how long it has spent in each stage (loader.stats()).
/// Written by its owning thread only (enter); read from any thread.
class StageMeter {
 public:
  /// Moves to stage `s`, charging the time since the last change to the previous stage; returns it.
  Stage enter(Stage s) noexcept;
  Stage current() const noexcept { return stage_.load(std::memory_order_relaxed); }
  /// Nanoseconds spent in stage `s` so far (closed intervals only).
  std::int64_t total_ns(Stage s) const noexcept { return total_ns_[static_cast<std::size_t>(s)].load(std::memory_order_relaxed); }
  /// Time intervals of batch `batch` go to `trace` (when non-null and it wants that batch).
  void trace(TraceRecorder* trace, std::int64_t batch, int track) noexcept {
    span_since_ns_ = since_ns_;
    trace_ = trace;
    batch_ = batch;
    track_ = track;
  }

 private:
  std::atomic<Stage> stage_{Stage::Idle};
  std::int64_t since_ns_ = 0, span_since_ns_ = 0;
  std::atomic<std::int64_t> total_ns_[kStageCount] = {};
  TraceRecorder* trace_ = nullptr;
  std::int64_t batch_ = -1;
  int track_ = 0;
};

/// Per-sample context handed to get() and to transforms.
class SampleContext {
 public:
  SampleContext(std::size_t index, std::uint64_t seed, std::uint64_t epoch, const WorkerInfo& worker,
                StageMeter* stage = nullptr) noexcept
      : index_(index), seed_(seed), epoch_(epoch), worker_(worker), stage_(stage) {}
  /// The sample's index as the sampler produced it.
  std::size_t index() const noexcept { return index_; }
  std::uint64_t epoch() const noexcept { return epoch_; }
  /// The seed the sample's generator is keyed by (the loader's seed).
  std::uint64_t seed() const noexcept { return seed_; }
  const WorkerInfo& worker() const noexcept { return worker_; }
  /// The sample's generator, keyed by (seed, epoch, index); created on first use.
  Generator& rng() noexcept {
    if (!rng_) rng_.emplace(seed_, epoch_, index_);
    return *rng_;
  }
  /// Marks the stage this thread is in (for error and timeout messages); returns the previous one.
  Stage enter(Stage s) noexcept {
    if (!stage_) return Stage::Idle;
    return stage_->enter(s);
  }

 private:
  std::size_t index_;
  std::uint64_t seed_, epoch_;
  const WorkerInfo& worker_;
  StageMeter* stage_;
  std::optional<Generator> rng_;
};

// --- concepts -----------------------------------------------------------------------------------

template <class D>
concept GetWithContext = requires(const D& d, std::size_t i, SampleContext& c) {
  d.get(i, c);
};
template <class D>
concept GetPlain = requires(const D& d, std::size_t i) {
  d.get(i);
};

/// A dataset indexed by 0..size()-1.
template <class D>
concept MapDataset = requires(const D& d) {
  { d.size() } -> std::convertible_to<std::size_t>;
}
&&(GetWithContext<D> || GetPlain<D>);

/// A dataset that can write a sample into a row of a batch it allocates (direct mode).
template <class D>
concept DirectDataset = MapDataset<D> && requires(const D& d, std::size_t i, BatchAllocator& a, SampleContext& c) {
  d.make_batch(i, a);
  d.get_into(i, std::declval<std::add_lvalue_reference_t<decltype(d.make_batch(i, a))>>(), i, c);
};

/// A dataset with a one-call-per-batch fetch: get_batch(indices), or get_batch(indices, worker).
template <class D>
concept BatchFetchWithWorker = requires(const D& d, std::span<const std::size_t> idx, const WorkerInfo& w) {
  d.get_batch(idx, w);
};
template <class D>
concept BatchFetchDataset = MapDataset<D> &&
    (BatchFetchWithWorker<D> || requires(const D& d, std::span<const std::size_t> idx) { d.get_batch(idx); });

/// A dataset told a batch's indices before their samples are fetched (on the same thread).
template <class D>
concept PrefetchDataset = MapDataset<D> && requires(const D& d, std::span<const std::size_t> idx) {
  d.prefetch(idx);
};

/// A stream dataset: each worker opens its own stream.
template <class D>
concept IterableDataset = requires(const D& d, const WorkerInfo& w) {
  d.open(w);
  {d.open(w).next()};
};

/// A stream that can write its next sample into a row of a batch the dataset allocates (direct
/// mode, as DirectDataset for a map-style dataset): stream.next_into(batch, row) writes the next
/// sample and returns true, or returns false at the stream's end. The loader then makes each batch
/// with make_batch and fills its rows, with no tensor a sample and no collate copy.
template <class D>
concept DirectStreamDataset =
    IterableDataset<D> && !MapDataset<D> && requires(const D& d, const WorkerInfo& w, BatchAllocator& a) {
  d.make_batch(std::size_t{}, a);
  {
    d.open(w).next_into(std::declval<std::add_lvalue_reference_t<decltype(d.make_batch(std::size_t{}, a))>>(), std::size_t{})
    } -> std::convertible_to<bool>;
};

/// Calls d.get(i, ctx) or d.get(i), whichever the dataset has.
template <MapDataset D>
decltype(auto) fetch(const D& d, std::size_t i, SampleContext& ctx) {
  if constexpr (GetWithContext<D>)
    return d.get(i, ctx);
  else
    return d.get(i);
}

/// Calls d.get_batch(idx, worker) or d.get_batch(idx), whichever the dataset has.
template <BatchFetchDataset D>
decltype(auto) fetch_batch(const D& d, std::span<const std::size_t> idx, const WorkerInfo& worker) {
  if constexpr (BatchFetchWithWorker<D>)
    return d.get_batch(idx, worker);
  else
    return d.get_batch(idx);
}

/// The sample type of a dataset.
template <class D>
struct sample_type_of;
template <MapDataset D>
struct sample_type_of<D> {
  using type = std::decay_t<decltype(fetch(std::declval<const D&>(), std::size_t{}, std::declval<SampleContext&>()))>;
};
template <class D>
requires(IterableDataset<D> && !MapDataset<D>) struct sample_type_of<D> {
  using type =
      typename std::decay_t<decltype(std::declval<const D&>().open(std::declval<const WorkerInfo&>()).next())>::value_type;
};
template <class D>
using sample_t = typename sample_type_of<D>::type;

// --- composition --------------------------------------------------------------------------------

template <class D, class F>
class MappedDataset;
template <class D, class F>
class MappedIterable;
template <class D>
class AcrossWorkers;

/// CRTP base that gives a dataset `.map(transform)`. Optional: ferry::map works on any dataset.
template <class Derived>
class DatasetBase {
 public:
  /// A dataset whose samples are transform(sample) or transform(sample, ctx); a stream for an
  /// iterable dataset (MappedIterable), a map-style dataset otherwise (MappedDataset).
  template <class F>
  auto map(F&& transform) const& {
    return make_mapped<F>(static_cast<const Derived&>(*this), std::forward<F>(transform));
  }
  template <class F>
  auto map(F&& transform) && {
    return make_mapped<F>(std::move(static_cast<Derived&>(*this)), std::forward<F>(transform));
  }
  /// A stream that fills batches across the loader's workers (ferry::AcrossWorkers).
  auto across_workers() const& { return AcrossWorkers<Derived>(static_cast<const Derived&>(*this)); }
  auto across_workers() && { return AcrossWorkers<Derived>(std::move(static_cast<Derived&>(*this))); }

 private:
  template <class F, class D>
  static auto make_mapped(D&& d, F&& f) {
    if constexpr (IterableDataset<Derived> && !MapDataset<Derived>)
      return MappedIterable<Derived, std::decay_t<F>>(std::forward<D>(d), std::forward<F>(f));
    else
      return MappedDataset<Derived, std::decay_t<F>>(std::forward<D>(d), std::forward<F>(f));
  }
};

/// base.get(i) followed by a transform; the transform runs in the worker, in Stage::Transform.
template <class D, class F>
class MappedDataset : public DatasetBase<MappedDataset<D, F>> {
 public:
  MappedDataset(D base, F transform) : base_(std::move(base)), transform_(std::move(transform)) {}
  std::size_t size() const { return base_.size(); }
  auto get(std::size_t i, SampleContext& ctx) const {
    auto sample = fetch(base_, i, ctx);
    Stage prev = ctx.enter(Stage::Transform);
    if constexpr (std::is_invocable_v<const F&, decltype(sample)&&, SampleContext&>) {
      auto out = transform_(std::move(sample), ctx);
      ctx.enter(prev);
      return out;
    } else {
      auto out = transform_(std::move(sample));
      ctx.enter(prev);
      return out;
    }
  }
  /// The base's batch prefetch, when it has one.
  void prefetch(std::span<const std::size_t> idx) const requires PrefetchDataset<D> { base_.prefetch(idx); }
  const D& base() const noexcept { return base_; }

 private:
  D base_;
  F transform_;
};

namespace detail {
/// Skips n samples of a stream (a resumed epoch): stream.skip(n) when the stream has one (it
/// returns how many it skipped), else n calls of next(). Returns the number skipped (fewer at the
/// stream's end).
template <class S>
std::size_t skip_stream(S& stream, std::size_t n) {
  if constexpr (requires {
                  { stream.skip(n) } -> std::convertible_to<std::size_t>;
                }) {
    return stream.skip(n);
  } else {
    std::size_t k = 0;
    while (k < n && stream.next()) ++k;
    return k;
  }
}
/// stream.progress() where the stream has one (it moves reads sent ahead along without waiting;
/// true while some are still on their way), else false.
template <class S>
bool progress_stream(S& stream) {
  if constexpr (requires {
                  { stream.progress() } -> std::convertible_to<bool>;
                })
    return stream.progress();
  else
    return false;
}
/// stream.begin_batch(b) where the stream has one: a stream that fills batches across workers is
/// told which batch of the epoch its next records are for (Note [One batcher across workers]).
template <class S>
void begin_stream_batch(S& stream, std::uint64_t batch) {
  if constexpr (requires { stream.begin_batch(batch); }) stream.begin_batch(batch);
}
/// True for a stream dataset that fills batches across a loader's workers (it declares
/// `static constexpr bool kFillsAcrossWorkers = true`): its batches do not depend on the worker
/// count, so it resumes mid-epoch at another.
template <class D>
inline constexpr bool fills_across_workers = [] {
  if constexpr (requires { D::kFillsAcrossWorkers; })
    return static_cast<bool>(D::kFillsAcrossWorkers);
  else
    return false;
}();
/// A stream dataset that keeps a cursor (ferry/core/state.h) writes it into a loader's state
/// (d.save_cursor(state)), and takes it from a restored one (d.restore_cursor(state)); others do
/// nothing.
template <class D>
void save_stream_cursor(const D& d, LoaderState& state) {
  if constexpr (requires { d.save_cursor(state); }) d.save_cursor(state);
}
template <class D>
void restore_stream_cursor(const D& d, const LoaderState& state) {
  if constexpr (requires { d.restore_cursor(state); }) d.restore_cursor(state);
}
/// The epoch-wide position of the sample stream.next() last returned, where the stream fills
/// batches across workers (stream.position() engaged), else nullopt.
template <class S>
std::optional<std::uint64_t> stream_position(const S& stream) {
  if constexpr (requires {
                  { stream.position() } -> std::convertible_to<std::optional<std::uint64_t>>;
                })
    return stream.position();
  else
    return std::nullopt;
}
}  // namespace detail

/// An iterable dataset whose samples are transform(sample) or transform(sample, ctx), run in the
/// worker that reads the stream. ctx.index() is the sample's position in the epoch where the stream
/// fills batches across workers (TarShards, AcrossWorkers), so ctx.rng() is the same for any worker
/// count; otherwise its position in this worker's stream (offset by worker id << 40), reproducible
/// for a given seed, epoch and worker count.
template <class D, class F>
class MappedIterable : public DatasetBase<MappedIterable<D, F>> {
 public:
  static constexpr bool kFillsAcrossWorkers = detail::fills_across_workers<D>;
  MappedIterable(D base, F transform) : base_(std::move(base)), transform_(std::move(transform)) {}
  class Stream {
   public:
    Stream(const MappedIterable& owner, const WorkerInfo& worker)
        : owner_(&owner), worker_(worker), inner_(owner.base_.open(worker)) {}
    auto next() {
      auto sample = inner_.next();
      using In = std::decay_t<decltype(*sample)>;
      using Out = std::decay_t<decltype(apply(std::declval<In&&>()))>;
      if (!sample) return std::optional<Out>();
      return std::optional<Out>(apply(std::move(*sample)));
    }
    /// Skips n samples of the inner stream without transforming them (a resumed epoch).
    std::size_t skip(std::size_t n) {
      const std::size_t k = detail::skip_stream(inner_, n);
      position_ += k;  // later samples keep their generators
      return k;
    }
    /// The inner stream's progress() (reads sent ahead moved along between batches), if it has one.
    bool progress() { return detail::progress_stream(inner_); }
    /// The inner stream's begin_batch(b), if it has one.
    void begin_batch(std::uint64_t batch) { detail::begin_stream_batch(inner_, batch); }
    /// The inner stream's position() (the last sample's place in the epoch), if it has one.
    std::optional<std::uint64_t> position() const { return detail::stream_position(inner_); }

   private:
    template <class S>
    auto apply(S&& s) {
      if constexpr (std::is_invocable_v<const F&, S&&, SampleContext&>) {
        const std::optional<std::uint64_t> at = detail::stream_position(inner_);
        const std::size_t local = (static_cast<std::size_t>(worker_.id) << 40) + position_++;
        SampleContext ctx(at ? static_cast<std::size_t>(*at) : local, worker_.seed, worker_.epoch, worker_);
        return owner_->transform_(std::forward<S>(s), ctx);
      } else {
        return owner_->transform_(std::forward<S>(s));
      }
    }
    const MappedIterable* owner_;
    WorkerInfo worker_;
    decltype(std::declval<const D&>().open(std::declval<const WorkerInfo&>())) inner_;
    std::size_t position_ = 0;
  };
  Stream open(const WorkerInfo& worker) const { return Stream(*this, worker); }
  const D& base() const noexcept { return base_; }

 private:
  D base_;
  F transform_;
};

/// A stream that fills batches across the loader's workers (Note [One batcher across workers] in
/// ferry/detail/batch_feed.h): the base stream is opened once an epoch, as worker 0 of 1, and read
/// on a thread of its own; its sample p goes to batch p / batch_size, which the loader delivers in
/// order. So every batch is full but the epoch's last, the batches are the same for any number of
/// workers, and a transform mapped after it (.map) runs in the workers, its ctx.rng() keyed by p.
/// The base's reads run one at a time, ahead of the workers by up to 2 * batch_size samples:
/// worth it when what the workers do with a sample (decode, transform) costs more than reading it.
///
///   auto ds = MyStream(...).across_workers().map(decode);
///   ferry::DataLoader loader(ds, {.batch_size = 256, .num_workers = 8, .drop_last = true});
///
/// Opened outside a loader (no WorkerInfo::share), it is the base stream of that worker.
template <class D>
class AcrossWorkers : public DatasetBase<AcrossWorkers<D>> {
  using BaseStream = decltype(std::declval<const D&>().open(std::declval<const WorkerInfo&>()));
  using Sample = typename std::decay_t<decltype(std::declval<BaseStream&>().next())>::value_type;

 public:
  static constexpr bool kFillsAcrossWorkers = true;
  explicit AcrossWorkers(D base) : base_(std::make_shared<const D>(std::move(base))) {}
  class Stream {
   public:
    std::optional<Sample> next() {
      if (!feed_) return own_->next();
      std::shared_ptr<void> box = feed_->next(batch_, position_);
      if (!box) return std::nullopt;
      return std::optional<Sample>(std::move(*static_cast<Sample*>(box.get())));
    }
    /// Skips the epoch's first n samples (whole batches: a resumed epoch).
    std::size_t skip(std::size_t n) {
      if (!feed_) return detail::skip_stream(*own_, n);
      feed_->skip(n);
      return n;
    }
    /// In a loader: the batch of the epoch the next samples are for.
    void begin_batch(std::uint64_t batch) { batch_ = batch; }
    std::optional<std::uint64_t> position() const {
      if (!feed_) return std::nullopt;
      return position_;
    }

   private:
    friend class AcrossWorkers;
    std::shared_ptr<detail::BatchFeed> feed_;
    std::optional<BaseStream> own_;
    std::uint64_t batch_ = 0;
    std::uint64_t position_ = 0;
  };
  Stream open(const WorkerInfo& worker) const {
    Stream s;
    if (!worker.share || worker.batch_size == 0) {
      s.own_.emplace(base_->open(worker));
      return s;
    }
    WorkerInfo one = worker;
    one.id = 0;
    one.num_workers = 1;
    one.share = nullptr;
    s.feed_ = worker.share->get<detail::BatchFeed>(this, [&] {
      detail::BatchFeed::Shape shape;
      shape.units = 1;
      shape.lanes = 1;
      shape.lane_records = 2 * worker.batch_size;
      shape.batch_size = worker.batch_size;
      // The reader keeps the base alive: a worker abandoned after a timeout may outlive the loader.
      return std::make_unique<detail::BatchFeed>(shape, [base = base_, one](std::size_t, detail::BatchFeed::Sink& sink) {
        BaseStream stream = base->open(one);
        sink.on_wait = [&stream] { return detail::progress_stream(stream); };
        for (;;) {
          std::optional<Sample> x;
          std::exception_ptr failed;
          try {
            x = stream.next();
          } catch (...) {
            failed = std::current_exception();
          }
          if (failed) {  // handed over outside the handler: the worker that takes it holds its only reference
            if (!sink.fail(std::move(failed))) return;
            continue;
          }
          if (!x) return;
          if (!sink.push(std::make_shared<Sample>(std::move(*x)))) return;
        }
      });
    });
    return s;
  }
  const D& base() const noexcept { return *base_; }

 private:
  std::shared_ptr<const D> base_;
};

/// ferry::map(dataset, transform) for datasets without DatasetBase.
template <MapDataset D, class F>
MappedDataset<std::decay_t<D>, std::decay_t<F>> map(D&& dataset, F&& transform) {
  return {std::forward<D>(dataset), std::forward<F>(transform)};
}

/// Row i of each tensor: TensorDataset({x, y}).get(i) == {x[i], y[i]}. All tensors must have the
/// same first dimension (ferry::Error names the mismatch). Supports direct mode.
class TensorDataset : public DatasetBase<TensorDataset> {
 public:
  explicit TensorDataset(std::vector<Tensor> tensors);
  std::size_t size() const noexcept { return size_; }
  std::vector<Tensor> get(std::size_t i) const;
  std::vector<Tensor> make_batch(std::size_t rows, BatchAllocator& allocator) const;
  void get_into(std::size_t i, std::vector<Tensor>& batch, std::size_t row, SampleContext&) const;
  const std::vector<Tensor>& tensors() const noexcept { return tensors_; }
  /// Its tensors as rows for the device gather (Note [Device gather], ferry/pinning/gather.h).
  std::vector<HostRows> host_rows(std::string& why) const;

 private:
  std::vector<Tensor> tensors_;
  std::size_t size_ = 0;
};

/// The samples of `base` at `indices`, in that order. Indices are checked against base.size().
template <MapDataset D>
class Subset : public DatasetBase<Subset<D>> {
 public:
  Subset(D base, std::vector<std::size_t> indices) : base_(std::move(base)), indices_(std::move(indices)) {
    const std::size_t n = base_.size();
    for (std::size_t k = 0; k < indices_.size(); ++k)
      if (indices_[k] >= n)
        throw Error("Subset: index " + std::to_string(indices_[k]) + " at position " + std::to_string(k) +
                    " is out of range for a dataset of size " + std::to_string(n));
  }
  std::size_t size() const noexcept { return indices_.size(); }
  auto get(std::size_t i, SampleContext& ctx) const { return fetch(base_, indices_.at(i), ctx); }
  const std::vector<std::size_t>& indices() const noexcept { return indices_; }

 private:
  D base_;
  std::vector<std::size_t> indices_;
};

/// Several datasets of one type end to end. Use AnyDataset<Sample> to join different types.
template <MapDataset D>
class ConcatDataset : public DatasetBase<ConcatDataset<D>> {
 public:
  explicit ConcatDataset(std::vector<D> parts) : parts_(std::move(parts)) {
    std::size_t total = 0;
    for (const D& p : parts_) {
      total += p.size();
      ends_.push_back(total);
    }
  }
  std::size_t size() const noexcept { return ends_.empty() ? 0 : ends_.back(); }
  auto get(std::size_t i, SampleContext& ctx) const {
    std::size_t part = 0;
    while (part < ends_.size() && i >= ends_[part]) ++part;
    if (part == ends_.size())
      throw Error("ConcatDataset: index " + std::to_string(i) + " is out of range for size " + std::to_string(size()));
    return fetch(parts_[part], i - (part ? ends_[part - 1] : 0), ctx);
  }

 private:
  std::vector<D> parts_;
  std::vector<std::size_t> ends_;
};

/// A type-erased map-style dataset of `Sample`s (shares the wrapped dataset).
template <class Sample>
class AnyDataset : public DatasetBase<AnyDataset<Sample>> {
 public:
  template <MapDataset D>
  requires(!std::same_as<std::decay_t<D>, AnyDataset>) AnyDataset(D dataset)
      : impl_(std::make_shared<Impl<D>>(std::move(dataset))) {}  // NOLINT: implicit by design
  std::size_t size() const { return impl_->size(); }
  Sample get(std::size_t i, SampleContext& ctx) const { return impl_->get(i, ctx); }
  /// The wrapped dataset's rows for the device gather, if it has them (RowGatherDataset); else
  /// none, and `why` says so.
  std::vector<HostRows> host_rows(std::string& why) const { return impl_->host_rows(why); }
  /// The wrapped dataset's batch prefetch (PrefetchDataset), or nothing.
  void prefetch(std::span<const std::size_t> idx) const { impl_->prefetch(idx); }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual std::size_t size() const = 0;
    virtual Sample get(std::size_t i, SampleContext& ctx) const = 0;
    virtual std::vector<HostRows> host_rows(std::string& why) const = 0;
    virtual void prefetch(std::span<const std::size_t> idx) const = 0;
  };
  template <class D>
  struct Impl final : Concept {
    explicit Impl(D d) : d(std::move(d)) {}
    std::size_t size() const override { return d.size(); }
    Sample get(std::size_t i, SampleContext& ctx) const override { return fetch(d, i, ctx); }
    std::vector<HostRows> host_rows(std::string& why) const override {
      if constexpr (RowGatherDataset<D>) {
        return d.host_rows(why);
      } else {
        why = "the dataset's samples are not rows of host arrays";
        return {};
      }
    }
    void prefetch(std::span<const std::size_t> idx) const override {
      if constexpr (PrefetchDataset<D>) d.prefetch(idx);
    }
    D d;
  };
  std::shared_ptr<const Concept> impl_;
};

/// Splits 0..n-1 into disjoint random index sets of the given lengths (which must sum to n), or
/// fractions (which must sum to 1; remainders go round-robin from the first split), as
/// torch.utils.data.random_split. Deterministic in `seed`.
std::vector<std::vector<std::size_t>> random_split_indices(std::size_t n, std::span<const double> lengths, std::uint64_t seed);

/// random_split over a dataset: one Subset per entry of `lengths`.
template <MapDataset D>
std::vector<Subset<D>> random_split(const D& dataset, std::span<const double> lengths, std::uint64_t seed) {
  std::vector<Subset<D>> out;
  for (auto& idx : random_split_indices(dataset.size(), lengths, seed)) out.emplace_back(dataset, std::move(idx));
  return out;
}
template <MapDataset D>
std::vector<Subset<D>> random_split(const D& dataset, std::initializer_list<double> lengths, std::uint64_t seed) {
  return random_split(dataset, std::span<const double>(lengths.begin(), lengths.size()), seed);
}

}  // namespace ferry
