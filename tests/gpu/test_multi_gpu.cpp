// Several GPUs in one process (issue: one loader per device, each with its own pinned pool,
// copy stream and threads): two DistributedSampler ranks on cuda:0 and cuda:1 consumed on two
// threads at once deliver exactly PyTorch's split; pinned and device memory are recycled within the
// pipeline's depth on both (tests/gpu/pipeline_depth.h); the
// loaders stop in either order, mid-epoch, with batches still held. Needs two devices: CTest's
// test_gpu_multi reports these cases skipped on one (exit 77), or failed under FERRY_REQUIRE_GPUS=2
// (scripts/gpu.sh multi); run without their devices any other way, they fail.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <thread>

#include "ferry/ferry.h"
#include "pipeline_depth.h"

using namespace ferry;

namespace {

// The cases run under CTest's test_gpu_multi, which reports them skipped on a host of one device
// (gpu_main.cpp's --needs-gpus); run without their devices, they fail.
bool two_gpus() {
  if (cuda::device_count() >= 2) return true;
  FAIL("needs 2 CUDA devices, this host has " << cuda::device_count() << " (CTest's test_gpu_multi skips it there)");
  return false;
}

// Sample i: its id, and 4 KiB of bytes that depend on it (checked after the round trip).
TensorDataset id_dataset(std::int64_t n) {
  Tensor ids = Tensor::empty(DType::Int64, {n});
  Tensor rows = Tensor::empty(DType::UInt8, {n, 4096});
  for (std::int64_t i = 0; i < n; ++i) {
    ids.data<std::int64_t>()[i] = i;
    for (int k = 0; k < 4096; ++k) rows.data<std::uint8_t>()[i * 4096 + k] = static_cast<std::uint8_t>(i * 31 + k);
  }
  return TensorDataset({ids, rows});
}

DistributedEnv rank_env(std::size_t rank) {
  DistributedEnv e;
  e.rank = e.local_rank = rank;
  e.world_size = e.local_world_size = 2;
  return e;
}

// One epoch of `loader` on this thread: the ids delivered, in order, checked against their rows.
std::vector<std::int64_t> consume(DataLoader<TensorDataset>& loader, int device, int* bad, std::size_t stop_after = SIZE_MAX) {
  std::vector<std::int64_t> ids;
  std::size_t n = 0;
  for (auto& b : loader) {
    if (b[0].device().kind != MemoryKind::Device || b[0].device().index != device) ++*bad;
    const Tensor id = to_host(b[0], *loader.stream()).get();
    const Tensor rows = to_host(b[1], *loader.stream()).get();
    for (std::int64_t r = 0; r < id.size(0); ++r) {
      const std::int64_t i = id.data<std::int64_t>()[r];
      ids.push_back(i);
      for (int k = 0; k < 4096; k += 511)
        if (rows.data<std::uint8_t>()[r * 4096 + k] != static_cast<std::uint8_t>(i * 31 + k)) ++*bad;
    }
    if (++n == stop_after) break;
  }
  return ids;
}

}  // namespace

