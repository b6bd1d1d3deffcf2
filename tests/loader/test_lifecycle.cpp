// Tests the loader's lifecycle: bounded in-flight batches, one live iterator, persistent workers,
// and destruction mid-epoch that waits only for user code already running.
#include <catch2/catch.hpp>

#include <optional>
#include <thread>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;
using test::eventually;

namespace {
struct Counted {
  std::size_t n;
  std::shared_ptr<std::atomic<std::size_t>> fetched = std::make_shared<std::atomic<std::size_t>>(0);
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i) const {
    fetched->fetch_add(1);
    return static_cast<std::int64_t>(i);
  }
};
}  // namespace

TEST_CASE("in-flight batches are bounded by prefetch_factor * num_workers", "[lifecycle]") {
  Counted ds{10000};
  DataLoaderOptions o;
  o.batch_size = 10;
  o.num_workers = 3;
  o.prefetch_factor = 2;
  DataLoader loader(ds, o);
  auto it = loader.begin();
  CHECK(it->item<std::int64_t>(0) == 0);
  // The workers run ahead by the whole window...
  CHECK(eventually([&] { return ds.fetched->load() >= 60; }));
  // ...and never further: at most prefetch_factor * num_workers = 6 batches past those taken.
  for (std::size_t taken = 1; taken <= 12; ++taken) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // give the workers time to overrun
    CHECK(ds.fetched->load() <= (taken + 6) * 10);
    ++it;
    CHECK(it->item<std::int64_t>(0) == static_cast<std::int64_t>(taken * 10));
  }
}

TEST_CASE("a second live iterator is a clear error; after the first ends it works", "[lifecycle][errors]") {
  DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 1;
  DataLoader loader(Counted{8}, o);
  {
    auto first = loader.begin();
    CHECK_THROWS_WITH(loader.begin(), Catch::Contains("while an iterator of this loader is still live"));
  }
  std::size_t n = 0;
  for (auto& b : loader) n += static_cast<std::size_t>(b.numel());
  CHECK(n == 8);
}

TEST_CASE("persistent workers run worker_init_fn once; others once per epoch", "[lifecycle]") {
  for (bool persistent : {true, false}) {
    auto inits = std::make_shared<std::atomic<int>>(0), wrong_info = std::make_shared<std::atomic<int>>(0);
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = 3;
    o.persistent_workers = persistent;
    o.worker_init_fn = [inits, wrong_info](const WorkerInfo& w) {  // runs on workers: no Catch2 here
      if (w.num_workers != 3 || w.id < 0 || w.id >= 3) wrong_info->fetch_add(1);
      inits->fetch_add(1);
    };
    {
      DataLoader loader(Counted{20}, o);
      for (int e = 0; e < 3; ++e) {
        std::size_t n = 0;
        for (auto& b : loader) n += static_cast<std::size_t>(b.numel());
        CHECK(n == 20);
        CHECK(live_threads() == (persistent ? 3u : 0u));
      }
    }
    CHECK(*inits == (persistent ? 3 : 9));
    CHECK(*wrong_info == 0);
    CHECK(live_threads() == 0);
  }
}

TEST_CASE("destroying an iterator mid-epoch waits only for user code already running", "[lifecycle][shutdown]") {
  struct Blocks {
    std::shared_ptr<test::Gate> entered = std::make_shared<test::Gate>();
    std::shared_ptr<test::Gate> release = std::make_shared<test::Gate>();
    std::shared_ptr<std::atomic<std::size_t>> fetched = std::make_shared<std::atomic<std::size_t>>(0);
    std::size_t size() const { return 1000; }
    std::int64_t get(std::size_t i) const {
      fetched->fetch_add(1);
      if (i == 20) {
        entered->open();
        release->wait();
      }
      return static_cast<std::int64_t>(i);
    }
  };
  Blocks ds;
  test::CountingAllocator* alloc = new test::CountingAllocator;
  DataLoaderOptions o;
  o.batch_size = 10;
  o.num_workers = 2;
  o.allocator.reset(alloc);
  {
    DataLoader loader(ds, o);
    {
      auto it = loader.begin();
      CHECK(it->item<std::int64_t>(0) == 0);
      ds.entered->wait();  // a worker is now inside get(20)
      std::thread releaser([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        ds.release->open();
      });
      // Destroying the iterator blocks until get(20) returns, then stops.
      { auto gone = std::move(it); }  // a moved-to iterator owns the epoch; its end cancels it
      CHECK(ds.release->is_open());
      releaser.join();
    }
    const std::size_t after = ds.fetched->load();
    CHECK(after < 100);  // the rest of the epoch was cancelled, not fetched
    CHECK(live_threads() == 0);
    CHECK(alloc->live == 0);  // every batch buffer was released
  }
  CHECK(live_threads() == 0);
}

