// ferry/core/sampler.h — which samples an epoch visits, in which order, grouped into batches.
//
// A Sampler yields the sample indices of one epoch; a BatchSampler groups them into batches and
// returns the whole epoch as a BatchPlan. Both are pure functions of their construction arguments
// and the epoch number, never of thread timing, so an epoch can be replayed or resumed exactly:
//
//   auto sampler = std::make_shared<ferry::RandomSampler>(dataset_size, /*seed=*/42);
//   ferry::BatchSampler batches(sampler, /*batch_size=*/64, /*drop_last=*/false);
//   ferry::BatchPlan plan = batches.plan(/*epoch=*/3);
//   for (std::size_t b = 0; b < plan.size(); ++b) use(plan.batch(b));   // std::span<const size_t>
//
// The DataLoader builds these from its options (shuffle, batch_size, drop_last, seed) or takes
// yours (DataLoaderOptions::sampler, ::batch_sampler). To write your own, derive from Sampler, or
// from BatchSampler for variable-sized batches (bucketing), and override the virtual functions.
//
// Note [Lazy plans]
// An epoch of a pretraining corpus is billions of samples: a plan of every index, 8 bytes each,
// would take the first batch seconds and the memory gigabytes (15 T tokens at seq 8192: ~15 GB a
// rank). So the built-in samplers also give their epoch as a SampleOrder (Sampler::order): the
// p-th index of the epoch is a pure function of (arguments, epoch, p), read when asked. The loader
// batches such an order lazily (BatchSampler::epoch_plan, BatchPlan::lazy): each batch's indices
// are computed as the batch is dispatched, and nothing is proportional to the epoch. A shuffle of
// up to kWholeShuffle samples is Fisher-Yates over the whole epoch, made when the order is (a few
// ms, at most 8 MiB); a longer one is a keyed permutation read a position at a time
// (IndexPermutation: a Feistel network with cycle walking, 30-130 ns a position on a 2-core
// machine), so its first batch costs the same at any size. A user's Sampler without order() and
// a user's BatchSampler are planned whole, as before.
//
// Thread safety: the const members may be called from several threads at once.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace ferry {

/// A seeded random permutation of [0, n), evaluated one position at a time in O(1) expected
/// time and no memory (a Feistel network of four rounds with cycle walking): at(i) for i in [0, n).
class IndexPermutation {
 public:
  IndexPermutation(std::uint64_t n, std::uint64_t key) noexcept;
  std::uint64_t at(std::uint64_t i) const noexcept;
  std::uint64_t size() const noexcept { return n_; }

 private:
  std::uint64_t round(std::uint64_t half, int r) const noexcept;
  std::uint64_t n_, key_;
  int half_bits_ = 1;
};

/// One epoch's sample indices read a position at a time (Note [Lazy plans]): at(p), p < size(),
/// is the p-th index the epoch visits. Thread safety: const members from any thread.
class SampleOrder {
 public:
  virtual ~SampleOrder() = default;
  virtual std::size_t size() const noexcept = 0;
  virtual std::size_t at(std::size_t position) const = 0;
  /// Positions [begin, begin + out.size()) into `out` (at() for each, unless overridden).
  virtual void fill(std::size_t begin, std::span<std::size_t> out) const;
};

/// Produces the sample indices of one epoch.
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// Number of indices per epoch.
  virtual std::size_t size() const = 0;
  /// The indices of epoch `epoch`, in visiting order.
  virtual std::vector<std::size_t> indices(std::uint64_t epoch) const = 0;
  /// The same indices as a SampleOrder read a position at a time, or null (the default): this
  /// sampler's epochs are only whole. The built-in samplers but SubsetRandomSampler and
  /// WeightedRandomSampler give one.
  virtual std::shared_ptr<const SampleOrder> order(std::uint64_t epoch) const;
  /// Shuffles of at most this many samples are Fisher-Yates over the whole epoch; longer ones a
  /// keyed permutation read a position at a time (IndexPermutation). Note [Lazy plans].
  static constexpr std::size_t kWholeShuffle = std::size_t{1} << 20;
};

/// 0, 1, ..., n-1.
class SequentialSampler final : public Sampler {
 public:
  explicit SequentialSampler(std::size_t n) : n_(n) {}
  std::size_t size() const override { return n_; }
  std::vector<std::size_t> indices(std::uint64_t epoch) const override;
  std::shared_ptr<const SampleOrder> order(std::uint64_t epoch) const override;

