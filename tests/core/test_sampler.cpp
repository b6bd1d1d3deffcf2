// Tests that every sampler's order is a function of (seed, epoch) alone, covers what it should,
// and rejects impossible arguments with a clear message.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "ferry/core/error.h"
#include "ferry/core/sampler.h"

using namespace ferry;

namespace {
std::vector<std::size_t> iota(std::size_t n) {
  std::vector<std::size_t> v(n);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}
bool is_permutation_of_range(std::vector<std::size_t> v, std::size_t n) {
  std::sort(v.begin(), v.end());
  return v == iota(n);
}
}  // namespace

TEST_CASE("SequentialSampler visits 0..n-1 in order", "[unit][sampler]") {
  SequentialSampler s(5);
  CHECK(s.indices(0) == iota(5));
  CHECK(s.indices(9) == iota(5));
}

TEST_CASE("RandomSampler is a seeded permutation per epoch", "[unit][sampler]") {
  RandomSampler s(100, 7);
  auto e0 = s.indices(0), e1 = s.indices(1);
  CHECK(is_permutation_of_range(e0, 100));
  CHECK(is_permutation_of_range(e1, 100));
  CHECK(e0 != e1);
  CHECK(e0 != iota(100));
  CHECK(RandomSampler(100, 7).indices(0) == e0);
  CHECK(RandomSampler(100, 8).indices(0) != e0);
}

TEST_CASE("RandomSampler with replacement and num_samples", "[unit][sampler]") {
  RandomSampler with(10, 1, true, 1000);
  auto v = with.indices(0);
  CHECK(v.size() == 1000);
  CHECK(std::all_of(v.begin(), v.end(), [](std::size_t i) { return i < 10; }));
  CHECK(std::set<std::size_t>(v.begin(), v.end()).size() == 10);
  RandomSampler fewer(10, 1, false, 4);
  auto f = fewer.indices(0);
  CHECK(f.size() == 4);
  CHECK(std::set<std::size_t>(f.begin(), f.end()).size() == 4);
  CHECK_THROWS_WITH(RandomSampler(10, 1, false, 11), Catch::Contains("num_samples=11 exceeds the dataset size 10"));
}

TEST_CASE("RandomSampler's orders stay what they were: a saved epoch resumes the same samples", "[unit][sampler]") {
  // Known answers (2026-11-26): a change to the draws or their order would move every resumed epoch.
  CHECK(RandomSampler(60000, 3, true, 6).indices(2) == std::vector<std::size_t>{41739, 8204, 38913, 23207, 45308, 53802});
  CHECK(RandomSampler(10, 7, false).indices(1) == std::vector<std::size_t>{3, 6, 7, 4, 0, 1, 2, 9, 5, 8});
}

TEST_CASE("SubsetRandomSampler permutes exactly the subset", "[unit][sampler]") {
  std::vector<std::size_t> subset{3, 9, 27, 81};
  SubsetRandomSampler s(subset, 5);
  auto v = s.indices(2);
  std::sort(v.begin(), v.end());
  CHECK(v == subset);
}

TEST_CASE("WeightedRandomSampler follows the weights and never draws a zero weight", "[unit][sampler]") {
  WeightedRandomSampler s({1.0, 0.0, 3.0}, 8000, 11);
  std::map<std::size_t, int> counts;
  for (auto i : s.indices(0)) ++counts[i];
  CHECK(counts[1] == 0);
  CHECK(counts[2] > 2.5 * counts[0]);
  CHECK(counts[2] < 3.5 * counts[0]);
  WeightedRandomSampler no_repl({1, 1, 1, 0, 5}, 4, 3, false);
  auto v = no_repl.indices(0);
  CHECK(std::set<std::size_t>(v.begin(), v.end()) == std::set<std::size_t>{0, 1, 2, 4});
  CHECK_THROWS_WITH(WeightedRandomSampler({1.0, -2.0}, 3, 0), Catch::Contains("weight 1 is -2"));
  CHECK_THROWS_WITH(WeightedRandomSampler({0.0, 0.0}, 3, 0), Catch::Contains("sum to zero"));
  CHECK_THROWS_WITH(WeightedRandomSampler({1, 0, 1}, 3, 0, false), Catch::Contains("exceeds the 2 indices with positive weight"));
}

