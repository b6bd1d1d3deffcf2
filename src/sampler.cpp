#include "ferry/core/sampler.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <string>

#include "ferry/core/error.h"
#include "ferry/core/random.h"
#include "random_bulk.h"

namespace ferry {
namespace {
// Stream ids keep sampler randomness apart from per-sample randomness (which uses the epoch as
// stream and the sample index as substream).
constexpr std::uint64_t kSamplerStream = 0x5A3D'0000'0000'0000ull;

Generator epoch_generator(std::uint64_t seed, std::uint64_t epoch, std::uint64_t salt) {
  return Generator(mix_seed(seed, salt), kSamplerStream, epoch);
}

// Fisher-Yates; `g` is used up (its words are drawn ahead). Position i - 1 swaps with
// randint(i), for i from v.size() down to 2; the draws are made a chunk at a time.
void shuffle(std::vector<std::size_t>& v, Generator& g) {
  detail::BulkDraws d(g);
  std::array<std::size_t, 1024> j;
  for (std::size_t i = v.size(); i > 1;) {
    const std::span<std::size_t> draws(j.data(), std::min(j.size(), i - 1));
    d.randints(i, true, draws);
    for (const std::size_t x : draws) std::swap(v[--i], v[x]);
  }
}
}  // namespace

std::vector<std::size_t> SequentialSampler::indices(std::uint64_t) const {
  std::vector<std::size_t> v(n_);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}

RandomSampler::RandomSampler(std::size_t n, std::uint64_t seed, bool replacement, std::optional<std::size_t> num_samples)
    : n_(n), seed_(seed), replacement_(replacement), num_samples_(num_samples.value_or(n)) {
  if (!replacement_ && num_samples_ > n_)
    throw Error("RandomSampler: num_samples=" + std::to_string(num_samples_) + " exceeds the dataset size " + std::to_string(n_) +
                " (sampling without replacement)");
  if (replacement_ && n_ == 0 && num_samples_ > 0)
    throw Error("RandomSampler: cannot draw " + std::to_string(num_samples_) + " samples from an empty dataset");
}

std::vector<std::size_t> RandomSampler::indices(std::uint64_t epoch) const {
  Generator g = epoch_generator(seed_, epoch, 1);
  if (replacement_) {
    std::vector<std::size_t> v(num_samples_);
    detail::BulkDraws(g).randints(n_, false, v);
    return v;
  }
  std::vector<std::size_t> v(n_);
  std::iota(v.begin(), v.end(), std::size_t{0});
  shuffle(v, g);
  v.resize(num_samples_);
  return v;
}

SubsetRandomSampler::SubsetRandomSampler(std::vector<std::size_t> subset, std::uint64_t seed)
    : subset_(std::move(subset)), seed_(seed) {}

std::vector<std::size_t> SubsetRandomSampler::indices(std::uint64_t epoch) const {
  Generator g = epoch_generator(seed_, epoch, 2);
  std::vector<std::size_t> v = subset_;
  shuffle(v, g);
  return v;
}

WeightedRandomSampler::WeightedRandomSampler(std::vector<double> weights, std::size_t num_samples, std::uint64_t seed,
                                             bool replacement)
    : weights_(std::move(weights)), num_samples_(num_samples), seed_(seed), replacement_(replacement) {
  double sum = 0;
  std::size_t positive = 0;
  cumulative_.reserve(weights_.size());
  for (std::size_t i = 0; i < weights_.size(); ++i) {
    const double w = weights_[i];
    if (!std::isfinite(w) || w < 0)
      throw Error("WeightedRandomSampler: weight " + std::to_string(i) + " is " + std::to_string(w) +
                  "; weights must be finite and non-negative");
    sum += w;
    positive += w > 0;
    cumulative_.push_back(sum);
  }
  if (!(sum > 0)) throw Error("WeightedRandomSampler: the weights sum to zero (or there are none)");
  if (!replacement_ && num_samples_ > positive)
    throw Error("WeightedRandomSampler: num_samples=" + std::to_string(num_samples_) + " exceeds the " +
                std::to_string(positive) + " indices with positive weight (sampling without replacement)");
}

std::vector<std::size_t> WeightedRandomSampler::indices(std::uint64_t epoch) const {
  Generator g = epoch_generator(seed_, epoch, 3);
  std::vector<std::size_t> v;
  v.reserve(num_samples_);
  if (replacement_) {
    const double total = cumulative_.back();
    for (std::size_t k = 0; k < num_samples_; ++k) {
      const double u = g.uniform() * total;
      auto it = std::upper_bound(cumulative_.begin(), cumulative_.end(), u);
      std::size_t i = static_cast<std::size_t>(it - cumulative_.begin());
      if (i >= weights_.size()) i = weights_.size() - 1;
      while (weights_[i] == 0 && i > 0) --i;  // guard the upper edge against rounding
      v.push_back(i);
    }
    return v;
  }
  // Without replacement: Efraimidis & Spirakis (2006) keys u^(1/w), largest first.
  std::vector<std::pair<double, std::size_t>> keys;
  for (std::size_t i = 0; i < weights_.size(); ++i) {
    const double u = g.uniform();
    if (weights_[i] > 0) keys.emplace_back(std::log(std::max(u, 1e-300)) / weights_[i], i);
  }
  std::partial_sort(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(num_samples_), keys.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  for (std::size_t k = 0; k < num_samples_; ++k) v.push_back(keys[k].second);
  return v;
}

DistributedSampler::DistributedSampler(std::size_t n, std::size_t world_size, std::size_t rank, bool shuffle, std::uint64_t seed,
                                       bool drop_last)
    : n_(n), world_(world_size), rank_(rank), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  if (world_ == 0) throw Error("DistributedSampler: world_size must be >= 1");
  if (rank_ >= world_)
    throw Error("DistributedSampler: rank " + std::to_string(rank_) + " is not in [0, " + std::to_string(world_) + ")");
  per_rank_ = drop_last_ ? n_ / world_ : (n_ + world_ - 1) / world_;
}

std::vector<std::size_t> DistributedSampler::indices(std::uint64_t epoch) const { return indices_from(epoch, 0); }

std::vector<std::size_t> DistributedSampler::indices_from(std::uint64_t epoch, std::size_t start) const {
  const std::uint64_t e = pinned_epoch_.value_or(epoch);
  std::vector<std::size_t> all(n_);
  std::iota(all.begin(), all.end(), std::size_t{0});
  if (shuffle_) {
    Generator g = epoch_generator(seed_, e, 4);
    shuffle(all, g);
  }
  all.erase(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(std::min(start, all.size())));
  const std::size_t m = all.size();
  const std::size_t per = drop_last_ ? m / world_ : (m + world_ - 1) / world_;  // per_rank_ when start == 0
  const std::size_t total = per * world_;
  if (total > m && m > 0) {
    // Pad by repeating from the start (cyclically if the padding exceeds the remainder), as PyTorch does.
    for (std::size_t k = 0; all.size() < total; ++k) all.push_back(all[k % m]);
  }
  all.resize(total);
  std::vector<std::size_t> mine;
  mine.reserve(per);
  for (std::size_t i = rank_; i < total; i += world_) mine.push_back(all[i]);
  return mine;
}

std::size_t DistributedSampler::position_after(std::size_t start, std::size_t taken) const {
  if (start >= n_) return n_;
  const std::size_t m = n_ - start;
  const std::size_t unique = drop_last_ ? m / world_ * world_ : m;  // positions the split covers, padding aside
  return start + std::min(taken * world_, unique);
}

BatchSampler::BatchSampler(std::shared_ptr<const Sampler> sampler, std::size_t batch_size, bool drop_last)
    : sampler_(std::move(sampler)), batch_size_(batch_size), drop_last_(drop_last) {
  if (!sampler_) throw Error("BatchSampler: sampler is null");
  if (batch_size_ == 0) throw Error("BatchSampler: batch_size must be >= 1");
}

std::size_t BatchSampler::size() const {
  const std::size_t n = sampler_->size();
  return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

BatchPlan make_batches(std::vector<std::size_t> indices, std::size_t batch_size, bool drop_last) {
  if (batch_size == 0) throw Error("make_batches: batch_size must be >= 1");
  BatchPlan p;
  p.indices = std::move(indices);
  if (drop_last) p.indices.resize(p.indices.size() / batch_size * batch_size);
  p.offsets.reserve(p.indices.size() / batch_size + 2);
  for (std::size_t i = batch_size; i < p.indices.size(); i += batch_size) p.offsets.push_back(i);
  if (!p.indices.empty()) p.offsets.push_back(p.indices.size());
  return p;
}

BatchPlan BatchSampler::plan(std::uint64_t epoch) const {
  return make_batches(sampler_->indices(epoch), batch_size_, drop_last_);
}

}  // namespace ferry
