// Tests pin_memory and the loader's pin thread on a CPU-only machine (test pool): custom batch
// types, pass-through of pinned tensors, one block per batch, errors in the pin stage at their
// batch's position, and shutdown with blocks in flight returning every block.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <thread>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;

namespace {
std::shared_ptr<PinnedPool> test_pool(std::size_t limit = 64 << 20) {
  PinnedPoolOptions o;
  o.limit_bytes = limit;
  o.backend = pageable_backend_for_tests();
  return std::make_shared<PinnedPool>(o);
}

struct CustomBatch {
  Tensor inputs, targets;
  int pinned_calls = 0;
  void pin_memory(PinContext& ctx) {
    ++pinned_calls;
    inputs = ctx.pin(inputs);
    targets = ctx.pin(targets);
  }
};

Tensor iota_tensor(std::int64_t n, std::int64_t offset = 0) {
  Tensor t = Tensor::empty(DType::Float32, {n});
  for (std::int64_t i = 0; i < n; ++i) t.data<float>()[i] = static_cast<float>(i + offset);
  return t;
}
}  // namespace

TEST_CASE("a custom batch's pin_memory moves its tensors into one pinned block", "[unit][pin]") {
  auto pool = test_pool();
  CustomBatch b{iota_tensor(100), iota_tensor(7, 5)};
  Tensor original = b.inputs;
  PinContext ctx(*pool, nullptr);
  pin_memory(b, ctx);
  CHECK(b.pinned_calls == 2);  // measure, then copy
  CHECK(b.inputs.is_pinned());
  CHECK(b.targets.is_pinned());
  CHECK(b.inputs.storage().data() == b.targets.storage().data());  // one block
  CHECK(b.inputs.equal(original));
  CHECK(b.targets.item<float>(6) == 11.0f);
  CHECK(ctx.bytes_copied() == 107 * 4);
  CHECK(pool->stats().leases == 1);
}

TEST_CASE("tensors already pinned pass through without a copy", "[unit][pin]") {
  auto pool = test_pool();
  Tensor pinned(pool->allocate(400), DType::Float32, {100});
  std::vector<Tensor> batch{pinned, iota_tensor(3)};
  PinContext ctx(*pool, nullptr);
  pin_memory(batch, ctx);
  CHECK(batch[0].raw() == pinned.raw());
  CHECK(batch[1].is_pinned());
  CHECK(ctx.bytes_copied() == 12);
  std::tuple<int, std::string, std::map<std::string, Tensor>, std::optional<Tensor>> nested{
      1, "x", {{"a", iota_tensor(2)}}, iota_tensor(4)};
  pin_memory(nested, ctx);
  CHECK(std::get<2>(nested)["a"].is_pinned());
  CHECK(std::get<3>(nested)->is_pinned());
}

TEST_CASE("the loader pins every batch in order, in copy and direct mode", "[pin][ordering]") {
  Tensor x = Tensor::empty(DType::Int32, {50, 8});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<std::int32_t>()[i] = static_cast<std::int32_t>(i);
  for (auto mode : {DataLoaderOptions::PinMode::Copy, DataLoaderOptions::PinMode::Direct}) {
    auto pool = test_pool();
    DataLoaderOptions o;
    o.batch_size = 8;
    o.shuffle = true;
    o.num_workers = 2;
    o.pin_memory = true;
    o.pin_mode = mode;
    o.pinned_pool = pool;
    DataLoader pinned(TensorDataset({x}), o);
    CHECK(pinned.pinned());
    o.pin_memory = false;
    o.pinned_pool = nullptr;
    DataLoader plain(TensorDataset({x}), o);
    std::vector<std::vector<Tensor>> a, b;
    for (auto& batch : pinned) {
      CHECK(batch[0].is_pinned());
      a.push_back(batch);
    }
    for (auto& batch : plain) {
      CHECK_FALSE(batch[0].is_pinned());
      b.push_back(batch);
    }
    REQUIRE(a.size() == 7);
    for (std::size_t k = 0; k < a.size(); ++k) CHECK(a[k][0].equal(b[k][0]));
    a.clear();
    CHECK(pool->stats().bytes_in_use == 0);
    CHECK(pool->stats().leases >= 7);
  }
}

TEST_CASE("a failure in pin_memory reaches the consumer at its batch; the epoch goes on", "[pin][errors]") {
  struct Flaky {
    Tensor t;
    std::int64_t first;
    void pin_memory(PinContext& ctx) {
      if (first == 8 && !ctx.measuring()) throw std::runtime_error("cannot pin this one");
      t = ctx.pin(t);
    }
  };
  struct Source {
    std::size_t size() const { return 20; }
    std::int64_t get(std::size_t i) const { return static_cast<std::int64_t>(i); }
  };
  DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  o.pin_memory = true;
  o.pinned_pool = test_pool();
  DataLoader loader(Source{}, o, [](std::vector<std::int64_t>&& s) { return Flaky{collate(s), s[0]}; });
  std::vector<std::int64_t> firsts;
  std::size_t unpinned = 0;
  auto errors = test::iterate_skipping_errors(loader, [&](Flaky& b) {
    unpinned += !b.t.is_pinned();
    firsts.push_back(b.first);
  });
  CHECK(unpinned == 0);
  CHECK(firsts == std::vector<std::int64_t>{0, 4, 12, 16});
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0],
             Catch::Contains("the pin thread failed in stage 'pin' of batch 2") && Catch::Contains("cannot pin this one"));
}

