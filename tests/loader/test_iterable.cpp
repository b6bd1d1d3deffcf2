// Tests that an iterable dataset is split across workers with no sample read twice and none
// dropped, for any worker count, and that its batches interleave deterministically.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;

namespace {
using Counting = test::CountingStream;
}  // namespace

TEST_CASE("iterable datasets are read once, across any number of workers", "[iterable]") {
  for (std::size_t n : {0u, 1u, 23u, 100u})
    for (int workers : {0, 1, 2, 3, 4}) {
      for (bool in_order : {true, false}) {
        DataLoaderOptions o;
        o.batch_size = 4;
        o.num_workers = workers;
        o.in_order = in_order;
        DataLoader loader(Counting{n}, o);
        std::multiset<std::int64_t> seen;
        std::size_t batches = 0;
        for (Tensor& b : loader) {
          ++batches;
          for (std::int64_t r = 0; r < b.numel(); ++r) seen.insert(b.item<std::int64_t>(r));
        }
        INFO("n=" << n << " workers=" << workers << " in_order=" << in_order);
        CHECK(seen.size() == n);
        CHECK(std::set<std::int64_t>(seen.begin(), seen.end()).size() == n);
        if (n) CHECK(*seen.rbegin() == static_cast<std::int64_t>(n - 1));
        // Each worker's share ends in at most one short batch.
        const int w = std::max(workers, 1);
        std::size_t expect = 0;
        for (int id = 0; id < w; ++id) {
          auto [b, e] = shard_range(n, id, w);
          expect += (e - b + 3) / 4;
        }
        CHECK(batches == expect);
      }
    }
}

TEST_CASE("iterable batches interleave round-robin across workers, as PyTorch's", "[iterable][ordering]") {
  DataLoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 2;
  DataLoader loader(Counting{10}, o);  // worker 0: 0..4, worker 1: 5..9
  std::vector<std::int64_t> firsts;
  for (Tensor& b : loader) firsts.push_back(b.item<std::int64_t>(0));
  CHECK(firsts == std::vector<std::int64_t>{0, 5, 2, 7, 4, 9});
}

TEST_CASE("drop_last drops each worker's short tail; a stream has no sampler", "[iterable][errors]") {
  DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  o.drop_last = true;
  DataLoader loader(Counting{10}, o);  // 5 + 5: one full batch each
  std::size_t rows = 0;
  for (Tensor& b : loader) rows += static_cast<std::size_t>(b.numel());
  CHECK(rows == 8);
  CHECK_THROWS_WITH(loader.size(), Catch::Contains("has no size()"));
  o.shuffle = true;
  CHECK_THROWS_WITH(DataLoader(Counting{10}, o), Catch::Contains("an iterable dataset takes no sampler"));
}
