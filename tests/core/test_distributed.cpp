// The launchers' environments (torchrun, Open MPI, MPICH, Slurm) read into DistributedEnv, the
// inconsistent ones refused by name, and the ranks' shares of an epoch: for world sizes 1-8 and
// both drop_last settings, PyTorch's split (each sample once, plus its padding repeats).
#include <catch2/catch.hpp>

#include <map>

#include "ferry/ferry.h"

using namespace ferry;

namespace {
DistributedEnv env_of(const std::map<std::string, std::string>& vars) {
  return DistributedEnv::from([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST_CASE("each launcher's environment gives rank, world size and local rank", "[unit][distributed]") {
  const DistributedEnv none = env_of({});
  CHECK(none.launcher == DistributedEnv::Launcher::None);
  CHECK_FALSE(none.distributed());
  CHECK(none.rank == 0);
  CHECK(none.world_size == 1);
  const DistributedEnv t = env_of({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}});
  CHECK(t.launcher == DistributedEnv::Launcher::Torchrun);
  CHECK(t.str() == "rank 5 of 8 (local 1 of 4, torchrun)");
  const DistributedEnv o = env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                   {"OMPI_COMM_WORLD_SIZE", "4"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK(o.launcher == DistributedEnv::Launcher::OpenMpi);
  CHECK((o.rank == 2 && o.world_size == 4 && o.local_rank == 0 && o.local_world_size == 2));
  const DistributedEnv m = env_of({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  CHECK(m.launcher == DistributedEnv::Launcher::Mpich);
  CHECK(m.local_rank == 1);
  const DistributedEnv s =
      env_of({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "3"}, {"SLURM_TASKS_PER_NODE", "4(x2)"}});
  CHECK(s.launcher == DistributedEnv::Launcher::Slurm);
  CHECK((s.rank == 7 && s.world_size == 8 && s.local_rank == 3 && s.local_world_size == 4));
  // torchrun inside a Slurm allocation is torchrun.
  const DistributedEnv both = env_of({{"RANK", "0"},
                                      {"WORLD_SIZE", "2"},
                                      {"LOCAL_RANK", "0"},
                                      {"SLURM_PROCID", "0"},
                                      {"SLURM_NTASKS", "1"},
                                      {"SLURM_LOCALID", "0"}});
  CHECK(both.launcher == DistributedEnv::Launcher::Torchrun);
  CHECK(both.world_size == 2);
  CHECK(both.local_world_size == 1);  // not given: local_rank + 1
}

TEST_CASE("an inconsistent launcher environment is an error naming the variables", "[unit][distributed][errors]") {
  CHECK_THROWS_WITH(env_of({{"RANK", "0"}}), Catch::Contains("torchrun set RANK but not WORLD_SIZE"));
  CHECK_THROWS_WITH(env_of({{"WORLD_SIZE", "2"}}), Catch::Contains("set WORLD_SIZE but not RANK"));
  CHECK_THROWS_WITH(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}), Catch::Contains("not the local rank LOCAL_RANK"));
  CHECK_THROWS_WITH(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
                    Catch::Contains("rank 2 (RANK) is not below its world size 2 (WORLD_SIZE)"));
  CHECK_THROWS_WITH(env_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
                    Catch::Contains("RANK is 'x', not a number"));
  CHECK_THROWS_WITH(env_of({{"RANK", "0"}, {"WORLD_SIZE", "0"}, {"LOCAL_RANK", "0"}}), Catch::Contains("WORLD_SIZE is 0"));
  CHECK_THROWS_WITH(env_of({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
                    Catch::Contains("local rank 2 (LOCAL_RANK) and local world size 2"));
  CHECK_THROWS_WITH(env_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}),
                    Catch::Contains("Open MPI's rank 3"));
  CHECK_THROWS_WITH(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}),
                    Catch::Contains("Slurm set SLURM_PROCID but not the local rank SLURM_LOCALID"));
}

TEST_CASE("for world sizes 1 to 8 the ranks' shares partition the epoch as PyTorch's DistributedSampler", "[unit][distributed]") {
  for (std::size_t n : {0u, 1u, 7u, 100u, 101u})
    for (std::size_t world = 1; world <= 8; ++world)
      for (bool drop_last : {false, true}) {
        INFO("n " << n << ", world " << world << (drop_last ? ", drop_last" : ""));
        std::map<std::size_t, int> seen;
        std::size_t per_rank = 0;
        for (std::size_t rank = 0; rank < world; ++rank) {
          DistributedEnv env;
          env.rank = rank;
          env.world_size = world;
          DataLoaderOptions o;
          o.shuffle = true;
          o.seed = 3;
          o.drop_last = drop_last;
          const DataLoaderOptions mine = env.loader_options(n, o, /*use_device=*/false);
          CHECK_FALSE(mine.shuffle);
          const std::vector<std::size_t> idx = mine.sampler->indices(2);
          if (rank == 0) per_rank = idx.size();
          CHECK(idx.size() == per_rank);  // equal shares: no rank waits on another
          for (std::size_t i : idx) ++seen[i];
        }
        std::size_t delivered = 0, repeated = 0;
        for (auto& [i, c] : seen) {
          delivered += static_cast<std::size_t>(c);
          repeated += c > 1;
        }
        if (drop_last) {
          CHECK(repeated == 0);
          CHECK(delivered == n / world * world);
        } else {
          CHECK(seen.size() == n);                                             // every sample
          CHECK(delivered == (n == 0 ? 0 : (n + world - 1) / world * world));  // plus PyTorch's padding
        }
      }
  DistributedEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.local_rank = 1;
  env.local_world_size = 2;
  CHECK(env.loader_options(10).device == 1);  // the GPU of its local rank
  DataLoaderOptions named;
  named.device = 0;
  CHECK(env.loader_options(10, named).device == 0);
  DataLoaderOptions with_sampler;
  with_sampler.sampler = std::make_shared<SequentialSampler>(10);
  CHECK_THROWS_WITH(env.loader_options(10, with_sampler), Catch::Contains("already have a sampler"));
}
