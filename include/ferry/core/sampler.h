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
// Thread safety: the const members may be called from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace ferry {

/// Produces the sample indices of one epoch.
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// Number of indices per epoch.
  virtual std::size_t size() const = 0;
  /// The indices of epoch `epoch`, in visiting order.
  virtual std::vector<std::size_t> indices(std::uint64_t epoch) const = 0;
};

/// 0, 1, ..., n-1.
class SequentialSampler final : public Sampler {
 public:
  explicit SequentialSampler(std::size_t n) : n_(n) {}
  std::size_t size() const override { return n_; }
  std::vector<std::size_t> indices(std::uint64_t epoch) const override;

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
  void set_epoch(std::uint64_t epoch) { pinned_epoch_ = epoch; }

  /// Elastic resume (ferry/core/state.h): this rank's indices when the epoch's order (the seeded
  /// permutation of 0..n-1, unpadded) is taken from position `start` on, the positions before it
  /// having been delivered by the whole group, at any world size. That remainder is split as
  /// PyTorch splits a whole epoch: rank r takes every world_size-th index from r, the remainder
  /// padded with its own first indices so every rank gets as many (drop_last: its tail dropped
  /// instead). So each remaining index is delivered once, plus at most world_size - 1 padding
  /// repeats, as in any PyTorch epoch. indices_from(epoch, 0) == indices(epoch).
  std::vector<std::size_t> indices_from(std::uint64_t epoch, std::size_t start) const;
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

/// The batches of one epoch: batch b is indices[offsets[b] .. offsets[b+1]).
struct BatchPlan {
  std::vector<std::size_t> indices;
  std::vector<std::size_t> offsets{0};
  std::size_t size() const noexcept { return offsets.size() - 1; }
  std::span<const std::size_t> batch(std::size_t b) const {
    return std::span<const std::size_t>(indices).subspan(offsets[b], offsets[b + 1] - offsets[b]);
  }
  /// Appends one batch.
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
  BatchSampler(std::shared_ptr<const Sampler> sampler, std::size_t batch_size, bool drop_last);
  virtual ~BatchSampler() = default;
  /// Number of batches per epoch.
  virtual std::size_t size() const;
  /// Every batch of epoch `epoch`.
  virtual BatchPlan plan(std::uint64_t epoch) const;
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
};

}  // namespace ferry