namespace {
// Samples 4..7 (batch 1 at batch_size 4) wait until `open` is set.
struct Gated {
  std::shared_ptr<std::atomic<bool>> open = std::make_shared<std::atomic<bool>>(false);
  std::size_t size() const { return 20; }
  std::int64_t get(std::size_t i) const {
    if (i >= 4 && i < 8)
      while (!open->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return static_cast<std::int64_t>(i);
  }
};
}  // namespace

TEST_CASE("wait_poll interrupts a wait for a batch and loses nothing", "[lifecycle][interrupt]") {
  struct Case {
    const char* name;
    int workers;
    int timeout_ms;
    bool pin;
  };
  for (const Case c : {Case{"workers", 2, 0, false}, Case{"workers, timeout", 2, 10000, false}, Case{"no workers", 0, 0, false},
                       Case{"pin thread", 2, 0, true}, Case{"pin thread, no workers", 0, 0, true},
                       Case{"pin thread, timeout", 2, 10000, true}}) {
    DYNAMIC_SECTION(c.name) {
      Gated ds;
      std::atomic<int> polls{0};
      std::atomic<bool> interrupt{false};  // batch 0 is waited for without interruption
      DataLoaderOptions o;
      o.batch_size = 4;
      o.num_workers = c.workers;
      o.timeout = std::chrono::milliseconds(c.timeout_ms);
      o.wait_poll = [&] {
        ++polls;
        return interrupt.load();
      };
      o.wait_poll_period = std::chrono::milliseconds(5);
      if (c.pin) {
        o.pin_memory = true;
        PinnedPoolOptions po;
        po.backend = pageable_backend_for_tests();
        o.pinned_pool = std::make_shared<PinnedPool>(po);
      }
      DataLoader loader(ds, o);
      auto it = loader.begin();
      CHECK(it->item<std::int64_t>(0) == 0);
      // Batch 1 cannot come: the wait polls and gives up with Interrupted, more than once.
      interrupt = true;
      ++it;
      CHECK_THROWS_AS(*it, Interrupted);
      CHECK_THROWS_AS(*it, Interrupted);
      CHECK(polls.load() >= 2);
      CHECK(loader.state().batches == 1);  // a checkpoint now resumes at batch 1: none was taken
      interrupt = false;
      ds.open->store(true);
      std::vector<std::int64_t> firsts;
      for (; it != loader.end(); ++it) firsts.push_back(it->item<std::int64_t>(0));
      CHECK(firsts == std::vector<std::int64_t>{4, 8, 12, 16});  // nothing lost, in order
    }
  }
}

TEST_CASE("an interrupted epoch ends without waiting for the samples in the making", "[lifecycle][interrupt]") {
  // Ctrl-C in Python: the wait ends with Interrupted, then the iterator goes. Ending the epoch used
  // to wait for the sample in the making (28.5 s for a 30 s sample); now it abandons it (Note
  // [Abandoned workers]), and the sample's thread leaves when the sample returns.
  for (int workers : {0, 2}) {
    for (bool persistent : {false, true}) {
      if (persistent && workers == 0) continue;
      DYNAMIC_SECTION("num_workers " << workers << (persistent ? ", persistent" : "")) {
        Gated ds;  // batch 1 waits for the gate, which opens only at the end of the test
        DataLoaderOptions o;
        o.batch_size = 4;
        o.num_workers = workers;
        o.persistent_workers = persistent;
        std::atomic<bool> interrupt{false};
        o.wait_poll = [&] { return interrupt.load(); };
        o.wait_poll_period = std::chrono::milliseconds(5);
        std::chrono::steady_clock::duration ended{};
        {
          DataLoader loader(ds, o);
          std::optional<decltype(loader.begin())> it;
          it.emplace(loader.begin());
          CHECK((*it)->item<std::int64_t>(0) == 0);
          ++*it;
          interrupt = true;
          CHECK_THROWS_AS(**it, Interrupted);
          const auto t0 = std::chrono::steady_clock::now();
          it.reset();  // the iterator goes: the epoch ends
          ended = std::chrono::steady_clock::now() - t0;
          CHECK(loader.state().batches == 1);  // where it stopped: batch 1 was never taken
          interrupt = false;
        }
        CHECK(ended < std::chrono::seconds(10));  // the gate stays shut: waiting would never end
        ds.open->store(true);
        CHECK(eventually([] { return live_threads() == 0; }));
      }
    }
  }
}
