// ferry/pinning/pool.h — a bounded, recycled pool of pinned host blocks.
//
// Note [Pinned block lifecycle]
// A block moves free -> leased -> pending -> free. allocate() leases a block (reusing a free one
// of a fitting size, or allocating an exact-size one while under the byte budget); it comes back
// as a Storage whose last reference, when dropped, moves the block to pending. A pending block
// becomes free only when every fence attached to it (add_fence: one CUDA event per device copy
// that read it) has completed, never merely because the host let go: reusing a pinned source
// before its non_blocking copy has finished silently corrupts the copy on the GPU.
//
// The budget (`limit_bytes`) is hard: when it is reached, allocate() first reclaims free blocks of
// unfitting sizes, then waits for pending fences, then for leases to come back (giving up with an
// Error once ferry::stop_requested(), so a stopping loader never hangs here). A single request
// larger than the budget throws ferry::Error at once. With `hard_limit = false` the pool is a
// cache instead: past the budget it allocates anyway and frees blocks as they come back until it
// is under it again (the loader's pageable collate buffers: their number is bounded by the
// pipeline's depth, and waiting for them could deadlock behind the reorder window). Blocks are sized exactly (no power-of-two
// rounding); a free block is reused for any request between half its size and its size.
// cudaHostAlloc costs ~350 ms per GiB, so after warm-up the pool allocates nothing (stats()).
//
//   ferry::PinnedPool pool({.limit_bytes = 1 << 30});
//   ferry::Storage s = pool.allocate(38'535'168);      // pinned, 64-byte aligned
//   ... cudaMemcpyAsync from s.data() on a stream; record an event ...
//   pool.add_fence(s, std::make_shared<ferry::EventFence>(std::move(event)));
//
// The pool's memory outlives the PinnedPool object while any Storage from it is alive: the last
// one out frees it (after waiting on its fences).
//
// Thread safety: all members may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "ferry/core/allocator.h"
#include "ferry/pinning/fence.h"

