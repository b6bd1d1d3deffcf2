// The most batches a loader's pipeline keeps alive at once, for the GPU tests' memory checks.
//
// A loader's pinned pool grows on demand to the number of batches its pipeline holds at once,
// then recycles: prefetch_factor x num_workers from the workers, pin_depth at the pin thread,
// device_prefetch at the device stage, and two more (the batch the consumer holds, and the one
// the device stage is handing over). How many of those are ever alive together depends on timing,
// so a pool may take a block or two more after its first epoch (seen with two loaders on two GPUs
// under mpirun); it never frees one, and never holds more than this bound.
#pragma once

#include <cstddef>

#include "ferry/ferry.h"

namespace ferry::test {

inline std::size_t max_batches_alive(const DataLoaderOptions& o) {
  return static_cast<std::size_t>(o.prefetch_factor * o.num_workers + o.pin_depth + o.device_prefetch + 2);
}

}  // namespace ferry::test
