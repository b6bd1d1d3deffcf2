// Tests that Tensor and Storage share bytes through views, check their arguments and say what
// was wrong when they refuse.
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "ferry/ferry.h"

using namespace ferry;

TEST_CASE("tensor basics: shape, numel, dtype sizes", "[unit][tensor]") {
  Tensor t = Tensor::zeros(DType::Float32, {4, 3, 2});
  CHECK(t.dim() == 3);
  CHECK(t.numel() == 24);
  CHECK(t.nbytes() == 96);
  CHECK(t.size(-1) == 2);
  CHECK(t.device() == Device::host());
  CHECK_FALSE(t.is_pinned());
  CHECK(t.data<float>()[23] == 0.0f);
  CHECK(itemsize(DType::BFloat16) == 2);
  CHECK(itemsize(DType::Float64) == 8);
  CHECK(std::string(dtype_name(DType::UInt8)) == "uint8");
  CHECK(t.str() == "Tensor(float32, [4, 3, 2], cpu)");
  CHECK(Device::cuda(1).str() == "cuda:1");
  CHECK_FALSE(Tensor().defined());
}

TEST_CASE("select and narrow are views sharing storage", "[unit][tensor]") {
  std::vector<std::int32_t> v(12);
  for (int i = 0; i < 12; ++i) v[i] = i;
  Tensor t = Tensor::from(v, {4, 3});
  Tensor row = t.select(2);
  CHECK(row.shape() == Shape{3});
  CHECK(row.item<std::int32_t>(0) == 6);
  row.data<std::int32_t>()[1] = 100;
  CHECK(t.item<std::int32_t>(7) == 100);  // wrote through the view
  Tensor mid = t.narrow(1, 2);
  CHECK(mid.shape() == Shape{2, 3});
  CHECK(mid.item<std::int32_t>(0) == 3);
  CHECK(mid.storage().data() == t.storage().data());
  CHECK(t.reshape({3, 4}).item<std::int32_t>(4) == 4);
  Tensor c = t.clone();
  CHECK(c.equal(t));
  c.data<std::int32_t>()[0] = -1;
  CHECK_FALSE(c.equal(t));
}

TEST_CASE("views keep storage alive after the parent is gone", "[unit][tensor]") {
  Tensor row;
  std::weak_ptr<void> owner;
  {
    Tensor t = Tensor::zeros(DType::Int64, {8, 2});
    owner = t.storage().owner();
    row = t.select(7);
  }
  CHECK_FALSE(owner.expired());
  row = Tensor();
  CHECK(owner.expired());
}

TEST_CASE("bad tensor arguments raise errors naming the problem", "[unit][tensor][errors]") {
  Tensor t = Tensor::zeros(DType::UInt8, {4, 5});
  CHECK_THROWS_WITH(t.select(4), Catch::Contains("index 4 out of range for shape [4, 5]"));
  CHECK_THROWS_WITH(t.narrow(3, 2), Catch::Contains("rows [3, 5) out of range"));
  CHECK_THROWS_WITH(t.reshape({3, 3}), Catch::Contains("cannot view [4, 5] as [3, 3]"));
  CHECK_THROWS_WITH(t.data<float>(), Catch::Contains("asked for float32 elements of a Tensor(uint8"));
  CHECK_THROWS_WITH(Tensor(Storage::allocate(10), DType::Float32, {3}), Catch::Contains("needs 12 bytes but the storage has 10"));
  CHECK_THROWS_WITH(Tensor::empty(DType::Float32, {2, -1}), Catch::Contains("negative dimension"));
  CHECK_THROWS_WITH(t.size(2), Catch::Contains("dimension 2 out of range"));
  CHECK_THROWS_AS(Tensor::scalar(1.0).select(0), Error);
}