namespace ferry {

/// Where the pool's blocks come from.
class HostBackend {
 public:
  virtual ~HostBackend() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void free(void* p, std::size_t bytes) noexcept = 0;
  /// The memory kind of Storage handed out (PinnedHost for cudaHostAlloc).
  virtual Device device() const noexcept = 0;
};

/// cudaHostAlloc / cudaFreeHost.
std::unique_ptr<HostBackend> cuda_host_backend();
/// Plain aligned host memory, reported as pinned: lets the pool's logic run on a CPU-only machine.
std::unique_ptr<HostBackend> pageable_backend_for_tests();
/// Plain aligned host memory, reported as pageable: a pool of recycled collate buffers, so large
/// batches do not page-fault fresh memory every time (glibc maps anything over 32 MiB anew).
std::unique_ptr<HostBackend> pageable_backend();

struct PinnedPoolOptions {
  /// Hard cap on bytes the pool holds (free + in use + pending).
  std::size_t limit_bytes = std::size_t{4} << 30;
  /// Null: cudaHostAlloc.
  std::shared_ptr<HostBackend> backend;
  /// UNSAFE, for one test only: reuse blocks as soon as the host lets go, ignoring fences. It
  /// exists to prove the GPU corruption test catches exactly this bug. Never set it otherwise.
  bool ignore_fences_unsafe = false;
  /// True: the budget is a hard cap (allocate() waits). False: a retention cap (see the Note).
  bool hard_limit = true;
  /// NUMA node the blocks' pages are preferred on (the backend allocates under that memory
  /// policy); -1: wherever the allocating thread's policy puts them. A loader sets it to its
  /// device's node (Note [NUMA placement] in ferry/detail/numa.h).
  int numa_node = -1;
};

struct PinnedPoolStats {
  std::size_t bytes_pinned = 0;  ///< held by the pool now
  std::size_t bytes_in_use = 0;  ///< leased or pending (not yet reusable)
  std::size_t blocks = 0;
  std::uint64_t allocations = 0;  ///< backend allocations so far (cudaHostAlloc calls)
  std::uint64_t frees = 0;        ///< backend frees so far
  std::uint64_t leases = 0;       ///< allocate() calls served
  std::uint64_t waits = 0;        ///< allocate() calls that had to wait (budget reached)
  std::uint64_t fence_waits = 0;  ///< of those, waits on a pending block's fences
};

class PinnedPool final : public BatchAllocator {
 public:
  /// Page-locked bytes the pinned pools of this process hold now (cudaHostAlloc'd, not yet
  /// freed; test backends not counted): 0 once every pool and every batch from one is gone.
  static std::size_t process_pinned_bytes() noexcept;
  explicit PinnedPool(PinnedPoolOptions options = {});
  ~PinnedPool() override;
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  /// Leases a block of at least `nbytes` (see Note [Pinned block lifecycle]). May block on the
  /// budget; throws ferry::Error if `nbytes` exceeds it, CudaError if the backend fails.
  Storage allocate(std::size_t nbytes) override;
  /// Leases a block as allocate() does, but never waits for a lease to come back: where
  /// allocate() would (the budget held by blocks still leased), or throw (a request over a hard
  /// budget), returns an empty Storage. It still waits for a pending block's fences (the device
  /// copy that reads it). `may_allocate` false: only a free or pending block is reused, none is
  /// made (and no free block of another size is given back). For a caller that has somewhere
  /// else to put the bytes (a Python batch's tensors go as torch's shared memory instead).
  Storage try_allocate(std::size_t nbytes, bool may_allocate = true);
  /// Gives back the free blocks smaller than `bytes` (pending ones once their fences have
  /// completed), for a caller whose requests have grown past them; returns how many.
  std::size_t release_free_below(std::size_t bytes);
  /// Attaches a fence to the block behind `storage`: the block is not reused before it completes.
  /// Throws ferry::Error if `storage` did not come from this pool.
  void add_fence(const Storage& storage, std::shared_ptr<Fence> fence);
  /// True if `storage` lies in one of this pool's blocks.
  bool owns(const Storage& storage) const;
  PinnedPoolStats stats() const;
  std::size_t limit_bytes() const noexcept;
  /// False for a cache (PinnedPoolOptions::hard_limit false): its limit caps what it keeps.
  bool hard_limit() const noexcept;
  /// Raises the budget to `bytes` (never lowers it); waiters see the new budget at once.
  void raise_limit(std::size_t bytes);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

namespace detail {
/// How far an unset pinned budget may grow: half the machine's memory, and no more than three
/// quarters of what is free now (0 when the machine does not say).
std::size_t pinned_growth_cap();

/// Leases from a pinned pool, refusing a batch whose size times the pipeline's depth exceeds the
/// pool's budget: that many batches can be alive at once (in flight, in the reorder window, queued
/// for the pin thread and the device), and a budget below it would stall the in-order batch
/// behind later ones forever. Refusing names the numbers instead of hanging. With `may_grow` (the
/// user left pinned_memory_limit unset and the pool is the loader's own) the budget grows to fit
/// instead, once, within half the machine's memory, and says so at info level.
///
/// Over a cache (a pool without a hard limit: recycled pageable buffers), the limit only caps what
/// is kept for reuse, so nothing is refused: with `may_grow` the cap grows to hold `depth`
/// batches, within the same bound, and past the cap buffers are freed and made anew (a fresh
/// buffer of a large batch is mapped anew and faults in every page as it is written).
class DepthCheckedAllocator final : public BatchAllocator {
 public:
  DepthCheckedAllocator(PinnedPool& pool, std::size_t depth, const char* what, bool may_grow)
      : pool_(pool), depth_(depth), what_(what), may_grow_(may_grow), cache_(!pool.hard_limit()) {}
  Storage allocate(std::size_t nbytes) override;

 private:
  // Raises the pool's limit to `to`, saying so at info level the first time.
  void grow(std::size_t from, std::size_t to, std::size_t nbytes, const char* what_grows, const char* set_it_to);

  PinnedPool& pool_;
  std::size_t depth_;
  const char* what_;
  bool may_grow_;
  bool cache_;
  std::atomic<bool> at_cap_{false};  // a cache grown as far as the machine allows
  std::mutex mu_;
  bool told_ = false;  // guarded by mu_
};
}  // namespace detail

}  // namespace ferry
