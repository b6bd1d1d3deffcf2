// Tests the pinned pool's lifecycle on a CPU-only machine (test backend + manual fences): a block
// whose fence is closed is never handed out, the byte budget holds (waiting, or refusing a batch
// that can never fit), sizes are exact, and nothing is allocated after warm-up.
#include <catch2/catch.hpp>

#include <thread>

#include <unistd.h>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;
using test::eventually;

namespace {
// A backend that counts live blocks, so a leak fails the test.
struct CountingBackend final : HostBackend {
  std::shared_ptr<HostBackend> inner = pageable_backend_for_tests();
  std::atomic<long> live{0};
  void* allocate(std::size_t b) override {
    ++live;
    return inner->allocate(b);
  }
  void free(void* p, std::size_t b) noexcept override {
    --live;
    inner->free(p, b);
  }
  Device device() const noexcept override { return Device::pinned(); }
};

PinnedPoolOptions options(std::size_t limit, std::shared_ptr<HostBackend> backend = nullptr) {
  PinnedPoolOptions o;
  o.limit_bytes = limit;
  o.backend = backend ? backend : std::shared_ptr<HostBackend>(pageable_backend_for_tests());
  return o;
}
}  // namespace

TEST_CASE("a block whose fence is closed is never handed out again", "[unit][pool]") {
  PinnedPool pool(options(1 << 20));
  auto fence = std::make_shared<ManualFence>();
  std::byte* first = nullptr;
  {
    Storage s = pool.allocate(1000);
    first = s.data();
    CHECK(s.device() == Device::pinned());
    pool.add_fence(s, fence);
  }  // the host let go; the device (fence) has not
  for (int i = 0; i < 10; ++i) {
    Storage other = pool.allocate(1000);
    CHECK(other.data() != first);
  }
  fence->open();
  // Reusable once the fence completed: two leases now need no new block, and one of them is it.
  Storage again = pool.allocate(1000), second = pool.allocate(1000);
  CHECK((again.data() == first || second.data() == first));
  CHECK(pool.stats().allocations == 2);
}

