// ferry/core/distributed.h — a data-parallel process's place in its job, read from the launcher.
//
//   const ferry::DistributedEnv env = ferry::DistributedEnv::from_environment();  // torchrun, MPI or Slurm
//   ferry::DataLoaderOptions options;
//   options.batch_size = 256;
//   options.shuffle = true;
//   ferry::DataLoader loader(dataset, env.loader_options(dataset.size(), options));  // this rank's share, on its GPU
//
// The launchers people use are the distributed engine ferry runs under; ferry only reads what
// they set, in this order (torchrun inside a Slurm allocation is torchrun):
//   torchrun:     RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
//   Open MPI:     OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   MPICH, Hydra: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   Slurm:        SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (or the first
//                 count of SLURM_TASKS_PER_NODE)
// and none of them: one process (rank 0 of 1). A launcher's rank without its world size or local
// rank, a value that is not a number, or a rank outside its world is a ferry::Error naming the
// variables. Where a launcher leaves the local world size out, it is taken as local_rank + 1.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "ferry/core/options.h"
#include "ferry/core/sampler.h"

namespace ferry {

struct DistributedEnv {
  enum class Launcher : std::uint8_t { None, Torchrun, OpenMpi, Mpich, Slurm };
  Launcher launcher = Launcher::None;
  std::size_t rank = 0, world_size = 1;
  std::size_t local_rank = 0, local_world_size = 1;  ///< on this node: the GPU a rank feeds

  /// Reads this process's environment.
  static DistributedEnv from_environment();
  /// Reads the variables through `get` (nullptr when unset): tests, or a launcher's own table.
  static DistributedEnv from(const std::function<const char*(const char*)>& get);

  bool distributed() const noexcept { return world_size > 1; }
  /// "torchrun", "Open MPI", "MPICH", "Slurm" or "none".
  const char* launcher_name() const noexcept;
  /// "rank 3 of 8 (local 1 of 4, torchrun)".
  std::string str() const;

  /// This rank's DistributedSampler over n samples (PyTorch's split and padding).
  std::shared_ptr<DistributedSampler> sampler(std::size_t n, bool shuffle = true, std::uint64_t seed = 0,
                                              bool drop_last = false) const {
    return std::make_shared<DistributedSampler>(n, world_size, rank, shuffle, seed, drop_last);
  }
  /// `options` for this rank over a dataset of n samples: its DistributedSampler (taking the
  /// options' shuffle, seed and drop_last; shuffle is then cleared, as the sampler shuffles), and,
  /// unless the options name a device or `use_device` is false, device = local_rank.
  DataLoaderOptions loader_options(std::size_t n, DataLoaderOptions options = {}, bool use_device = true) const {
    if (options.sampler || options.batch_sampler)
      throw Error("DistributedEnv::loader_options: the options already have a sampler; this makes the DistributedSampler");
    options.sampler = sampler(n, options.shuffle, options.seed, options.drop_last);
    options.shuffle = false;
    if (use_device && !options.device) options.device = static_cast<int>(local_rank);
    return options;
  }
};

}  // namespace ferry
