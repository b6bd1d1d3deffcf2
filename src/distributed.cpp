// Reading a launcher's environment: see include/ferry/core/distributed.h.
#include "ferry/core/distributed.h"

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "ferry/core/error.h"

namespace ferry {

namespace {

struct Names {
  DistributedEnv::Launcher launcher;
  const char *rank, *world, *local_rank, *local_world;
};

constexpr Names kLaunchers[] = {
    {DistributedEnv::Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {DistributedEnv::Launcher::OpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {DistributedEnv::Launcher::Mpich, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {DistributedEnv::Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

// A non-negative decimal, or nullopt when unset; ferry::Error when set but not a number. `lead`:
// the leading number of a longer value (Slurm's "4(x2),3").
std::optional<std::size_t> number(const std::function<const char*(const char*)>& get, const char* name, const char* launcher,
                                  bool lead = false) {
  const char* v = get(name);
  if (!v) return std::nullopt;
  const std::string_view s(v);
  std::size_t out = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  if (ec != std::errc() || end == s.data() || (!lead && end != s.data() + s.size()))
    throw Error(std::string("DistributedEnv: ") + launcher + "'s " + name + " is '" + std::string(s.substr(0, 40)) +
                "', not a number");
  return out;
}

}  // namespace

const char* DistributedEnv::launcher_name() const noexcept {
  switch (launcher) {
    case Launcher::Torchrun: return "torchrun";
    case Launcher::OpenMpi: return "Open MPI";
    case Launcher::Mpich: return "MPICH";
    case Launcher::Slurm: return "Slurm";
    case Launcher::None: break;
  }
  return "none";
}

std::string DistributedEnv::str() const {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (local " + std::to_string(local_rank) + " of " +
         std::to_string(local_world_size) + ", " + launcher_name() + ")";
}

DistributedEnv DistributedEnv::from(const std::function<const char*(const char*)>& get) {
  for (const Names& n : kLaunchers) {
    DistributedEnv e;
    e.launcher = n.launcher;
    const char* who = e.launcher_name();
    const auto rank = number(get, n.rank, who), world = number(get, n.world, who);
    if (!rank && !world) continue;  // not this launcher
    if (!rank || !world)
      throw Error(std::string("DistributedEnv: ") + who + " set " + (rank ? n.rank : n.world) + " but not " +
                  (rank ? n.world : n.rank));
    const auto local = number(get, n.local_rank, who);
    if (!local) throw Error(std::string("DistributedEnv: ") + who + " set " + n.rank + " but not the local rank " + n.local_rank);
    std::optional<std::size_t> local_world = number(get, n.local_world, who);
    if (!local_world && n.launcher == Launcher::Slurm) local_world = number(get, "SLURM_TASKS_PER_NODE", who, true);
    if (*world == 0) throw Error(std::string("DistributedEnv: ") + who + "'s " + n.world + " is 0");
    if (*rank >= *world)
      throw Error(std::string("DistributedEnv: ") + who + "'s rank " + std::to_string(*rank) + " (" + n.rank +
                  ") is not below its world size " + std::to_string(*world) + " (" + n.world + ")");
    e.rank = *rank;
    e.world_size = *world;
    e.local_rank = *local;
    e.local_world_size = local_world.value_or(*local + 1);
    if (e.local_rank >= e.local_world_size || e.local_world_size > e.world_size)
      throw Error(std::string("DistributedEnv: ") + who + "'s local rank " + std::to_string(e.local_rank) + " (" + n.local_rank +
                  ") and local world size " + std::to_string(e.local_world_size) + " (" + n.local_world +
                  ") do not fit a world of " + std::to_string(e.world_size));
    return e;
  }
  return {};
}

DistributedEnv DistributedEnv::from_environment() {
  return from([](const char* name) { return std::getenv(name); });
}

}  // namespace ferry