TEST_CASE("at the budget, allocate waits for the fence, then reuses the block", "[unit][pool]") {
  PinnedPool pool(options(4096));
  auto fence = std::make_shared<ManualFence>();
  {
    Storage s = pool.allocate(4096);
    pool.add_fence(s, fence);
  }
  std::atomic<bool> got{false};
  std::thread t([&] {
    Storage s = pool.allocate(4000);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(got.load());  // still waiting: the only block is fenced and the budget is full
  fence->open();
  t.join();
  CHECK(got.load());
  auto st = pool.stats();
  CHECK(st.allocations == 1);
  CHECK(st.waits == 1);
  CHECK(st.fence_waits >= 1);
}

TEST_CASE("at the budget, allocate waits for a lease to come back", "[unit][pool]") {
  PinnedPool pool(options(8192));
  auto held = std::make_unique<Storage>(pool.allocate(8192));
  std::atomic<bool> got{false};
  std::thread t([&] {
    Storage s = pool.allocate(8000);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(got.load());
  held.reset();
  t.join();
  CHECK(got.load());
}

TEST_CASE("a batch larger than the budget is an error saying so", "[unit][pool][errors]") {
  PinnedPool pool(options(1000));
  CHECK_THROWS_WITH(pool.allocate(1001),
                    Catch::Contains("needs 1001 bytes") && Catch::Contains("pinned_memory_limit is 1000 bytes"));
  CHECK_THROWS_WITH(pool.add_fence(Storage::allocate(10), std::make_shared<ReadyFence>()),
                    Catch::Contains("not allocated by this pool"));
}

TEST_CASE("blocks are sized exactly and reused for requests of at least half their size", "[unit][pool]") {
  PinnedPool pool(options(1 << 20));
  std::byte* p = nullptr;
  {
    Storage s = pool.allocate(1000);
    p = s.data();
  }
  CHECK(pool.stats().bytes_pinned == 1000);  // no power-of-two rounding
  {
    Storage s = pool.allocate(600);
    CHECK(s.data() == p);
    CHECK(s.nbytes() == 600);
  }
  Storage small = pool.allocate(400);  // under half: a new exact block
  CHECK(small.data() != p);
  CHECK(pool.stats().bytes_pinned == 1400);
}

TEST_CASE("over budget, free blocks of the wrong size are given back to make room", "[unit][pool]") {
  auto backend = std::make_shared<CountingBackend>();
  PinnedPool pool(options(10000, backend));
  { Storage a = pool.allocate(3000); }
  Storage b = pool.allocate(9000);  // 3000 + 9000 > 10000: the free 3000-byte block goes
  CHECK(backend->live == 1);
  CHECK(pool.stats().frees == 1);
}

TEST_CASE("after warm-up the pool allocates nothing", "[unit][pool]") {
  PinnedPool pool(options(64 << 20));
  std::vector<Storage> in_flight;
  for (int i = 0; i < 1000; ++i) {
    in_flight.push_back(pool.allocate(1 << 20));
    if (in_flight.size() > 4) in_flight.erase(in_flight.begin());
  }
  auto st = pool.stats();
  CHECK(st.allocations == 5);
  CHECK(st.leases == 1000);
}

TEST_CASE("the pool's memory lives until the last storage and its fences are done", "[unit][pool][shutdown]") {
  auto backend = std::make_shared<CountingBackend>();
  Storage survivor;
  auto fence = std::make_shared<ManualFence>();
  {
    PinnedPool pool(options(1 << 20, backend));
    survivor = pool.allocate(100);
    Storage fenced = pool.allocate(100);
    pool.add_fence(fenced, fence);
  }
  CHECK(backend->live == 2);  // the pool object is gone, its blocks are not
  fence->open();
  survivor = Storage();
  CHECK(backend->live == 0);
}

TEST_CASE("without a CUDA device a CUDA-backed pool is a clear error", "[unit][pool][errors]") {
  if (cuda::available()) return;  // covered by the GPU suite
  CHECK_THROWS_WITH(PinnedPool(), Catch::Contains("cannot pin memory without a CUDA device"));
  CHECK_FALSE(cuda::unavailable_reason().empty());
  CHECK(cuda::device_count() == 0);
  CHECK_THROWS_AS(cuda::Stream::create(0), CudaError);
}

TEST_CASE("a pool without a hard limit allocates past its budget and trims back to it", "[unit][pool]") {
  auto backend = std::make_shared<CountingBackend>();
  PinnedPoolOptions o = options(1000, backend);
  o.hard_limit = false;
  PinnedPool pool(o);
  {
    std::vector<Storage> held;
    for (int i = 0; i < 5; ++i) held.push_back(pool.allocate(400));  // 2000 bytes: no wait
    CHECK(pool.stats().bytes_pinned == 2000);
    CHECK(pool.stats().waits == 0);
  }
  // Every block came back; the pool kept no more than its budget.
  CHECK(pool.stats().bytes_pinned <= 1000);
  CHECK(backend->live == static_cast<long>(pool.stats().blocks));
  CHECK(pool.stats().blocks == 2);
  Storage big = pool.allocate(5000);  // larger than the budget: served, then not kept
  CHECK(big.nbytes() == 5000);
  big = Storage();
  CHECK(pool.stats().bytes_pinned <= 1000);
}

// GPU decode's fences are deferred (Note [Decode threads] in pinning/gpu_decode.cu): the thread
// that ends a batch hands out the fence before a decode thread has recorded its event.
TEST_CASE("a deferred event fence is not ready, and its error waits, until the recording thread says so", "[unit][fence]") {
  auto f = EventFence::deferred(cuda::Event{});
  CHECK_FALSE(f->ready());  // never asks CUDA before the record: no device needed here
  std::atomic<bool> got{false};
  std::string what;
  std::thread waiter([&] {
    try {
      if (std::exception_ptr e = f->error()) std::rethrow_exception(e);
    } catch (const DataError& e) {
      what = e.what();
    }
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK_FALSE(got.load());  // error() blocks until recorded()
  f->recorded(std::make_exception_ptr(
      DataError("GPU decode", DataError::kNoOffset, "image 3 of the batch is a JPEG nvJPEG cannot decode")));
  waiter.join();
  CHECK(got.load());
  CHECK_THAT(what, Catch::Contains("image 3 of the batch"));
  // A fence recorded at construction has no error and does not wait.
  EventFence plain{cuda::Event{}};
  CHECK_FALSE(plain.error());
}

TEST_CASE("without a GPU driver, CUDA's unavailability says so, not that a driver is too old", "[unit][cuda]") {
  if (cuda::available() || access("/proc/driver/nvidia/version", F_OK) == 0) return;  // a driver is here
  const std::string why = cuda::unavailable_reason();
  INFO(why);
  CHECK((why.find("no NVIDIA GPU driver on this machine") != std::string::npos || why == "ferry was built without CUDA"));
}

TEST_CASE("try_allocate never waits for a lease: it answers empty where allocate would wait", "[unit][pool]") {
  PinnedPool pool(options(4096));
  Storage held = pool.allocate(4096);
  CHECK_FALSE(pool.try_allocate(1000));  // the budget is held by a lease: no wait, no block
  CHECK_FALSE(pool.try_allocate(8192));  // over the budget: empty, not an Error
  CHECK(pool.stats().allocations == 1);
  std::byte* first = held.data();
  auto fence = std::make_shared<ManualFence>();
  pool.add_fence(held, fence);
  held = {};
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    fence->open();
  });
  Storage again = pool.try_allocate(4096, false);  // a pending block: it waits for the fence, then reuses it
  opener.join();
  REQUIRE(again);
  CHECK(again.data() == first);
  CHECK(pool.stats().allocations == 1);
}

TEST_CASE("try_allocate without may_allocate reuses a block and never makes one", "[unit][pool]") {
  PinnedPool pool(options(1 << 20));
  CHECK_FALSE(pool.try_allocate(1000, false));  // nothing to reuse
  CHECK(pool.stats().allocations == 0);
  std::byte* first = pool.try_allocate(1000).data();  // made, then back (no fence)
  CHECK(pool.stats().allocations == 1);
  CHECK(pool.try_allocate(900, false).data() == first);
  CHECK_FALSE(pool.try_allocate(100, false));  // the free block is too large for it, and none is made
  CHECK(pool.stats().allocations == 1);
}

TEST_CASE("release_free_below gives back only free blocks smaller than asked", "[unit][pool]") {
  PinnedPool pool(options(1 << 20));
  auto fence = std::make_shared<ManualFence>();
  Storage held = pool.allocate(100);
  {
    Storage pending = pool.allocate(200);
    pool.add_fence(pending, fence);
  }
  { Storage small = pool.allocate(300), large = pool.allocate(5000); }  // both free now
  CHECK(pool.release_free_below(1000) == 1);  // the free 300: not the held 100, the pending 200 or the 5000
  CHECK(pool.stats().blocks == 3);
  fence->open();
  CHECK(pool.release_free_below(1000) == 1);  // the 200, its fence done
  CHECK(pool.stats().frees == 2);
}
