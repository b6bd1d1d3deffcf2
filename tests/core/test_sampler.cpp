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
