// ferry/core/parallel.h — a bounded pool of threads for work inside one large batch.
//
// Copying a 38 MB batch is memory-bound: one thread's memcpy moves about 12 GB/s, eight about
// 42 GB/s. ParallelFor splits such a copy across a fixed number of threads (a oneTBB task arena
// of that concurrency), so a single large batch does not serialize on one core. Small jobs run
// inline on the caller.
//
//   ferry::ParallelFor pool(8);
//   pool.run(rows, [&](std::size_t begin, std::size_t end) { copy_rows(begin, end); });
//
// Thread safety: run() may be called from several threads at once; each call returns when all of
// its work is done. Exceptions thrown by the body are rethrown from run().
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

namespace ferry {
namespace detail {
struct Placement;
}

class ParallelFor {
 public:
  /// `threads` <= 1 runs everything inline on the caller.
  explicit ParallelFor(int threads);
  /// The same, its threads running under `placement` while they work for this pool (a loader's
  /// NUMA placement: ferry/detail/numa.h); null: anywhere.
  ParallelFor(int threads, std::shared_ptr<const detail::Placement> placement);
  ~ParallelFor();
  ParallelFor(const ParallelFor&) = delete;
  ParallelFor& operator=(const ParallelFor&) = delete;

  int threads() const noexcept { return threads_; }
  /// Calls body on disjoint sub-ranges covering [0, n); `grain` is the smallest sub-range.
  void run(std::size_t n, const std::function<void(std::size_t, std::size_t)>& body, std::size_t grain = 1) const;

 private:
  struct Impl;
  int threads_;
  std::unique_ptr<Impl> impl_;
};

/// memcpy of `bytes`, split over `pool` when it is large (>= 1 MiB a thread).
void parallel_memcpy(void* dst, const void* src, std::size_t bytes, const ParallelFor* pool);

}  // namespace ferry
