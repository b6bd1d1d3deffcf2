// Tests that the loader delivers batches in sampler order whatever order workers finish in, that
// the batch stream is bitwise identical for 0, 1, 2, 4 and 8 workers, and the fetch paths
// (get, get_batch, get_into) agree.
#include <catch2/catch.hpp>

#include <set>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;
using test::Gate;

namespace {

// Sample 0 blocks until every sample outside batch 0 has been fetched, so batch 0 finishes last
// whichever worker takes it.
struct LastFirst {
  std::size_t n, batch_size;
  std::shared_ptr<std::atomic<std::size_t>> fetched = std::make_shared<std::atomic<std::size_t>>(0);
  std::shared_ptr<Gate> others_done = std::make_shared<Gate>();
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i) const {
    if (i == 0) others_done->wait();
    if (i >= batch_size && fetched->fetch_add(1) + 1 == n - batch_size) others_done->open();
    return static_cast<std::int64_t>(i);
  }
};

// A dataset with augmentation randomness, to compare worker counts.
auto noisy_dataset() {
  Tensor x = Tensor::empty(DType::Float32, {200, 16});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>(i);
  return TensorDataset({x}).map([](std::vector<Tensor> s, SampleContext& ctx) {
    Tensor out = s[0].clone();
    for (std::int64_t k = 0; k < out.numel(); ++k) out.data<float>()[k] += ctx.rng().uniform(-1.0f, 1.0f);
    return std::make_pair(out, static_cast<std::int64_t>(ctx.index()));
  });
}

}  // namespace

TEST_CASE("order is restored when the first batch finishes last", "[ordering]") {
  for (int workers : {2, 4}) {
    LastFirst ds{16, 4};
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    DataLoader loader(ds, o);
    std::vector<std::int64_t> seen;
    for (Tensor& b : loader)
      for (std::int64_t r = 0; r < b.numel(); ++r) seen.push_back(b.item<std::int64_t>(r));
    std::vector<std::int64_t> expect(16);
    std::iota(expect.begin(), expect.end(), 0);
    CHECK(seen == expect);
  }
}

TEST_CASE("in_order=false hands over batches as they complete", "[ordering]") {
  LastFirst ds{16, 4};
  DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  o.in_order = false;
  DataLoader loader(ds, o);
  std::vector<std::int64_t> firsts;
  for (Tensor& b : loader) firsts.push_back(b.item<std::int64_t>(0));
  REQUIRE(firsts.size() == 4);
  CHECK(firsts.front() != 0);  // batch 0 could not complete before the others
  CHECK(std::set<std::int64_t>(firsts.begin(), firsts.end()) == std::set<std::int64_t>{0, 4, 8, 12});
}

TEST_CASE("the batch stream is bitwise identical for 0, 1, 2, 4 and 8 workers", "[ordering][determinism]") {
  auto run = [](int workers, std::uint64_t epoch) {
    DataLoaderOptions o;
    o.batch_size = 12;
    o.shuffle = true;
    o.seed = 99;
    o.num_workers = workers;
    DataLoader loader(noisy_dataset(), o);
    loader.set_epoch(epoch);
    std::vector<std::pair<Tensor, Tensor>> out;
    for (auto& b : loader) out.push_back(b);
    return out;
  };
  for (std::uint64_t epoch : {0u, 3u}) {
    auto ref = run(0, epoch);
    REQUIRE(ref.size() == 17);
    for (int w : {1, 2, 4, 8}) {
      auto got = run(w, epoch);
      REQUIRE(got.size() == ref.size());
      for (std::size_t b = 0; b < ref.size(); ++b) {
        CHECK(got[b].first.equal(ref[b].first));
        CHECK(got[b].second.equal(ref[b].second));
      }
    }
  }
  // Epochs differ, and set_epoch replays one exactly.
  CHECK_FALSE(run(0, 0)[0].second.equal(run(0, 1)[0].second));
}

TEST_CASE("epochs advance by themselves and set_epoch replays one", "[ordering][determinism]") {
  DataLoaderOptions o;
  o.batch_size = 50;
  o.shuffle = true;
  o.num_workers = 2;
  DataLoader loader(noisy_dataset(), o);
  std::vector<Tensor> firsts;
  for (int e = 0; e < 3; ++e)
    for (auto& b : loader) {
      firsts.push_back(b.second);
      break;
    }
  CHECK(loader.next_epoch() == 3);
  loader.set_epoch(1);
  for (auto& b : loader) {
    CHECK(b.second.equal(firsts[1]));
    break;
  }
  CHECK_FALSE(firsts[0].equal(firsts[1]));
}