TEST_CASE("two loaders in one process feed two GPUs with PyTorch's split, memory recycled", "[gpu][multi]") {
  if (!two_gpus()) return;
  const std::int64_t n = 1001;
  TensorDataset ds = id_dataset(n);
  for (bool drop_last : {false, true}) {
    DataLoaderOptions o;
    o.batch_size = 32;
    o.shuffle = true;
    o.seed = 11;
    o.drop_last = drop_last;
    o.num_workers = 2;
    o.persistent_workers = true;
    std::vector<std::unique_ptr<DataLoader<TensorDataset>>> loaders;
    for (std::size_t r = 0; r < 2; ++r)
      loaders.push_back(std::make_unique<DataLoader<TensorDataset>>(ds, rank_env(r).loader_options(n, o)));
    std::uint64_t host_allocs[2] = {}, device_allocs[2] = {};
    for (int epoch = 0; epoch < 3; ++epoch) {
      std::vector<std::int64_t> got[2];
      int bad[2] = {0, 0};
      std::thread t0([&] { got[0] = consume(*loaders[0], 0, &bad[0]); });
      std::thread t1([&] { got[1] = consume(*loaders[1], 1, &bad[1]); });
      t0.join();
      t1.join();
      CHECK(bad[0] == 0);
      CHECK(bad[1] == 0);
      std::map<std::int64_t, int> count;
      for (int r = 0; r < 2; ++r) {
        // Each rank delivers exactly its DistributedSampler's order for the epoch...
        const DistributedSampler s(static_cast<std::size_t>(n), 2, static_cast<std::size_t>(r), true, 11, drop_last);
        const std::vector<std::size_t> want = s.indices(static_cast<std::uint64_t>(epoch));
        std::vector<std::int64_t> w(want.begin(), want.end());
        if (drop_last) w.resize(w.size() / 32 * 32);  // the loader's drop_last also drops a partial batch
        CHECK(got[r] == w);
        for (std::int64_t i : got[r]) ++count[i];
      }
      // ... and together they cover the epoch: once each, plus PyTorch's one padded repeat.
      std::size_t twice = 0;
      for (auto& [i, c] : count) twice += c == 2;
      if (!drop_last) {
        CHECK(count.size() == static_cast<std::size_t>(n));
        CHECK(twice == 1);  // 1001 over 2 ranks: 501 each, one sample repeated
      } else {
        CHECK(twice == 0);
      }
      for (int r = 0; r < 2; ++r) {
        if (epoch == 0) {
          host_allocs[r] = loaders[static_cast<std::size_t>(r)]->pinned_pool()->stats().allocations;
          device_allocs[r] = loaders[static_cast<std::size_t>(r)]->device_stage()->stats().device_allocations;
        } else {
          // Pinned blocks and device buffers: recycled, never freed, never more than the pipeline's
          // depth allows (one block a field a batch on the host path, one index block on the gather).
          const PinnedPoolStats pool = loaders[static_cast<std::size_t>(r)]->pinned_pool()->stats();
          CHECK(pool.allocations >= host_allocs[r]);
          CHECK(pool.frees == 0);
          CHECK(pool.blocks <= test::max_pinned_blocks(o, 2));
          const std::uint64_t d = loaders[static_cast<std::size_t>(r)]->device_stage()->stats().device_allocations;
          CHECK(d >= device_allocs[r]);
          CHECK(d <= test::max_device_buffers(o, test::gather_depth(o, 32 * (8 + 4096))));  // gathered
        }
        // Where the loader sits: its device's NUMA node, or nowhere on a one-node host.
        const detail::Placement p = detail::placement_for_device(r);
        CHECK(loaders[static_cast<std::size_t>(r)]->stats().numa_node == (p.placed() ? p.node : -1));
      }
    }
  }
}

TEST_CASE("two GPUs' loaders stop in either order mid-epoch, with batches still held", "[gpu][multi]") {
  if (!two_gpus()) return;
  const std::int64_t n = 2048;
  TensorDataset ds = id_dataset(n);
  const std::size_t threads_before = live_threads();
  for (bool first_zero : {true, false}) {
    DataLoaderOptions o;
    o.batch_size = 64;
    o.shuffle = true;
    o.num_workers = 3;
    auto a = std::make_unique<DataLoader<TensorDataset>>(ds, rank_env(0).loader_options(n, o));
    auto b = std::make_unique<DataLoader<TensorDataset>>(ds, rank_env(1).loader_options(n, o));
    std::vector<Tensor> held;
    {
      auto it_a = a->begin();
      auto it_b = b->begin();
      held.push_back((*it_a)[1]);
      held.push_back((*it_b)[1]);
      ++it_a;
      ++it_b;
    }  // mid-epoch: workers busy, batches in flight on both devices
    if (first_zero) {
      a.reset();
      b.reset();
    } else {
      b.reset();
      a.reset();
    }
    // The held batches outlive their loaders and are still intact.
    for (std::size_t k = 0; k < 2; ++k) {
      const Tensor h = to_host(held[k], cuda::Stream::create(static_cast<int>(k))).get();
      CHECK(h.size(0) == 64);
    }
    held.clear();
  }
  CHECK(live_threads() == threads_before);
}

TEST_CASE("one pinned pool may feed loaders on two GPUs", "[gpu][multi]") {
  if (!two_gpus()) return;
  const std::int64_t n = 512;
  TensorDataset ds = id_dataset(n);
  auto pool = std::make_shared<PinnedPool>(PinnedPoolOptions{});
  DataLoaderOptions o;
  o.batch_size = 64;
  o.num_workers = 1;
  o.pinned_pool = pool;
  DataLoader<TensorDataset> a(ds, rank_env(0).loader_options(n, o)), b(ds, rank_env(1).loader_options(n, o));
  int bad = 0;
  const auto ga = consume(a, 0, &bad), gb = consume(b, 1, &bad);
  CHECK(bad == 0);
  CHECK(ga.size() + gb.size() == static_cast<std::size_t>(n));
}