 private:
  std::size_t n_;
};

/// A seeded random order of 0..n-1: a permutation, or `num_samples` draws with replacement.
class RandomSampler final : public Sampler {
 public:
  /// `num_samples` defaults to n; without replacement it may not exceed n (ferry::Error).
  RandomSampler(std::size_t n, std::uint64_t seed, bool replacement = false,
                std::optional<std::size_t> num_samples = std::nullopt);
  std::size_t size() const override { return num_samples_; }
  std::vector<std::size_t> indices(std::uint64_t epoch) const override;
  /// Without replacement: Fisher-Yates of the epoch for n <= kWholeShuffle, else a keyed
  /// permutation; with replacement: the same draws as indices() up to kWholeShuffle samples, else
  /// a draw a position (Generator(seed, epoch, position)).
  std::shared_ptr<const SampleOrder> order(std::uint64_t epoch) const override;

 private:
  std::size_t n_;
  std::uint64_t seed_;
  bool replacement_;
  std::size_t num_samples_;
};

/// A seeded random permutation of the given indices.
class SubsetRandomSampler final : public Sampler {
 public:
  SubsetRandomSampler(std::vector<std::size_t> subset, std::uint64_t seed);
  std::size_t size() const override { return subset_.size(); }
  std::vector<std::size_t> indices(std::uint64_t epoch) const override;

 private:
  std::vector<std::size_t> subset_;
  std::uint64_t seed_;
};

/// `num_samples` indices drawn with probability proportional to `weights`.
/// Weights must be finite and non-negative with a positive sum (ferry::Error names the bad one);
/// without replacement, `num_samples` may not exceed the number of positive weights.
class WeightedRandomSampler final : public Sampler {
 public:
  WeightedRandomSampler(std::vector<double> weights, std::size_t num_samples, std::uint64_t seed, bool replacement = true);
  std::size_t size() const override { return num_samples_; }
  std::vector<std::size_t> indices(std::uint64_t epoch) const override;

 private:
  std::vector<double> weights_;
  std::vector<double> cumulative_;
  std::size_t num_samples_;
  std::uint64_t seed_;
  bool replacement_;
};

/// One rank's share of 0..n-1 for data-parallel training, as torch's DistributedSampler: every
/// rank gets the same count, by padding with indices from the start (or, with drop_last, by
/// dropping the tail); with shuffle, all ranks agree on one seeded permutation per epoch.
class DistributedSampler final : public Sampler {
 public:
  DistributedSampler(std::size_t n, std::size_t world_size, std::size_t rank, bool shuffle = true, std::uint64_t seed = 0,
                     bool drop_last = false);
  std::size_t size() const override { return per_rank_; }
  /// The DataLoader passes its own epoch; set_epoch() pins one instead (as in PyTorch).
  std::vector<std::size_t> indices(std::uint64_t epoch) const override;
  std::shared_ptr<const SampleOrder> order(std::uint64_t epoch) const override;
  void set_epoch(std::uint64_t epoch) { pinned_epoch_ = epoch; }

  /// Elastic resume (ferry/core/state.h): this rank's indices when the epoch's order (the seeded
  /// permutation of 0..n-1, unpadded) is taken from position `start` on, the positions before it
  /// having been delivered by the whole group, at any world size. That remainder is split as
  /// PyTorch splits a whole epoch: rank r takes every world_size-th index from r, the remainder
  /// padded with its own first indices so every rank gets as many (drop_last: its tail dropped
  /// instead). So each remaining index is delivered once, plus at most world_size - 1 padding
  /// repeats, as in any PyTorch epoch. indices_from(epoch, 0) == indices(epoch).
  std::vector<std::size_t> indices_from(std::uint64_t epoch, std::size_t start) const;
  /// indices_from(epoch, start) as a SampleOrder.
  std::shared_ptr<const SampleOrder> order_from(std::uint64_t epoch, std::size_t start) const;
  /// The position in the epoch's order that the group has reached when every rank has taken
  /// `taken` indices of indices_from(epoch, start) (padding repeats do not count).
  std::size_t position_after(std::size_t start, std::size_t taken) const;
  std::size_t world_size() const noexcept { return world_; }
  std::size_t rank() const noexcept { return rank_; }

 private:
  std::size_t n_, world_, rank_;
  bool shuffle_;
  std::uint64_t seed_;
  bool drop_last_;
  std::size_t per_rank_;
  std::optional<std::uint64_t> pinned_epoch_;
};