TEST_CASE("get, get_batch and get_into produce the same batches", "[ordering][direct]") {
  Tensor x = Tensor::empty(DType::Int32, {37, 5});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<std::int32_t>()[i] = static_cast<std::int32_t>(i);
  Tensor y = Tensor::empty(DType::Int64, {37});
  for (std::int64_t i = 0; i < 37; ++i) y.data<std::int64_t>()[i] = i * 7;

  struct Batched {
    TensorDataset base;
    std::shared_ptr<std::atomic<int>> calls = std::make_shared<std::atomic<int>>(0);
    std::size_t size() const { return base.size(); }
    std::vector<Tensor> get(std::size_t i) const { return base.get(i); }
    std::vector<std::vector<Tensor>> get_batch(std::span<const std::size_t> idx) const {
      calls->fetch_add(1);
      std::vector<std::vector<Tensor>> out;
      for (auto i : idx) out.push_back(base.get(i));
      return out;
    }
  };
  DataLoaderOptions o;
  o.batch_size = 8;
  o.shuffle = true;
  o.num_workers = 2;
  auto gather = [](auto& loader) {
    std::vector<std::vector<Tensor>> out;
    for (auto& b : loader) out.push_back(b);
    return out;
  };
  test::CountingAllocator* counting = new test::CountingAllocator;
  o.allocator.reset(counting);
  DataLoader direct(TensorDataset({x, y}), o);
  static_assert(decltype(direct)::direct());
  auto a = gather(direct);
  CHECK(counting->allocations == 2 * 5);  // two tensors a batch, each from the allocator
  o.allocator.reset();
  Batched batched{TensorDataset({x, y})};
  DataLoader via_batch(batched, o);
  static_assert(!decltype(via_batch)::direct());
  auto b = gather(via_batch);
  CHECK(*batched.calls == 5);  // one get_batch a batch
  DataLoader via_collate(TensorDataset({x, y}), o, [](std::vector<std::vector<Tensor>>&& s) { return collate(s); });
  auto c = gather(via_collate);
  REQUIRE(a.size() == 5);
  REQUIRE(b.size() == 5);
  REQUIRE(c.size() == 5);
  for (std::size_t k = 0; k < 5; ++k)
    for (std::size_t t = 0; t < 2; ++t) {
      CHECK(a[k][t].equal(b[k][t]));
      CHECK(a[k][t].equal(c[k][t]));
    }
  CHECK(a[4][0].size(0) == 5);  // the last batch is short (37 = 4 * 8 + 5)
}

TEST_CASE("get_batch(indices, worker) is told the worker, the seed and the epoch", "[ordering]") {
  struct Told {
    std::size_t size() const { return 12; }
    std::vector<Tensor> get(std::size_t) const { throw Error("get: not used when get_batch answers"); }
    std::vector<std::vector<Tensor>> get_batch(std::span<const std::size_t> idx, const WorkerInfo& w) const {
      std::vector<std::vector<Tensor>> out;
      for (auto i : idx)
        out.push_back({Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(i)),
                       Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(w.epoch)),
                       Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(w.seed)),
                       Tensor::scalar<std::int64_t>(w.num_workers)});
      return out;
    }
  };
  static_assert(BatchFetchDataset<Told>);
  for (int workers : {0, 2}) {
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    o.seed = 77;
    DataLoader loader(Told{}, o);
    for (std::uint64_t epoch : {0u, 1u}) {
      std::size_t rows = 0;
      for (auto& b : loader)
        for (std::int64_t r = 0; r < b[0].size(0); ++r, ++rows) {
          CHECK(b[1].data<std::int64_t>()[r] == static_cast<std::int64_t>(epoch));
          CHECK(b[2].data<std::int64_t>()[r] == 77);
          CHECK(b[3].data<std::int64_t>()[r] == std::max(workers, 1));
        }
      CHECK(rows == 12);
    }
  }
}