TEST_CASE("destroying a pinned loader mid-epoch returns every block and thread", "[pin][shutdown]") {
  auto pool = test_pool();
  Tensor x = Tensor::zeros(DType::Float32, {1000, 64});
  for (int cycle = 0; cycle < 50; ++cycle) {
    DataLoaderOptions o;
    o.batch_size = 10;
    o.num_workers = cycle % 3;
    o.pin_memory = true;
    o.pin_mode = cycle % 2 ? DataLoaderOptions::PinMode::Direct : DataLoaderOptions::PinMode::Copy;
    o.pinned_pool = pool;
    DataLoader loader(TensorDataset({x}), o);
    int n = 0;
    for (auto& b : loader) {
      (void)b;
      if (++n > cycle % 7) break;
    }
  }
  CHECK(live_threads() == 0);
  CHECK(pool->stats().bytes_in_use == 0);
}

TEST_CASE("pin_memory without CUDA or a pool warns and delivers pageable batches", "[pin]") {
  if (cuda::available()) return;
  DataLoaderOptions o;
  o.batch_size = 4;
  o.pin_memory = true;
  DataLoader loader(TensorDataset({Tensor::zeros(DType::Float32, {8, 2})}), o);
  CHECK_FALSE(loader.pinned());
  for (auto& b : loader) CHECK_FALSE(b[0].is_pinned());
}

TEST_CASE("a pinned budget too small for the pipeline's depth is an error, not a hang", "[pin][errors]") {
  DataLoaderOptions o;
  o.batch_size = 10;
  o.num_workers = 2;
  o.pin_memory = true;
  o.pin_mode = DataLoaderOptions::PinMode::Direct;
  o.pinned_pool = test_pool(5 * 10 * 64 * 4);  // 5 batches; direct mode may hold 4 + 2 + 2 = 8
  DataLoader loader(TensorDataset({Tensor::zeros(DType::Float32, {100, 64})}), o);
  try {
    for (auto& b : loader) (void)b;
    FAIL("no error");
  } catch (const WorkerError& e) {
    CHECK_THAT(e.what(),
               Catch::Contains("may hold up to 8 batches of 2560 bytes") && Catch::Contains("raise pinned_memory_limit"));
  }
}

TEST_CASE("an unset pinned budget grows to the pipeline's depth; a set one is an error naming it", "[pin][errors]") {
  // The ImageNet recipe on 15 workers: 36 float batches of 154 MB alive at once passed the 2 GiB
  // default and stopped at batch 0. Unset, the budget now grows to fit (here 8 x 2560 bytes).
  auto pool = test_pool(5 * 2560);
  detail::DepthCheckedAllocator grows(*pool, 8, "direct pin_mode", /*may_grow=*/true);
  Storage s = grows.allocate(2560);
  CHECK(s.nbytes() == 2560);
  CHECK(pool->limit_bytes() == 8 * 2560);
  // Past what the machine allows (half its memory), even an unset budget is an error that says so.
  auto small = test_pool(4096);
  detail::DepthCheckedAllocator huge(*small, std::size_t{1} << 20, "direct pin_mode", true);
  CHECK_THROWS_WITH(huge.allocate(std::size_t{1} << 30), Catch::Contains("more than the unset pinned_memory_limit may grow to") &&
                                                             Catch::Contains("lower prefetch_factor"));
  // A budget the user set never grows.
  auto fixed = test_pool(5 * 2560);
  detail::DepthCheckedAllocator refuses(*fixed, 8, "direct pin_mode", /*may_grow=*/false);
  CHECK_THROWS_WITH(refuses.allocate(2560), Catch::Contains("pinned_memory_limit is 12800 bytes") &&
                                                Catch::Contains("may hold up to 8 batches of 2560 bytes"));
  CHECK(fixed->limit_bytes() == 5 * 2560);
}