TEST_CASE("the empty() of an allocator takes its memory from it", "[unit][tensor]") {
  struct Fixed final : BatchAllocator {
    int calls = 0;
    Storage allocate(std::size_t n) override {
      ++calls;
      return Storage::allocate(n);
    }
  } alloc;
  Tensor t = empty(DType::Float64, {3, 3}, alloc);
  CHECK(alloc.calls == 1);
  CHECK(t.nbytes() == 72);
  CHECK(reinterpret_cast<std::uintptr_t>(t.raw()) % 64 == 0);
}

TEST_CASE("host storage is 64-byte aligned and its own at every size, small blocks kept and used again", "[unit][tensor]") {
  // Sizes around the small-block classes (1 to 32 KiB) and past them.
  const std::size_t sizes[] = {0, 1, 63, 960, 961, 1024, 1025, 2048, 2049, 16384, 32767, 32768, 32769, std::size_t{1} << 20};
  for (int round = 0; round < 3; ++round) {
    std::vector<Storage> live;
    for (std::size_t n : sizes) {
      Storage s = Storage::allocate(n);
      INFO(n << " bytes");
      CHECK(reinterpret_cast<std::uintptr_t>(s.data()) % 64 == 0);
      CHECK(s.nbytes() == n);
      CHECK(s.device() == Device::host());
      if (n) std::memset(s.data(), static_cast<int>(n & 0xff), n);  // every byte writable (ASan checks the bounds)
      live.push_back(std::move(s));
    }
    // No two live storages overlap, and each kept its bytes.
    for (std::size_t i = 0; i < live.size(); ++i) {
      const auto* a = reinterpret_cast<const unsigned char*>(live[i].data());
      if (live[i].nbytes()) CHECK(a[live[i].nbytes() - 1] == static_cast<unsigned char>(live[i].nbytes() & 0xff));
      for (std::size_t j = i + 1; j < live.size(); ++j) {
        const auto* b = reinterpret_cast<const unsigned char*>(live[j].data());
        CHECK((a + live[i].nbytes() <= b || b + live[j].nbytes() <= a));
      }
    }
  }
  // A view keeps a small block alive after its storage is dropped; a block dropped is used again.
  Tensor keep;
  {
    Tensor t = Tensor::empty(DType::Int64, {256});
    t.data<std::int64_t>()[255] = 42;
    keep = t.narrow(255, 1);
  }
  std::vector<Tensor> others;
  for (int k = 0; k < 64; ++k) others.push_back(Tensor::empty(DType::Int64, {256}));  // may reuse freed blocks, never keep's
  CHECK(keep.data<std::int64_t>()[0] == 42);
}

TEST_CASE("a fork while other threads allocate small host blocks leaves the child able to allocate", "[unit][tensor][fork]") {
#if defined(__SANITIZE_THREAD__)
  WARN("skipped under ThreadSanitizer: its runtime supports fork() in a process of several threads only in part");
  return;
#endif
  std::atomic<bool> stop{false};
  std::vector<std::thread> hammers;
  struct Joined {  // on every way out, a failed REQUIRE's too
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~Joined() {
      stop = true;
      for (std::thread& t : threads) t.join();
    }
  } joined{stop, hammers};
  for (int k = 0; k < 3; ++k)
    hammers.emplace_back([&stop] {
      while (!stop.load(std::memory_order_relaxed)) {
        Storage a = Storage::allocate(2048);
        Storage b = Storage::allocate(5000);
      }
    });
  int hung = 0, failed = 0;
  for (int k = 0; k < 200; ++k) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::alarm(2);  // a lock left held by the fork: the child never gets its block
      Storage a = Storage::allocate(2048);
      Storage b = Storage::allocate(5000);
      ::_exit(a.data() && b.data() ? 0 : 1);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (WIFSIGNALED(status))
      ++hung;
    else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      ++failed;
    if (hung + failed > 0) break;  // one is enough (and a hang costs its 2 s)
  }
  CHECK(hung == 0);
  CHECK(failed == 0);
}
