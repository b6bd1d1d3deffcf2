#include "ferry/core/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
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
// An order held whole (a Fisher-Yates shuffle, an epoch's draws).
class WholeOrder final : public SampleOrder {
 public:
  explicit WholeOrder(std::vector<std::size_t> v) : v_(std::move(v)) {}
  std::size_t size() const noexcept override { return v_.size(); }
  std::size_t at(std::size_t p) const override { return v_.at(p); }
  void fill(std::size_t begin, std::span<std::size_t> out) const override {
    std::copy_n(v_.begin() + static_cast<std::ptrdiff_t>(begin), out.size(), out.begin());
  }

 private:
  std::vector<std::size_t> v_;
};

// 0, 1, ..., n - 1.
class IdentityOrder final : public SampleOrder {
 public:
  explicit IdentityOrder(std::size_t n) : n_(n) {}
  std::size_t size() const noexcept override { return n_; }
  std::size_t at(std::size_t p) const override { return p; }
  void fill(std::size_t begin, std::span<std::size_t> out) const override { std::iota(out.begin(), out.end(), begin); }

 private:
  std::size_t n_;
};

// The first `size` positions of a keyed permutation of [0, n).
class PermutedOrder final : public SampleOrder {
 public:
  PermutedOrder(std::size_t n, std::size_t size, std::uint64_t key) : perm_(n, key), size_(size) {}
  std::size_t size() const noexcept override { return size_; }
  std::size_t at(std::size_t p) const override { return static_cast<std::size_t>(perm_.at(p)); }

 private:
  IndexPermutation perm_;
  std::size_t size_;
};

// `size` draws from [0, n) with replacement, one generator a position.
class DrawnOrder final : public SampleOrder {
 public:
  DrawnOrder(std::size_t n, std::size_t size, std::uint64_t key) : n_(n), size_(size), key_(key) {}
  std::size_t size() const noexcept override { return size_; }
  std::size_t at(std::size_t p) const override {
    return static_cast<std::size_t>(Generator(key_, kSamplerStream, p).randint(n_));
  }

 private:
  std::size_t n_, size_;
  std::uint64_t key_;
};

// The key of epoch `epoch`'s keyed permutation (or draws) for a sampler of `seed` and `salt`.
std::uint64_t order_key(std::uint64_t seed, std::uint64_t epoch, std::uint64_t salt) {
  return mix_seed(mix_seed(seed, salt), kSamplerStream, epoch);
}

// Epoch `epoch`'s permutation of [0, n) (the first `size` positions of it): Fisher-Yates held
// whole up to Sampler::kWholeShuffle, else keyed (Note [Lazy plans]).
std::shared_ptr<const SampleOrder> permutation(std::size_t n, std::size_t size, std::uint64_t seed, std::uint64_t epoch,
                                               std::uint64_t salt) {
  if (n <= Sampler::kWholeShuffle) {
    std::vector<std::size_t> v(n);
    std::iota(v.begin(), v.end(), std::size_t{0});
    Generator g = epoch_generator(seed, epoch, salt);
    shuffle(v, g);
    v.resize(size);
    return std::make_shared<WholeOrder>(std::move(v));
  }
  return std::make_shared<PermutedOrder>(n, size, order_key(seed, epoch, salt));
}

std::vector<std::size_t> whole(const SampleOrder& o) {
  std::vector<std::size_t> v(o.size());
  o.fill(0, v);
  return v;
}
}  // namespace

// --- permutations -------------------------------------------------------------------------------

IndexPermutation::IndexPermutation(std::uint64_t n, std::uint64_t key) noexcept : n_(n), key_(key) {
  const int bits = n <= 4 ? 2 : std::bit_width(n - 1);
  half_bits_ = (bits + 1) / 2;
}

std::uint64_t IndexPermutation::round(std::uint64_t half, int r) const noexcept {
  return mix_seed(key_, half, static_cast<std::uint64_t>(r)) & ((std::uint64_t{1} << half_bits_) - 1);
}

std::uint64_t IndexPermutation::at(std::uint64_t i) const noexcept {
  if (n_ <= 1) return i;
  const std::uint64_t mask = (std::uint64_t{1} << half_bits_) - 1;
  std::uint64_t x = i;
  do {  // cycle walking: a bijection of [0, 4^half_bits) applied until it lands in [0, n)
    std::uint64_t l = x >> half_bits_, r = x & mask;
    for (int k = 0; k < 4; ++k) {
      const std::uint64_t t = l ^ round(r, k);
      l = r;
      r = t;
    }
    x = (l << half_bits_) | r;
  } while (x >= n_);
  return x;
}

void SampleOrder::fill(std::size_t begin, std::span<std::size_t> out) const {
  for (std::size_t k = 0; k < out.size(); ++k) out[k] = at(begin + k);
}

std::shared_ptr<const SampleOrder> Sampler::order(std::uint64_t) const { return nullptr; }

