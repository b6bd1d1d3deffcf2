// Tests that dataset composition (map, Subset, Concat, AnyDataset, random_split, shard_range)
// keeps indices straight and that per-sample randomness depends only on (seed, epoch, index).
#include <catch2/catch.hpp>

#include <numeric>
#include <set>

#include "ferry/ferry.h"

using namespace ferry;

namespace {
struct Squares {
  std::size_t n;
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i) const { return static_cast<std::int64_t>(i * i); }
};
std::int64_t fetch_one(const auto& ds, std::size_t i, std::uint64_t epoch = 0) {
  WorkerInfo w;
  SampleContext ctx(i, 0, epoch, w);
  return fetch(ds, i, ctx);
}
}  // namespace

TEST_CASE("TensorDataset yields rows of every tensor and checks their lengths", "[unit][dataset]") {
  Tensor x = Tensor::from(std::vector<float>{0, 1, 2, 3, 4, 5}, {3, 2});
  Tensor y = Tensor::from(std::vector<std::int64_t>{7, 8, 9});
  TensorDataset ds({x, y});
  CHECK(ds.size() == 3);
  auto s = ds.get(1);
  CHECK(s[0].item<float>(1) == 3.0f);
  CHECK(s[1].item<std::int64_t>() == 8);
  CHECK_THROWS_WITH(TensorDataset({x, Tensor::zeros(DType::Int64, {4})}),
                    Catch::Contains("tensor 1 has 4 rows but tensor 0 has 3"));
  CHECK_THROWS_WITH(ds.get(3), Catch::Contains("index 3 out of range for size 3"));
}

TEST_CASE("map transforms each sample and gets a per-sample generator", "[unit][dataset]") {
  auto ds = map(Squares{10},
                [](std::int64_t v, SampleContext& ctx) { return v + static_cast<std::int64_t>(ctx.rng().randint(1000)) * 1000; });
  auto a = fetch_one(ds, 3), b = fetch_one(ds, 3), c = fetch_one(ds, 3, 1);
  CHECK(a == b);         // same (seed, epoch, index)
  CHECK(a % 1000 == 9);  // base sample kept
  CHECK(a != c);         // another epoch draws another number (with overwhelming probability)
  auto plain = map(Squares{4}, [](std::int64_t v) { return v + 1; });
  CHECK(fetch_one(plain, 3) == 10);
  auto twice = TensorDataset({Tensor::zeros(DType::Float32, {2, 2})})
                   .map([](std::vector<Tensor> s) { return s.size(); })
                   .map([](std::size_t n) { return n * 2; });
  WorkerInfo w;
  SampleContext ctx(0, 0, 0, w);
  CHECK(twice.get(0, ctx) == 2);
}

TEST_CASE("Subset, ConcatDataset and AnyDataset index correctly", "[unit][dataset]") {
  Subset sub(Squares{10}, {9, 2, 5});
  CHECK(sub.size() == 3);
  CHECK(fetch_one(sub, 0) == 81);
  CHECK_THROWS_WITH(Subset(Squares{3}, {0, 3}), Catch::Contains("index 3 at position 1 is out of range for a dataset of size 3"));
  ConcatDataset cat(std::vector<Squares>{{2}, {3}});
  CHECK(cat.size() == 5);
  CHECK(fetch_one(cat, 1) == 1);
  CHECK(fetch_one(cat, 2) == 0);
  CHECK(fetch_one(cat, 4) == 4);
  CHECK_THROWS_AS(fetch_one(cat, 5), Error);
  ConcatDataset<AnyDataset<std::int64_t>> mixed(
      {AnyDataset<std::int64_t>(Squares{2}), AnyDataset<std::int64_t>(map(Squares{2}, [](std::int64_t v) { return -v; }))});
  CHECK(fetch_one(mixed, 3) == -1);
}

TEST_CASE("random_split is disjoint, complete and seeded", "[unit][dataset]") {
  auto parts = random_split(Squares{10}, {7, 3}, 1);
  REQUIRE(parts.size() == 2);
  CHECK(parts[0].size() == 7);
  std::set<std::size_t> all;
  for (auto& p : parts)
    for (auto i : p.indices()) CHECK(all.insert(i).second);
  CHECK(all.size() == 10);
  CHECK(random_split(Squares{10}, {7, 3}, 1)[0].indices() == parts[0].indices());
  CHECK(random_split(Squares{10}, {7, 3}, 2)[0].indices() != parts[0].indices());
  auto frac = random_split_indices(11, std::vector<double>{0.5, 0.5}, 0);
  CHECK(frac[0].size() == 6);
  CHECK(frac[1].size() == 5);
  CHECK_THROWS_WITH(random_split(Squares{10}, {4, 3}, 0), Catch::Contains("lengths sum to 7 but the dataset has 10"));
}

TEST_CASE("shard_range splits n items over workers without gaps or overlaps", "[unit][dataset]") {
  for (std::size_t n : {0u, 1u, 7u, 100u})
    for (int count : {1, 2, 3, 8}) {
      std::size_t next = 0;
      for (int id = 0; id < count; ++id) {
        auto [b, e] = shard_range(n, id, count);
        CHECK(b == next);
        CHECK(e - b <= n / static_cast<std::size_t>(count) + 1);
        next = e;
      }
      CHECK(next == n);
    }
  CHECK_THROWS_AS(shard_range(5, 2, 2), Error);
}