TEST_CASE("host batches kept for reuse: an unset cap grows to the pipeline's depth, a set one stays, neither refuses", "[pin]") {
  // 16 workers' float ImageNet batches (154 MB, 34 alive at once) passed the 2 GiB cap: most were
  // freed and mapped anew, every page faulted in as a worker wrote it.
  auto cache = [](std::size_t limit) {
    PinnedPoolOptions po;
    po.limit_bytes = limit;
    po.backend = pageable_backend_for_tests();
    po.hard_limit = false;
    return std::make_shared<PinnedPool>(po);
  };
  auto grown = cache(2 * 2560);
  detail::DepthCheckedAllocator grows(*grown, 8, "the workers and the consumer", /*may_grow=*/true);
  {
    std::vector<Storage> alive;
    for (int i = 0; i < 8; ++i) alive.push_back(grows.allocate(2560));
    CHECK(grown->limit_bytes() == 8 * 2560);
  }
  // All eight were kept: eight more take them again, nothing new allocated.
  std::vector<Storage> again;
  for (int i = 0; i < 8; ++i) again.push_back(grows.allocate(2560));
  CHECK(grown->stats().allocations == 8);
  CHECK(grown->stats().frees == 0);
  // A larger batch later (batches of varying size) grows it again.
  again.push_back(grows.allocate(4096));
  CHECK(grown->limit_bytes() == 8 * 4096);
  // A cap the user set stays: past it buffers are freed, and no allocation is refused.
  auto fixed = cache(2 * 2560);
  detail::DepthCheckedAllocator keeps(*fixed, 8, "the workers and the consumer", /*may_grow=*/false);
  {
    std::vector<Storage> alive;
    for (int i = 0; i < 8; ++i) alive.push_back(keeps.allocate(2560));
  }
  CHECK(fixed->limit_bytes() == 2 * 2560);
  CHECK(fixed->stats().bytes_pinned <= 2 * 2560);
  CHECK(fixed->stats().frees == 6);
}

namespace {
// Sample 0 is slow, so batches 1.. finish first and wait in the reorder buffer for batch 0.
struct SlowFirst {
  std::size_t size() const { return 16 * 40; }
  Tensor get(std::size_t i) const {
    if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    Tensor t = Tensor::empty(DType::Int32, {1024});
    std::fill_n(t.data<std::int32_t>(), 1024, static_cast<std::int32_t>(i));
    return t;
  }
};
}  // namespace

TEST_CASE("a tight pinned budget does not starve collate while later batches wait for an early one", "[pin][budget]") {
  // Regression: copy mode's recycled (pageable) collate buffers once shared the pinned budget, so
  // with 4 workers x 2 prefetch = 8 batches in flight and room for 6, batches 1..6 took every
  // collate buffer while waiting to be delivered after batch 0, and batch 0 could never collate.
  for (auto mode : {DataLoaderOptions::PinMode::Copy, DataLoaderOptions::PinMode::Direct}) {
    DataLoaderOptions o;
    o.batch_size = 16;
    o.num_workers = 4;
    o.pin_memory = true;
    o.pin_mode = mode;
    o.timeout = std::chrono::milliseconds(5000);
    const std::size_t batch_bytes = 16 * 1024 * 4;
    // Exactly the depth each mode reports needing: copy 2 + 2 = 4 batches; direct adds 8 in flight.
    o.pinned_pool = test_pool((mode == DataLoaderOptions::PinMode::Copy ? 4 : 12) * batch_bytes);
    DataLoader loader(SlowFirst{}, o);
    std::int64_t next = 0;
    for (auto& b : loader) {
      REQUIRE(b.is_pinned());
      REQUIRE(b.item<std::int32_t>(0) == next * 16);
      ++next;
    }
    CHECK(next == 40);
  }
}

TEST_CASE("a loader whose pin thread waits for blocks the consumer holds times out and shuts down", "[pin][shutdown]") {
  // The consumer keeps every batch, so the pool runs dry and the pin thread waits for a block
  // that never comes back. The consumer gets a TimeoutError naming the pin thread; destroying
  // the loader then stops the waiting pin thread instead of hanging on it.
  auto pool = test_pool(4 * 10 * 64 * 4);  // exactly the depth copy mode needs: 2 + 2 batches
  std::vector<Tensor> kept;
  {
    DataLoaderOptions o;
    o.batch_size = 10;
    o.num_workers = 2;
    o.pin_memory = true;
    o.pin_mode = DataLoaderOptions::PinMode::Copy;
    o.pinned_pool = pool;
    o.timeout = std::chrono::milliseconds(200);
    DataLoader loader(TensorDataset({Tensor::zeros(DType::Float32, {200, 64})}), o);
    try {
      for (auto& b : loader) kept.push_back(b[0]);
      FAIL("no timeout");
    } catch (const TimeoutError& e) {
      CHECK_THAT(e.what(), Catch::Contains("pin thread"));
      CHECK_THAT(e.what(), Catch::Contains("timed out after 400 ms"));  // twice the timeout: the workers' comes first
    }
    CHECK(kept.size() == 4);
  }
  CHECK(live_threads() == 0);
  kept.clear();
  CHECK(pool->stats().bytes_in_use == 0);
}

TEST_CASE("a negative device is an error that says how to ask for host batches", "[pin][errors]") {
  DataLoaderOptions o;
  o.device = -1;
  try {
    DataLoader loader(TensorDataset({Tensor::empty(DType::Int64, {4})}), o);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("device=-1 is not a CUDA device index") && Catch::Contains("leave device unset"));
  }
}
