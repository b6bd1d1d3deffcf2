// The most batches a loader's pipeline keeps alive at once, for the GPU tests' memory checks.
//
// A loader's pinned pool grows on demand to the number of batches its pipeline holds at once,
// then recycles: prefetch_factor x num_workers from the workers, pin_depth at the pin thread,
// device_prefetch at the device stage, and two more (the batch the consumer holds, and the one
// the device stage is handing over). How many of those are ever alive together depends on timing,
// so a pool may take a block or two more after its first epoch (seen with two loaders on two GPUs
// under mpirun); it never frees one, and never holds more than this bound.
#pragma once

#include <algorithm>
#include <cstddef>

#include "ferry/ferry.h"

namespace ferry::test {

inline std::size_t max_batches_alive(const DataLoaderOptions& o) {
  return static_cast<std::size_t>(o.prefetch_factor * o.num_workers + o.pin_depth + o.device_prefetch + 2);
}

/// The most pinned blocks a loader's pool holds when each batch takes `fields` blocks: the depth's
/// worth, and one set more for an epoch's last, smaller batch (a block more than twice a request's
/// size does not serve it).
inline std::size_t max_pinned_blocks(const DataLoaderOptions& o, std::size_t fields) {
  return (max_batches_alive(o) + 1) * fields;
}

/// The most device buffers a loader's device stage allocates: one per batch issued and not yet
/// dropped by a consumer that holds one batch at a time (with GPU decode or the device gather the
/// pin thread issues pin_depth + device_prefetch ahead), for each of two batch sizes (the full
/// one and an epoch's last, smaller one, which a full buffer more than twice its size does not
/// serve). Like the pinned pool, the stage reaches its number as timing allows, then recycles.
inline std::size_t max_device_buffers(const DataLoaderOptions& o, int depth = 0) {
  return 2 * static_cast<std::size_t>((depth > 0 ? depth : o.pin_depth + o.device_prefetch) + 2);
}

/// The device gather's depth for batches of `batch_bytes` (options.h, pin_depth): deeper than
/// pin_depth + device_prefetch for small batches, up to 24 batches or 32 MiB of them.
inline int gather_depth(const DataLoaderOptions& o, std::size_t batch_bytes) {
  const std::size_t by_bytes = (std::size_t{32} << 20) / (batch_bytes ? batch_bytes : 1);
  return std::max(o.pin_depth + o.device_prefetch, static_cast<int>(std::min<std::size_t>(by_bytes, 24)));
}

}  // namespace ferry::test
