// dist_epoch: one rank of a data-parallel job (torchrun --no-python, mpirun, srun, or alone),
// checking that ferry's loaders of all ranks together deliver each epoch exactly as PyTorch's
// DistributedSampler splits it. Each rank loads its share onto GPU local_rank; NCCL all-gathers
// every sample id delivered; every rank checks the whole: with drop_last each sample at most once
// and the dropped tail PyTorch's; without, every sample, plus exactly PyTorch's padding repeats.
// Pinned blocks and device buffers are recycled, never freed, and never more than the pipeline's
// depth allows (pipeline_depth.h). Exit 0 when all holds, 1 when not,
// 77 without a GPU (CTest's skip; a failure under FERRY_REQUIRE_GPU=1).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "ferry/ferry.h"
#include "pipeline_depth.h"
#include "rendezvous.h"

namespace {
int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}
void nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}
}  // namespace

int main() {
  using namespace ferry;
  if (!cuda::available()) {
    const char* req = std::getenv("FERRY_REQUIRE_GPU");
    std::printf("dist_epoch: no GPU (%s)\n", cuda::unavailable_reason().c_str());
    return req && std::string(req) == "1" ? 1 : 77;
  }
  try {
    const DistributedEnv env = DistributedEnv::from_environment();
    const int rank = static_cast<int>(env.rank), world = static_cast<int>(env.world_size);
    const int device = static_cast<int>(env.local_rank);
    if (device >= cuda::device_count()) throw Error(env.str() + ": no CUDA device " + std::to_string(device));
    cudaSetDevice(device);
    ncclUniqueId id{};
    if (rank == 0) nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    ddp::exchange(&id, sizeof id, rank, world);
    ncclComm_t comm = nullptr;
    nccl(ncclCommInitRank(&comm, world, id, rank), "ncclCommInitRank");

    const std::int64_t n = 10007;  // prime: every world size pads or drops
    Tensor ids = Tensor::empty(DType::Int64, {n});
    for (std::int64_t i = 0; i < n; ++i) ids.data<std::int64_t>()[i] = i;
    TensorDataset ds({ids});
    for (bool drop_last : {false, true}) {
      DataLoaderOptions o;
      o.batch_size = 64;
      o.shuffle = true;
      o.seed = 5;
      o.drop_last = drop_last;
      o.num_workers = 3;
      o.persistent_workers = true;
      DataLoader loader(ds, env.loader_options(static_cast<std::size_t>(n), o));
      std::uint64_t host_allocs = 0, device_allocs = 0;
      for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
        std::vector<std::int64_t> mine;
        for (auto& b : loader) {
          check(b[0].device().index == device, "batch on cuda:" + std::to_string(device));
          const Tensor h = to_host(b[0], *loader.stream()).get();
          mine.insert(mine.end(), h.data<std::int64_t>(), h.data<std::int64_t>() + h.size(0));
        }
        // All ranks' ids, gathered on the GPU (shares are equal: PyTorch's split).
        const std::size_t count = mine.size();
        std::int64_t *send = nullptr, *recv = nullptr;
        cudaMalloc(&send, std::max<std::size_t>(count, 1) * 8);
        cudaMalloc(&recv, std::max<std::size_t>(count, 1) * 8 * static_cast<std::size_t>(world));
        cudaMemcpy(send, mine.data(), count * 8, cudaMemcpyHostToDevice);
        cudaStream_t s = static_cast<cudaStream_t>(loader.stream()->native());
        nccl(ncclAllGather(send, recv, count, ncclInt64, comm, s), "ncclAllGather");
        std::vector<std::int64_t> all(count * static_cast<std::size_t>(world));
        cudaMemcpyAsync(all.data(), recv, all.size() * 8, cudaMemcpyDeviceToHost, s);
        cudaStreamSynchronize(s);
        cudaFree(send);
        cudaFree(recv);
        // What PyTorch's DistributedSampler gives the ranks (the loader's drop_last also drops
        // each rank's partial last batch).
        std::map<std::int64_t, int> want, got;
        for (int r = 0; r < world; ++r) {
          std::vector<std::size_t> w = DistributedSampler(static_cast<std::size_t>(n), static_cast<std::size_t>(world),
                                                          static_cast<std::size_t>(r), true, 5, drop_last)
                                           .indices(epoch);
          if (drop_last) w.resize(w.size() / 64 * 64);
          for (std::size_t i : w) ++want[static_cast<std::int64_t>(i)];
        }
        for (std::int64_t i : all) ++got[i];
        const std::string what = "epoch " + std::to_string(epoch) + (drop_last ? ", drop_last" : ", padded");
        check(got == want, what + ": the ranks' ids are PyTorch's split");
        std::size_t repeats = 0;
        for (auto& [i, c] : got) repeats += static_cast<std::size_t>(c - 1);
        if (drop_last)
          check(repeats == 0, what + ": no sample twice");
        else
          check(got.size() == static_cast<std::size_t>(n), what + ": every sample delivered");
        if (epoch == 0) {
          host_allocs = loader.pinned_pool()->stats().allocations;
          device_allocs = loader.device_stage()->stats().device_allocations;
        } else {
          const PinnedPoolStats pool = loader.pinned_pool()->stats();
          check(pool.allocations >= host_allocs && pool.frees == 0 && pool.blocks <= test::max_pinned_blocks(o, 1),
                what + ": pinned blocks recycled, within the pipeline's depth (" + std::to_string(pool.blocks) + " blocks, " +
                    std::to_string(pool.allocations - host_allocs) + " more than after the first epoch)");
          const std::uint64_t d = loader.device_stage()->stats().device_allocations;
          check(d >= device_allocs && d <= test::max_device_buffers(o, test::gather_depth(o, 64 * 8)),  // int64 ids, gathered
                what + ": device buffers recycled, within the pipeline's depth (" + std::to_string(d) + " allocated)");
        }
        if (rank == 0)
          std::printf("dist_epoch: %s, %d ranks: %zu ids gathered, %zu distinct, %zu repeats, numa node %d\n", what.c_str(),
                      world, all.size(), got.size(), repeats, loader.stats().numa_node);
      }
    }
    ncclCommDestroy(comm);
    std::printf("dist_epoch rank %d (%s, cuda:%d): %s\n", rank, env.str().c_str(), device, failures ? "FAILED" : "passed");
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_epoch: %s\n", e.what());
    return 1;
  }
}