TEST_CASE("DistributedSampler gives every rank the same count and covers the dataset", "[unit][sampler]") {
  for (bool shuffle : {false, true}) {
    const std::size_t n = 10, world = 4;
    std::multiset<std::size_t> all;
    for (std::size_t r = 0; r < world; ++r) {
      DistributedSampler s(n, world, r, shuffle, 9);
      auto v = s.indices(3);
      CHECK(v.size() == 3);
      CHECK(s.size() == 3);
      all.insert(v.begin(), v.end());
    }
    CHECK(all.size() == 12);  // padded with 2 repeats
    CHECK(std::set<std::size_t>(all.begin(), all.end()).size() == n);
  }
  // drop_last trims instead of padding; ranks stay disjoint.
  std::set<std::size_t> seen;
  for (std::size_t r = 0; r < 4; ++r) {
    auto v = DistributedSampler(10, 4, r, true, 9, true).indices(0);
    CHECK(v.size() == 2);
    for (auto i : v) CHECK(seen.insert(i).second);
  }
  // Shuffle changes with the epoch; set_epoch pins it.
  DistributedSampler s(100, 2, 0, true, 1);
  CHECK(s.indices(0) != s.indices(1));
  auto e5 = s.indices(5);
  s.set_epoch(5);
  CHECK(s.indices(0) == e5);
  CHECK_THROWS_WITH(DistributedSampler(10, 2, 2), Catch::Contains("rank 2 is not in [0, 2)"));
}

TEST_CASE("BatchSampler groups indices, with and without drop_last", "[unit][sampler]") {
  auto seq = std::make_shared<SequentialSampler>(10);
  BatchSampler keep(seq, 4, false), drop(seq, 4, true);
  CHECK(keep.size() == 3);
  CHECK(drop.size() == 2);
  BatchPlan p = keep.plan(0);
  REQUIRE(p.size() == 3);
  CHECK(std::vector<std::size_t>(p.batch(2).begin(), p.batch(2).end()) == std::vector<std::size_t>{8, 9});
  CHECK(drop.plan(0).size() == 2);
  CHECK(BatchSampler(std::make_shared<SequentialSampler>(0), 4, false).plan(0).size() == 0);
  CHECK_THROWS_WITH(BatchSampler(seq, 0, false), Catch::Contains("batch_size must be >= 1"));
}

// Note [Lazy plans]: every built-in order read a position at a time is the epoch's indices().
TEST_CASE("a sampler's order() is its indices(), read a position at a time", "[unit][sampler]") {
  auto same = [](const Sampler& s, std::uint64_t epoch) {
    const std::shared_ptr<const SampleOrder> o = s.order(epoch);
    REQUIRE(o);
    const std::vector<std::size_t> whole = s.indices(epoch);
    REQUIRE(o->size() == whole.size());
    std::size_t differ = 0;
    for (std::size_t p = 0; p < whole.size(); ++p) differ += o->at(p) != whole[p];
    CHECK(differ == 0);
    std::vector<std::size_t> part(std::min<std::size_t>(7, whole.size()));
    const std::size_t begin = whole.size() / 3;
    if (begin + part.size() <= whole.size()) {
      o->fill(begin, part);
      CHECK(std::equal(part.begin(), part.end(), whole.begin() + static_cast<std::ptrdiff_t>(begin)));
    }
  };
  same(SequentialSampler(100), 0);
  same(RandomSampler(1000, 3), 2);
  same(RandomSampler(1000, 3, true, 50), 1);
  same(RandomSampler(Sampler::kWholeShuffle + 1000, 3), 5);           // a keyed permutation
  same(RandomSampler(1000, 3, true, Sampler::kWholeShuffle + 5), 1);  // a draw a position
  for (bool shuffle : {false, true})
    for (bool drop : {false, true})
      for (std::size_t n : {std::size_t{0}, std::size_t{3}, std::size_t{103}, Sampler::kWholeShuffle + 3})
        for (std::size_t world : {1, 3, 4})
          for (std::size_t rank = 0; rank < world; ++rank) {
            const bool big = n > Sampler::kWholeShuffle;  // a keyed permutation: one world size, two starts
            if (big && (world != 3 || drop)) continue;
            const DistributedSampler d(n, world, rank, shuffle, 11, drop);
            same(d, 4);
            for (std::size_t start : {std::size_t{0}, std::size_t{1}, n / 2, n}) {
              if (big && start != n / 2) continue;
              const std::vector<std::size_t> whole = d.indices_from(4, start);
              const std::shared_ptr<const SampleOrder> o = d.order_from(4, start);
              REQUIRE(o->size() == whole.size());
              std::size_t differ = 0;
              for (std::size_t p = 0; p < whole.size(); ++p) differ += o->at(p) != whole[p];
              CHECK(differ == 0);
            }
          }
  // A user's Sampler gives none: its epochs are planned whole.
  struct Mine final : Sampler {
    std::size_t size() const override { return 3; }
    std::vector<std::size_t> indices(std::uint64_t) const override { return {2, 0, 1}; }
  };
  CHECK(Mine().order(0) == nullptr);
  CHECK(!BatchSampler(std::make_shared<Mine>(), 2, false, true).epoch_plan(0).is_lazy());
}

