// Tests that 1,000 create-iterate-destroy cycles, each dropping its iterator at a random point
// with random options, neither hang nor leak: no thread, sample or batch buffer outlives its loader.
#include <catch2/catch.hpp>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;
using test::Tracked;

namespace {
struct Source {
  std::size_t n;
  std::size_t size() const { return n; }
  Tracked get(std::size_t i) const { return Tracked(i); }
};
struct Stream {
  std::size_t n;
  struct S {
    std::size_t i, end;
    std::optional<Tracked> next() { return i < end ? std::optional<Tracked>(Tracked(i++)) : std::nullopt; }
  };
  S open(const WorkerInfo& w) const {
    auto [b, e] = shard_range(n, w.id, w.num_workers);
    return {b, e};
  }
};
struct TrackedBatch {
  std::vector<Tracked> samples;
  Tensor buffer;
};
}  // namespace

TEST_CASE("1,000 create-iterate-destroy cycles with random early exits leak nothing", "[stress][shutdown]") {
  Generator g(20261121);
  auto alloc = std::make_shared<test::CountingAllocator>();
  for (int cycle = 0; cycle < 1000; ++cycle) {
    DataLoaderOptions o;
    o.batch_size = 1 + g.randint(8);
    o.num_workers = static_cast<int>(g.randint(5));
    o.persistent_workers = o.num_workers > 0 && g.bernoulli(0.5);
    o.in_order = g.bernoulli(0.7);
    o.prefetch_factor = 1 + static_cast<int>(g.randint(3));
    o.shuffle = g.bernoulli(0.5);
    const std::size_t n = g.randint(60);
    const std::size_t stop_after = g.randint(12);
    const int epochs = 1 + static_cast<int>(g.randint(2));
    INFO("cycle " << cycle << " workers " << o.num_workers << " n " << n << " stop " << stop_after);
    auto collate_fn = [alloc](std::vector<Tracked>&& s) { return TrackedBatch{std::move(s), empty(DType::UInt8, {16}, *alloc)}; };
    if (g.bernoulli(0.8)) {
      DataLoader loader(Source{n}, o, collate_fn);
      for (int e = 0; e < epochs; ++e) {
        std::size_t seen = 0;
        for (auto& b : loader) {
          REQUIRE(!b.samples.empty());
          if (++seen > stop_after) break;
        }
      }
    } else {
      o.shuffle = false;
      DataLoader loader(Stream{n}, o, collate_fn);
      std::size_t seen = 0;
      for (auto& b : loader) {
        REQUIRE(!b.samples.empty());
        if (++seen > stop_after) break;
      }
    }
    REQUIRE(live_threads() == 0);
    REQUIRE(Tracked::alive == 0);
    REQUIRE(alloc->live == 0);
  }
  CHECK(alloc->allocations > 1000);
}