TEST_CASE("fetching a batch's samples across intra-batch threads changes nothing", "[ordering][determinism]") {
  auto run = [](int workers, int intra) {
    DataLoaderOptions o;
    o.batch_size = 25;
    o.shuffle = true;
    o.seed = 5;
    o.num_workers = workers;
    o.intra_batch_threads = intra;
    DataLoader loader(noisy_dataset(), o);
    std::vector<std::pair<Tensor, Tensor>> out;
    for (auto& b : loader) out.push_back(b);
    return out;
  };
  auto ref = run(0, 1);
  for (auto [w, t] : {std::pair{0, 2}, {1, 3}, {2, 2}}) {
    auto got = run(w, t);
    REQUIRE(got.size() == ref.size());
    for (std::size_t b = 0; b < ref.size(); ++b) {
      CHECK(got[b].first.equal(ref[b].first));
      CHECK(got[b].second.equal(ref[b].second));
    }
  }
  // Direct mode (get_into) too.
  Tensor x = Tensor::empty(DType::Int32, {90, 3});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<std::int32_t>()[i] = static_cast<std::int32_t>(i);
  DataLoaderOptions o;
  o.batch_size = 30;
  o.num_workers = 1;
  o.intra_batch_threads = 3;
  DataLoader direct(TensorDataset({x}), o);
  std::int32_t expect = 0;
  for (auto& b : direct)
    for (std::int64_t i = 0; i < b[0].numel(); ++i) CHECK(b[0].item<std::int32_t>(i) == expect++);
  CHECK(expect == 270);
}

TEST_CASE("round_robin: batch b is made by worker b mod num_workers, even when a worker is slow", "[ordering]") {
  // Worker 0's first batch is slow: without round_robin the other workers would take its later
  // batches; with it (PyTorch's assignment) every batch goes to its own worker, in every epoch,
  // persistent workers' next epoch made ahead included.
  struct WhoMade {
    std::size_t size() const { return 30; }
    std::vector<Tensor> get(std::size_t) const { throw Error("get: not used when get_batch answers"); }
    std::vector<std::vector<Tensor>> get_batch(std::span<const std::size_t> idx, const WorkerInfo& w) const {
      if (w.id == 0 && idx[0] == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::vector<std::vector<Tensor>> out;
      for (auto i : idx)
        out.push_back({Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(i)), Tensor::scalar<std::int64_t>(w.id)});
      return out;
    }
  };
  for (bool persistent : {false, true}) {
    DataLoaderOptions o;
    o.batch_size = 2;
    o.num_workers = 3;
    o.prefetch_factor = 4;
    o.round_robin = true;
    o.persistent_workers = persistent;
    DataLoader loader(WhoMade{}, o);
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::int64_t b = 0;
      for (auto& batch : loader) {
        CHECK(batch[0].data<std::int64_t>()[0] == 2 * b);
        CHECK(batch[1].data<std::int64_t>()[0] == b % 3);
        ++b;
      }
      CHECK(b == 15);
    }
  }
}

TEST_CASE("round_robin: a worker's next job goes out as soon as one slot of the window is free", "[ordering]") {
  // Note [Refill under round-robin]. Two workers, window 4: worker 0 makes batches 0, 2, 4;
  // worker 1 makes 1, 3. Batch 1 waits (up to 5 s) for batch 4 to start: that happens only if
  // taking batch 0 sent batch 4 out at once. Refilled in bursts of half the window, batch 4 would
  // wait for batch 1 to be taken too, and batch 1 would give up waiting.
  struct Held {
    std::shared_ptr<Gate> four_started;
    std::shared_ptr<std::atomic<bool>> waited_out;
    std::size_t size() const { return 12; }
    std::vector<Tensor> get(std::size_t) const { throw Error("get: not used when get_batch answers"); }
    std::vector<std::vector<Tensor>> get_batch(std::span<const std::size_t> idx, const WorkerInfo&) const {
      const std::size_t batch = idx[0] / 2;
      if (batch == 4) four_started->open();
      if (batch == 1 && !four_started->wait_for(std::chrono::seconds(5))) *waited_out = true;
      std::vector<std::vector<Tensor>> out;
      for (auto i : idx) out.push_back({Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(i))});
      return out;
    }
  };
  auto waited_out = std::make_shared<std::atomic<bool>>(false);
  DataLoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 2;
  o.prefetch_factor = 2;
  o.round_robin = true;
  DataLoader loader(Held{std::make_shared<Gate>(), waited_out}, o);
  std::int64_t b = 0;
  for (auto& batch : loader) CHECK(batch[0].data<std::int64_t>()[0] == 2 * b++);
  CHECK(b == 6);
  CHECK_FALSE(waited_out->load());
}