TEST_CASE("a shuffle past kWholeShuffle samples is a keyed permutation: each index once, another per epoch", "[unit][sampler]") {
  const std::size_t n = Sampler::kWholeShuffle * 2 + 12345;
  const RandomSampler r(n, 99);
  const std::shared_ptr<const SampleOrder> a = r.order(0), b = r.order(1);
  std::vector<bool> seen(n);
  std::size_t moved = 0, differs = 0, bad = 0;  // counted, not asserted a position (2 M of them)
  for (std::size_t p = 0; p < n; ++p) {
    const std::size_t i = a->at(p);
    if (i >= n || seen[i]) {
      ++bad;
      continue;
    }
    seen[i] = true;
    moved += i != p;
    differs += i != b->at(p);
  }
  CHECK(bad == 0);
  CHECK(moved > n - n / 100);  // a shuffle, not the identity
  CHECK(differs > n - n / 100);
  CHECK(RandomSampler(n, 99).order(0)->at(777) == a->at(777));  // a function of (seed, epoch) alone
  CHECK(RandomSampler(n, 98).order(0)->at(777) != a->at(777));
  // A subset of the draws (num_samples < n) is the permutation's first positions.
  const RandomSampler fewer(n, 99, false, 1000);
  CHECK(fewer.order(0)->size() == 1000);
  CHECK(fewer.order(0)->at(999) == a->at(999));
  // Draws with replacement: in range, and seeded.
  const RandomSampler drawn(10, 5, true, Sampler::kWholeShuffle + 1);
  std::set<std::size_t> values;
  for (std::size_t p = 0; p < 1000; ++p) values.insert(drawn.order(0)->at(p));
  CHECK(values.size() == 10);
  CHECK(*values.rbegin() == 9);
}

TEST_CASE("a lazy plan has a whole plan's batches, and holds nothing of the epoch", "[unit][sampler]") {
  for (bool drop : {false, true})
    for (std::size_t n : {0, 1, 7, 64, 1000}) {
      const auto s = std::make_shared<RandomSampler>(n, 4);
      const BatchPlan whole = BatchSampler(s, 7, drop).plan(3);
      const BatchPlan lazy = BatchSampler(s, 7, drop, true).epoch_plan(3);
      REQUIRE(lazy.is_lazy());
      CHECK(lazy.indices.empty());
      REQUIRE(lazy.size() == whole.size());
      CHECK(lazy.samples() == whole.samples());
      std::vector<std::size_t> got;
      for (std::size_t b = 0; b <= whole.size(); ++b) CHECK(lazy.offset(b) == whole.offset(b));
      for (std::size_t b = 0; b < whole.size(); ++b) {
        lazy.batch_into(b, got);
        CHECK(std::equal(got.begin(), got.end(), whole.batch(b).begin(), whole.batch(b).end()));
      }
      for (std::size_t p = 0; p < whole.samples(); ++p) CHECK(lazy.sample_at(p) == whole.sample_at(p));
      if (lazy.size() > 0) CHECK_THROWS_WITH(lazy.batch(0), Catch::Contains("batch_into"));
    }
  // An epoch of 2^40 samples: its plan is a few numbers, its last batch computed when asked.
  const std::size_t huge = std::size_t{1} << 40;
  const BatchPlan p = BatchSampler(std::make_shared<RandomSampler>(huge, 1), 1000, false, true).epoch_plan(0);
  CHECK(p.size() == (huge + 999) / 1000);
  std::vector<std::size_t> last;
  p.batch_into(p.size() - 1, last);
  CHECK(last.size() == huge % 1000);
  for (std::size_t i : last) CHECK(i < huge);
  CHECK_THROWS_WITH(BatchPlan::lazy(nullptr, 4, false), Catch::Contains("no order"));
  CHECK_THROWS_WITH(BatchPlan::lazy(std::make_shared<SequentialSampler>(3)->order(0), 0, false), Catch::Contains(">= 1"));
}