std::shared_ptr<const SampleOrder> SequentialSampler::order(std::uint64_t) const { return std::make_shared<IdentityOrder>(n_); }

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

std::vector<std::size_t> RandomSampler::indices(std::uint64_t epoch) const { return whole(*order(epoch)); }

std::shared_ptr<const SampleOrder> RandomSampler::order(std::uint64_t epoch) const {
  if (!replacement_) return permutation(n_, num_samples_, seed_, epoch, 1);
  if (num_samples_ > kWholeShuffle) return std::make_shared<DrawnOrder>(n_, num_samples_, order_key(seed_, epoch, 1));
  Generator g = epoch_generator(seed_, epoch, 1);
  std::vector<std::size_t> v(num_samples_);
  detail::BulkDraws(g).randints(n_, false, v);
  return std::make_shared<WholeOrder>(std::move(v));
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

namespace {
// One rank's share of an epoch's order from position `start` on, as PyTorch splits an epoch:
// position p of the rank is the remainder's (rank + p * world) mod m, the remainder padded by
// repeating from its start (cyclically if the padding exceeds it).
class RankOrder final : public SampleOrder {
 public:
  RankOrder(std::shared_ptr<const SampleOrder> all, std::size_t start, std::size_t world, std::size_t rank, std::size_t per)
      : all_(std::move(all)), start_(start), m_(all_->size() - start), world_(world), rank_(rank), per_(per) {}
  std::size_t size() const noexcept override { return per_; }
  std::size_t at(std::size_t p) const override { return all_->at(start_ + (rank_ + p * world_) % m_); }

 private:
  std::shared_ptr<const SampleOrder> all_;
  std::size_t start_, m_, world_, rank_, per_;
};
}  // namespace

std::vector<std::size_t> DistributedSampler::indices_from(std::uint64_t epoch, std::size_t start) const {
  return whole(*order_from(epoch, start));
}

std::shared_ptr<const SampleOrder> DistributedSampler::order(std::uint64_t epoch) const { return order_from(epoch, 0); }

std::shared_ptr<const SampleOrder> DistributedSampler::order_from(std::uint64_t epoch, std::size_t start) const {
  const std::uint64_t e = pinned_epoch_.value_or(epoch);
  std::shared_ptr<const SampleOrder> all =
      shuffle_ ? permutation(n_, n_, seed_, e, 4) : std::shared_ptr<const SampleOrder>(std::make_shared<IdentityOrder>(n_));
  const std::size_t m = n_ - std::min(start, n_);
  const std::size_t per = drop_last_ ? m / world_ : (m + world_ - 1) / world_;  // per_rank_ when start == 0
  if (m == 0) return std::make_shared<WholeOrder>(std::vector<std::size_t>{});
  return std::make_shared<RankOrder>(std::move(all), n_ - m, world_, rank_, per);
}

std::size_t DistributedSampler::position_after(std::size_t start, std::size_t taken) const {
  if (start >= n_) return n_;
  const std::size_t m = n_ - start;
  const std::size_t unique = drop_last_ ? m / world_ * world_ : m;  // positions the split covers, padding aside
  return start + std::min(taken * world_, unique);
}

BatchSampler::BatchSampler(std::shared_ptr<const Sampler> sampler, std::size_t batch_size, bool drop_last, bool lazy)
    : sampler_(std::move(sampler)), batch_size_(batch_size), drop_last_(drop_last), lazy_(lazy) {
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

BatchPlan BatchSampler::epoch_plan(std::uint64_t epoch) const {
  if (lazy_ && sampler_)
    if (std::shared_ptr<const SampleOrder> o = sampler_->order(epoch))
      return BatchPlan::lazy(std::move(o), batch_size_, drop_last_);
  return plan(epoch);
}

BatchPlan BatchPlan::lazy(std::shared_ptr<const SampleOrder> order, std::size_t batch_size, bool drop_last) {
  if (batch_size == 0) throw Error("BatchPlan::lazy: batch_size must be >= 1");
  if (!order) throw Error("BatchPlan::lazy: no order");
  BatchPlan p;
  p.order = std::move(order);
  p.batch_size = batch_size;
  p.drop_last = drop_last;
  p.offsets.clear();
  return p;
}

std::span<const std::size_t> BatchPlan::batch(std::size_t b) const {
  if (order) throw Error("BatchPlan::batch: a lazy plan's batches are computed when asked (batch_into)");
  return std::span<const std::size_t>(indices).subspan(offsets[b], offsets[b + 1] - offsets[b]);
}

void BatchPlan::batch_into(std::size_t b, std::vector<std::size_t>& out) const {
  if (!order) {
    const std::span<const std::size_t> v = batch(b);
    out.assign(v.begin(), v.end());
    return;
  }
  const std::size_t begin = offset(b), end = offset(b + 1);
  out.resize(end - begin);
  order->fill(begin, out);
}

}  // namespace ferry
