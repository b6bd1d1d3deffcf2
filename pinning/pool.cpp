// The pinned pool: see Note [Pinned block lifecycle] in include/ferry/pinning/pool.h.
#include "ferry/pinning/pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

#include "ferry/detail/engine.h"
#include "ferry/detail/numa.h"

namespace ferry {
namespace {

std::atomic<std::size_t> g_process_pinned_bytes{0};  // every CudaHostBackend's live allocations

class CudaHostBackend final : public HostBackend {
 public:
  void* allocate(std::size_t bytes) override {
    void* p = cuda::host_alloc(bytes);
    g_process_pinned_bytes.fetch_add(bytes, std::memory_order_relaxed);
    return p;
  }
  void free(void* p, std::size_t bytes) noexcept override {
    cuda::host_free(p);
    g_process_pinned_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  }
  Device device() const noexcept override { return Device::pinned(); }
};

class PageableBackend final : public HostBackend {
 public:
  explicit PageableBackend(Device d) : device_(d) {}
  void* allocate(std::size_t bytes) override {
    void* p = std::aligned_alloc(64, (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64);
    if (!p) throw Error("pageable test backend: out of memory");
    return p;
  }
  void free(void* p, std::size_t) noexcept override { std::free(p); }
  Device device() const noexcept override { return device_; }

 private:
  Device device_;
};

std::string mib(std::size_t bytes) { return std::to_string(bytes / (1024.0 * 1024.0)).substr(0, 8) + " MiB"; }

}  // namespace

std::unique_ptr<HostBackend> cuda_host_backend() { return std::make_unique<CudaHostBackend>(); }
std::unique_ptr<HostBackend> pageable_backend_for_tests() { return std::make_unique<PageableBackend>(Device::pinned()); }
std::unique_ptr<HostBackend> pageable_backend() { return std::make_unique<PageableBackend>(Device::host()); }

struct PinnedPool::Impl : std::enable_shared_from_this<Impl> {
  enum class State { Free, Leased, Pending };
  struct Block {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    State state = State::Free;
    std::vector<std::shared_ptr<Fence>> fences;
  };

  Impl(std::size_t limit, std::shared_ptr<HostBackend> backend, bool ignore_fences, bool hard_limit, int numa_node)
      : limit(limit), backend(std::move(backend)), ignore_fences(ignore_fences), hard_limit(hard_limit), numa_node(numa_node) {}
  ~Impl() {
    // Every Storage is gone (each holds a reference to Impl), so only fences can still be open.
    for (auto& [ptr, b] : blocks) {
      for (auto& f : b.fences) f->wait();
      backend->free(ptr, b.size);
    }
  }

  std::atomic<std::size_t> limit;  // written under mu (raise_limit), read anywhere
  const std::shared_ptr<HostBackend> backend;
  const bool ignore_fences;
  const bool hard_limit;
  const int numa_node;  // preferred for the backend's pages (-1: the calling thread's policy)
  mutable std::mutex mu;
  std::condition_variable returned;      // a lease came back
  std::map<std::byte*, Block> blocks;    // guarded by mu; keyed by address
  std::size_t pinned = 0, reserved = 0;  // guarded by mu; reserved: allocations in progress
  PinnedPoolStats counters;              // guarded by mu (allocations, frees, leases, waits)

  // Pending blocks whose fences have all completed become free. Needs mu.
  void reap() {
    for (auto& [ptr, b] : blocks)
      if (b.state == State::Pending && std::all_of(b.fences.begin(), b.fences.end(), [](const auto& f) { return f->ready(); })) {
        b.fences.clear();
        b.state = State::Free;
      }
    if (!hard_limit) trim();
  }

  // A cache past its budget gives free blocks back until under it. Needs mu.
  void trim() {
    for (auto it = blocks.begin(); it != blocks.end() && pinned > limit;)
      it = it->second.state == State::Free ? give_back(it) : std::next(it);
  }

  // Frees a free block; returns the block after it. Needs mu.
  std::map<std::byte*, Block>::iterator give_back(std::map<std::byte*, Block>::iterator it) {
    backend->free(it->first, it->second.size);
    pinned -= it->second.size;
    ++counters.frees;
    return blocks.erase(it);
  }

  Storage lease(Block& b, std::size_t nbytes) {
    b.state = State::Leased;
    ++counters.leases;
    std::shared_ptr<Impl> self = shared_from_this();
    std::byte* key = b.ptr;
    std::shared_ptr<void> owner(key, [self](void* p) { self->release(static_cast<std::byte*>(p)); });
    return Storage::wrap(b.ptr, nbytes, backend->device(), std::move(owner));
  }

  void release(std::byte* ptr) noexcept {
    std::lock_guard l(mu);
    auto it = blocks.find(ptr);
    if (it == blocks.end()) return;
    if (ignore_fences) it->second.fences.clear();
    it->second.state = it->second.fences.empty() ? State::Free : State::Pending;
    if (!hard_limit) trim();
    returned.notify_all();
  }