/// The batches of one epoch. Whole (what BatchSampler::plan gives): batch b is
/// indices[offsets[b] .. offsets[b+1]). Lazy (BatchPlan::lazy, what the loader makes of a
/// sampler's SampleOrder: Note [Lazy plans]): batch b is the order's positions
/// [b * batch_size, (b + 1) * batch_size), the last one shorter unless drop_last; `indices` and
/// `offsets` stay empty, and batch_into(), offset() and sample_at() read either kind.
struct BatchPlan {
  std::vector<std::size_t> indices;
  std::vector<std::size_t> offsets{0};
  std::shared_ptr<const SampleOrder> order;  ///< set: a lazy plan
  std::size_t batch_size = 0;                ///< a lazy plan's
  bool drop_last = false;                    ///< a lazy plan's

  /// A lazy plan of `order` in batches of `batch_size` (ferry::Error for 0).
  static BatchPlan lazy(std::shared_ptr<const SampleOrder> order, std::size_t batch_size, bool drop_last);
  bool is_lazy() const noexcept { return order != nullptr; }
  /// Batches in the epoch.
  std::size_t size() const noexcept {
    if (!order) return offsets.size() - 1;
    const std::size_t n = order->size();
    return drop_last ? n / batch_size : (n + batch_size - 1) / batch_size;
  }
  /// Samples in the epoch (its batches' together).
  std::size_t samples() const noexcept { return order ? offset(size()) : indices.size(); }
  /// Where batch b starts among the epoch's samples (b <= size()).
  std::size_t offset(std::size_t b) const noexcept {
    return order ? std::min(b * batch_size, drop_last ? order->size() / batch_size * batch_size : order->size()) : offsets[b];
  }
  /// The epoch's p-th sample (p < samples()).
  std::size_t sample_at(std::size_t p) const { return order ? order->at(p) : indices[p]; }
  /// A whole plan's batch b, in place. ferry::Error for a lazy plan (batch_into reads both).
  std::span<const std::size_t> batch(std::size_t b) const;
  /// Batch b's indices into `out` (resized to the batch).
  void batch_into(std::size_t b, std::vector<std::size_t>& out) const;
  /// Appends one batch (a whole plan).
  void add(std::span<const std::size_t> batch) {
    indices.insert(indices.end(), batch.begin(), batch.end());
    offsets.push_back(indices.size());
  }
};

/// Groups `indices` into batches of `batch_size` (the last one smaller unless drop_last), as
/// BatchSampler::plan does.
BatchPlan make_batches(std::vector<std::size_t> indices, std::size_t batch_size, bool drop_last);

/// Groups a Sampler's indices into batches of `batch_size` (the last one smaller unless drop_last).
/// Derive and override size() and plan() for custom batching.
class BatchSampler {
 public:
  /// `lazy`: epoch_plan() batches the sampler's order() lazily (the loader's own batcher is lazy;
  /// false keeps epoch_plan() equal to plan() for a subclass that overrides plan()).
  BatchSampler(std::shared_ptr<const Sampler> sampler, std::size_t batch_size, bool drop_last, bool lazy = false);
  virtual ~BatchSampler() = default;
  /// Number of batches per epoch.
  virtual std::size_t size() const;
  /// Every batch of epoch `epoch`, whole.
  virtual BatchPlan plan(std::uint64_t epoch) const;
  /// Epoch `epoch`'s plan as the loader takes it: lazy (BatchPlan::lazy) where this is the
  /// library's own batcher (made by the loader from its options, or with lazy = true) over a
  /// sampler that gives an order(); else plan(epoch). A subclass's plan() is always its own.
  virtual BatchPlan epoch_plan(std::uint64_t epoch) const;
  /// True when plan() is a function of the epoch alone, safe to call on another thread: the
  /// loader then makes the next epoch's plan while this epoch runs, so an epoch does not start by
  /// waiting for it (and, with persistent workers, the next epoch's first batches:
  /// DataLoaderOptions::prefetch_next_epoch). False for a sampler that must be asked in its
  /// epoch's turn (one whose order depends on what happens between epochs): plan(e) is then
  /// called only as epoch e begins, and nothing of epoch e is made before.
  virtual bool plans_ahead() const noexcept { return true; }

 protected:
  BatchSampler() = default;

 private:
  std::shared_ptr<const Sampler> sampler_;
  std::size_t batch_size_ = 1;
  bool drop_last_ = false;
  bool lazy_ = false;
};

}  // namespace ferry
