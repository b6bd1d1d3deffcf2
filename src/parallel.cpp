#include "ferry/core/parallel.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

#include <cstring>

#include "ferry/detail/numa.h"

namespace ferry {

namespace {
// TBB's threads serve every arena in the process: each takes the loader's placement on entering
// this pool's arena and gives it back on leaving.
class PlacementObserver final : public tbb::task_scheduler_observer {
 public:
  PlacementObserver(tbb::task_arena& arena, std::shared_ptr<const detail::Placement> p)
      : tbb::task_scheduler_observer(arena), placement_(std::move(p)) {
    observe(true);
  }
  ~PlacementObserver() override { observe(false); }
  void on_scheduler_entry(bool worker) override {
    if (worker) detail::enter_placement(*placement_);
  }
  void on_scheduler_exit(bool worker) override {
    if (worker) detail::leave_placement();
  }

 private:
  std::shared_ptr<const detail::Placement> placement_;
};
}  // namespace

struct ParallelFor::Impl {
  Impl(int threads, std::shared_ptr<const detail::Placement> p) : arena(threads) {
    if (p && p->placed()) {
      arena.initialize();
      observer = std::make_unique<PlacementObserver>(arena, std::move(p));
    }
  }
  mutable tbb::task_arena arena;
  std::unique_ptr<PlacementObserver> observer;  // destroyed before the arena
};

ParallelFor::ParallelFor(int threads) : ParallelFor(threads, nullptr) {}

ParallelFor::ParallelFor(int threads, std::shared_ptr<const detail::Placement> placement) : threads_(threads < 1 ? 1 : threads) {
  if (threads_ > 1) impl_ = std::make_unique<Impl>(threads_, std::move(placement));
}

ParallelFor::~ParallelFor() = default;

void ParallelFor::run(std::size_t n, const std::function<void(std::size_t, std::size_t)>& body, std::size_t grain) const {
  if (n == 0) return;
  if (!impl_ || n <= grain) {
    body(0, n);
    return;
  }
  impl_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::size_t>(0, n, grain == 0 ? 1 : grain),
        [&](const tbb::blocked_range<std::size_t>& r) { body(r.begin(), r.end()); }, tbb::simple_partitioner());
  });
}

void parallel_memcpy(void* dst, const void* src, std::size_t bytes, const ParallelFor* pool) {
  constexpr std::size_t kPerThread = std::size_t{1} << 20;
  if (!pool || pool->threads() <= 1 || bytes < 2 * kPerThread) {
    if (bytes) std::memcpy(dst, src, bytes);
    return;
  }
  const std::size_t chunks = std::min<std::size_t>(bytes / kPerThread, static_cast<std::size_t>(pool->threads()) * 4);
  const std::size_t chunk = (bytes + chunks - 1) / chunks;
  pool->run(chunks, [&](std::size_t b, std::size_t e) {
    for (std::size_t c = b; c < e; ++c) {
      const std::size_t off = c * chunk;
      if (off >= bytes) break;
      std::memcpy(static_cast<std::byte*>(dst) + off, static_cast<const std::byte*>(src) + off, std::min(chunk, bytes - off));
    }
  });
}

}  // namespace ferry