  // `wait` false: where allocate() would wait for a lease to come back (or throw for a request
  // over the budget), an empty Storage instead; `may_allocate` false: a free block, or a pending
  // one once its fences complete, and never a new one.
  Storage allocate(std::size_t nbytes, bool wait = true, bool may_allocate = true) {
    if (hard_limit && nbytes > limit) {
      if (!wait) return {};
      throw Error("PinnedPool: a batch needs " + std::to_string(nbytes) + " bytes (" + mib(nbytes) +
                  ") but pinned_memory_limit is " + std::to_string(limit) + " bytes (" + mib(limit) +
                  "); raise the limit or make batches smaller");
    }
    const std::size_t want = std::max<std::size_t>(nbytes, 1);
    std::unique_lock l(mu);
    bool waited = false;
    const auto started = std::chrono::steady_clock::now();
    bool warned = false;
    for (;;) {
      reap();
      // Best fit among free blocks between want and 2 * want bytes.
      Block* best = nullptr;
      for (auto& [ptr, b] : blocks)
        if (b.state == State::Free && b.size >= want && b.size <= 2 * want && (!best || b.size < best->size)) best = &b;
      if (best) return lease(*best, nbytes);
      if (may_allocate && (pinned + reserved + want <= limit || !hard_limit)) {
        reserved += want;
        l.unlock();
        void* p = nullptr;
        try {
          detail::ScopedMemoryNode on_node(numa_node);  // pages placed (and locked) in this call
          p = backend->allocate(want);                  // cudaHostAlloc is slow: not under the lock
        } catch (...) {
          l.lock();
          reserved -= want;
          throw;
        }
        l.lock();
        reserved -= want;
        pinned += want;
        ++counters.allocations;
        Block& b = blocks[static_cast<std::byte*>(p)];
        b.ptr = static_cast<std::byte*>(p);
        b.size = want;
        return lease(b, nbytes);
      }
      // Over budget: give back a free block of the wrong size, if any.
      auto unfit = std::find_if(blocks.begin(), blocks.end(), [](const auto& kv) { return kv.second.state == State::Free; });
      if (may_allocate && unfit != blocks.end()) {
        give_back(unfit);
        continue;
      }
      // Wait for a pending block's fences (the device is still reading it), else for a lease.
      auto pending = std::find_if(blocks.begin(), blocks.end(), [](const auto& kv) { return kv.second.state == State::Pending; });
      if (pending == blocks.end() && !wait) return {};
      if (!waited) {
        ++counters.waits;
        waited = true;
      }
      if (pending != blocks.end()) {
        ++counters.fence_waits;
        std::vector<std::shared_ptr<Fence>> fences = pending->second.fences;
        l.unlock();
        for (auto& f : fences) f->wait();
        l.lock();
        continue;
      }
      if (stop_requested()) throw Error("PinnedPool: gave up waiting for a block: the loader is stopping");
      returned.wait_for(l, std::chrono::milliseconds(20));
      if (!warned && std::chrono::steady_clock::now() - started > std::chrono::seconds(5)) {
        warned = true;
        detail::warn_once("pinned-pool-exhausted", "PinnedPool: waited over 5 s for a pinned block: all " + mib(pinned) +
                                                       " are held by batches still alive (pinned_memory_limit " + mib(limit) +
                                                       "); release batches sooner or raise the limit");
      }
    }
  }
};

PinnedPool::PinnedPool(PinnedPoolOptions options) {
  if (options.limit_bytes == 0) throw Error("PinnedPool: limit_bytes must be > 0");
  std::shared_ptr<HostBackend> backend = options.backend;
  if (!backend) {
    if (!cuda::available())
      throw CudaError("PinnedPool: cannot pin memory without a CUDA device (" + cuda::unavailable_reason() + ")");
    backend = cuda_host_backend();
  }
  if (options.ignore_fences_unsafe)
    detail::warn_once("pool-unsafe",
                      "PinnedPool: ignore_fences_unsafe is set: pinned blocks may be overwritten "
                      "while the GPU still reads them (test use only)");
  impl_ = std::make_shared<Impl>(options.limit_bytes, std::move(backend), options.ignore_fences_unsafe, options.hard_limit,
                                 options.numa_node);
}

PinnedPool::~PinnedPool() = default;

Storage PinnedPool::allocate(std::size_t nbytes) { return impl_->allocate(nbytes); }

Storage PinnedPool::try_allocate(std::size_t nbytes, bool may_allocate) { return impl_->allocate(nbytes, false, may_allocate); }

void PinnedPool::add_fence(const Storage& storage, std::shared_ptr<Fence> fence) {
  std::lock_guard l(impl_->mu);
  auto it = impl_->blocks.upper_bound(storage.data());
  if (it != impl_->blocks.begin()) {
    --it;
    Impl::Block& b = it->second;
    if (storage.data() >= b.ptr && storage.data() < b.ptr + std::max<std::size_t>(b.size, 1)) {
      if (b.state == Impl::State::Free)
        throw Error("PinnedPool::add_fence: the block is free; fences must be added while the storage is held");
      b.fences.push_back(std::move(fence));
      return;
    }
  }
  throw Error("PinnedPool::add_fence: the storage was not allocated by this pool");
}

bool PinnedPool::owns(const Storage& storage) const {
  std::lock_guard l(impl_->mu);
  auto it = impl_->blocks.upper_bound(storage.data());
  if (it == impl_->blocks.begin()) return false;
  --it;
  return storage.data() >= it->second.ptr && storage.data() < it->second.ptr + std::max<std::size_t>(it->second.size, 1);
}

std::size_t PinnedPool::release_free_below(std::size_t bytes) {
  std::lock_guard l(impl_->mu);
  impl_->reap();
  std::size_t released = 0;
  for (auto it = impl_->blocks.begin(); it != impl_->blocks.end();) {
    const bool small_and_free = it->second.state == Impl::State::Free && it->second.size < bytes;
    it = small_and_free ? impl_->give_back(it) : std::next(it);
    released += small_and_free;
  }
  return released;
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard l(impl_->mu);
  PinnedPoolStats s = impl_->counters;
  s.bytes_pinned = impl_->pinned;
  s.blocks = impl_->blocks.size();
  for (const auto& [p, b] : impl_->blocks)
    if (b.state != Impl::State::Free) s.bytes_in_use += b.size;
  return s;
}

std::size_t PinnedPool::limit_bytes() const noexcept { return impl_->limit.load(); }

bool PinnedPool::hard_limit() const noexcept { return impl_->hard_limit; }

void PinnedPool::raise_limit(std::size_t bytes) {
  std::lock_guard l(impl_->mu);
  if (bytes > impl_->limit.load()) impl_->limit.store(bytes);
  impl_->returned.notify_all();
}

namespace detail {

std::size_t pinned_growth_cap() {
  // Half the machine's memory, and no more than three quarters of what is free now.
  const long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  std::size_t cap = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 2;
  if (avail > 0) cap = std::min(cap, static_cast<std::size_t>(avail) * static_cast<std::size_t>(page) / 4 * 3);
  return cap;
}

void DepthCheckedAllocator::grow(std::size_t from, std::size_t to, std::size_t nbytes, const char* what_grows,
                                 const char* set_it_to) {
  pool_.raise_limit(to);
  std::lock_guard l(mu_);
  if (told_) return;
  told_ = true;
  log_info("DataLoader: " + std::string(what_grows) + " from " + mib(from) + " to " + mib(to) + ": " + what_ +
           " may hold up to " + std::to_string(depth_) + " batches of " + mib(nbytes) +
           " at once (pinned_memory_limit is unset; set it to " + set_it_to + ")");
}

Storage DepthCheckedAllocator::allocate(std::size_t nbytes) {
  const std::size_t limit = pool_.limit_bytes();
  const std::size_t need = nbytes * depth_;
  if (cache_) {  // a cap on what is kept, never a reason to refuse
    if (nbytes > 0 && need > limit && may_grow_ && !at_cap_.load(std::memory_order_relaxed)) {
      const std::size_t cap = pinned_growth_cap(), to = std::min(need, cap);
      if (to == cap) at_cap_.store(true, std::memory_order_relaxed);  // no further growth asked of the machine
      if (to > limit) grow(limit, to, nbytes, "the host batches kept for reuse grow", "cap what is kept");
    }
    return pool_.allocate(nbytes);
  }
  if (nbytes > 0 && need > limit) {
    const std::size_t cap = may_grow_ ? pinned_growth_cap() : 0;
    if (may_grow_ && need <= cap) {
      grow(limit, need, nbytes, "the pinned budget grows", "bound the budget, and an error names what does not fit");
    } else if (may_grow_) {
      throw Error("pinned memory: " + std::string(what_) + " may hold up to " + std::to_string(depth_) + " batches of " +
                  std::to_string(nbytes) + " bytes at once (" + std::to_string(need) +
                  " bytes: prefetch_factor x "
                  "num_workers, pin_depth, device_prefetch and the consumer's), more than the unset pinned_memory_limit "
                  "may grow to on this machine (" +
                  std::to_string(cap) +
                  " bytes: half its memory, at most three "
                  "quarters of what is free); lower prefetch_factor or num_workers, use pin_mode Copy, or make batches smaller");
    } else {
      throw Error("pinned_memory_limit is " + std::to_string(limit) + " bytes, but " + what_ + " may hold up to " +
                  std::to_string(depth_) + " batches of " + std::to_string(nbytes) + " bytes at once (" + std::to_string(need) +
                  " bytes: prefetch_factor x num_workers, pin_depth, device_prefetch "
                  "and the consumer's); raise pinned_memory_limit, lower the prefetch, or use pin_mode Copy");
    }
  }
  return pool_.allocate(nbytes);
}

}  // namespace detail
std::size_t PinnedPool::process_pinned_bytes() noexcept { return g_process_pinned_bytes.load(std::memory_order_relaxed); }

}  // namespace ferry
