// python/src/blocks.cpp — shared blocks: the pinned pool whose blocks worker processes write a
// Python dataset's batches into (Note [Slabs] in ferry/_slabs.py), and the batch those tensors
// make for the pipeline (Note [Python batches through the pipeline] in python_datasets.h).
//
// Note [Shared blocks]
// The blocks of a Python loader's pinned pool are memfd segments: mapped shared in the main
// process (and, their descriptor sent once a process, in each worker process), registered with
// CUDA where they are to be pinned. The pool is ferry's PinnedPool, given to the loader as its
// pinned_pool: one budget, and a block comes back for reuse only once its last tensor is gone and
// the fences the device stage attached (its copy's event) have completed. A block is leased with
// try_allocate, never waiting for one still held (the batch then travels as torch's shared
// memory); the number of blocks is bounded too. The segments are marked MADV_DONTFORK, so a
// process forked from the main one (a loader zygote) does not map them; forget_shared_blocks()
// closes its copies of their descriptors there, and from then on that process frees nothing.
// Freed blocks' ids are kept for the worker processes to unmap (retired()).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "module.h"
#include "python_datasets.h"

namespace ferry_py {
namespace {

using namespace nb::literals;

class SharedMemoryBackend final : public ferry::HostBackend {
 public:
  explicit SharedMemoryBackend(bool page_locked) : page_locked_(page_locked) {}
  ~SharedMemoryBackend() override = default;

  void* allocate(std::size_t bytes) override {
    const auto started = std::chrono::steady_clock::now();
    const int fd = memfd_create("ferry-block", MFD_CLOEXEC);
    if (fd < 0) throw ferry::Error(std::string("shared block: memfd_create failed: ") + std::strerror(errno));
    void* p = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      close(fd);
      throw ferry::Error("shared block: no shared memory for " + std::to_string(bytes) + " bytes: " + std::strerror(err));
    }
    madvise(p, bytes, MADV_DONTFORK);  // not in a process forked from this one (see the Note)
    if (page_locked_) {
      try {
        ferry::cuda::host_register(p, bytes);
      } catch (...) {
        munmap(p, bytes);
        close(fd);
        throw;
      }
    }
    std::lock_guard l(mu_);
    blocks_[p] = Info{fd, next_id_++, bytes};
    ++made_;
    make_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return p;
  }

  void free(void* p, std::size_t bytes) noexcept override {
    std::lock_guard l(mu_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) return;
    if (!forgotten_) {
      if (page_locked_) {
        try {
          ferry::cuda::host_unregister(p);
        } catch (...) {  // the process is ending with CUDA torn down: the mapping goes with it
        }
      }
      munmap(p, bytes);
      close(it->second.fd);
      retired_.push_back(it->second.id);
    }
    blocks_.erase(it);
  }

  ferry::Device device() const noexcept override { return page_locked_ ? ferry::Device::pinned() : ferry::Device::host(); }

  struct Info {
    int fd = -1;
    std::int64_t id = 0;
    std::size_t size = 0;
  };
  std::optional<Info> info(const void* p) const {
    std::lock_guard l(mu_);
    auto it = blocks_.find(const_cast<void*>(p));
    if (it == blocks_.end()) return std::nullopt;
    return it->second;
  }
  bool holds(std::uintptr_t address) const {
    std::lock_guard l(mu_);
    auto it = blocks_.upper_bound(reinterpret_cast<void*>(address));
    if (it == blocks_.begin()) return false;
    --it;
    return address < reinterpret_cast<std::uintptr_t>(it->first) + it->second.size;
  }
  std::vector<std::int64_t> take_retired() {
    std::lock_guard l(mu_);
    return std::exchange(retired_, {});
  }
  // In a process forked from the one that made the blocks: closes this process's copies of their
  // descriptors; nothing is freed here after (the mappings were not copied).
  void forget() noexcept {
    std::lock_guard l(mu_);
    if (forgotten_) return;
    forgotten_ = true;
    for (auto& [p, b] : blocks_) close(b.fd);
  }
  std::pair<std::uint64_t, double> made() const {
    std::lock_guard l(mu_);
    return {made_, make_seconds_};
  }

 private:
  const bool page_locked_;
  mutable std::mutex mu_;
  std::map<void*, Info> blocks_;  // guarded by mu_
  std::vector<std::int64_t> retired_;
  std::int64_t next_id_ = 0;
  bool forgotten_ = false;
  std::uint64_t made_ = 0;
  double make_seconds_ = 0;
};

// Every backend of this process still alive, for forget_shared_blocks().
std::mutex registry_mu;
std::vector<std::weak_ptr<SharedMemoryBackend>>& registry() {
  static auto* r = new std::vector<std::weak_ptr<SharedMemoryBackend>>();  // never freed: outlives finalization
  return *r;
}

// One leased block: its bytes stay the lease's until the last tensor viewing it is gone.
struct Block {
  ferry::Storage storage;
  std::int64_t id = 0;
  int fd = -1;
};

class SharedBlocks {
 public:
  SharedBlocks(bool page_locked, std::size_t limit) : backend_(std::make_shared<SharedMemoryBackend>(page_locked)) {
    if (limit == 0) throw nb::value_error("shared blocks: the byte budget must be > 0");
    ferry::PinnedPoolOptions o;
    o.limit_bytes = limit;
    o.backend = backend_;
    pool_ = std::make_shared<ferry::PinnedPool>(o);
    std::lock_guard l(registry_mu);
    auto& r = registry();
    std::erase_if(r, [](const auto& w) { return w.expired(); });
    r.push_back(backend_);
  }

  // A block of at least `nbytes`: a free one, else (`may_allocate`, fewer than `max_blocks`
  // held once the free ones smaller than `nbytes` are given back) a new one; None where the
  // budget or the count is reached (see the Note).
  std::optional<Block> lease(std::size_t nbytes, bool may_allocate, std::size_t max_blocks) {
    ferry::Storage s;
    {
      NoGil nogil;         // a pending block's fence may be waited for; registering takes a while
      if (may_allocate) {  // requests only grow: smaller free blocks would never be leased again
        pool_->release_free_below(nbytes);
        if (pool_->stats().blocks >= max_blocks) may_allocate = false;
      }
      s = pool_->try_allocate(nbytes, may_allocate);
    }
    if (!s) return std::nullopt;
    std::optional<SharedMemoryBackend::Info> info = backend_->info(s.data());
    if (!info) throw ferry::Error("shared blocks: a leased block is not one of the pool's segments");
    // The whole block (the pool reuses one for requests down to half its size): what a process
    // maps, and what a batch may fill.
    return Block{ferry::Storage::wrap(s.data(), info->size, s.device(), s.owner()), info->id, info->fd};
  }

  std::vector<std::int64_t> retired() { return backend_->take_retired(); }
  bool holds(std::uintptr_t address) const { return backend_->holds(address); }
  const std::shared_ptr<ferry::PinnedPool>& pool() const { return pool_; }
  nb::dict stats() const {
    const ferry::PinnedPoolStats s = pool_->stats();
    const auto [made, seconds] = backend_->made();
    nb::dict d;
    d["bytes"] = s.bytes_pinned;
    d["bytes_in_use"] = s.bytes_in_use;
    d["blocks"] = s.blocks;
    d["made"] = made;
    d["make_seconds"] = seconds;
    d["leases"] = s.leases;
    d["fence_waits"] = s.fence_waits;
    return d;
  }

 private:
  std::shared_ptr<SharedMemoryBackend> backend_;
  std::shared_ptr<ferry::PinnedPool> pool_;
};

constexpr int kDTypes = static_cast<int>(ferry::DType::Float64) + 1;

std::optional<ferry::DType> dtype_named(const std::string& name) {
  for (int k = 0; k < kDTypes; ++k)
    if (name == ferry::dtype_name(static_cast<ferry::DType>(k))) return static_cast<ferry::DType>(k);
  return std::nullopt;
}

// A tensor's dtype and bytes from its dtype name and shape; `which` ("TensorBatch: tensor 2")
// names it in the error.
std::pair<ferry::DType, std::size_t> typed_bytes(const std::string& which, const std::string& name,
                                                 const std::vector<std::int64_t>& dims) {
  const std::optional<ferry::DType> dtype = dtype_named(name);
  if (!dtype) throw nb::value_error((which + " has dtype '" + name + "', which ferry does not carry").c_str());
  std::size_t n = ferry::itemsize(*dtype);
  for (std::int64_t d : dims) {
    if (d < 0) throw nb::value_error((which + ": a negative dimension").c_str());
    n *= static_cast<std::size_t>(d);
  }
  return {*dtype, n};
}

// The tensors of a batch a process wrote into `block`: (offset, dtype name, shape) each.
TensorBatch tensor_batch(nb::object structure, const Block& block,
                         const std::vector<std::tuple<std::size_t, std::string, std::vector<std::int64_t>>>& regions) {
  TensorBatch out;
  out.tensors.reserve(regions.size());
  for (const auto& [offset, name, dims] : regions) {
    const std::string which = "TensorBatch: tensor " + std::to_string(out.tensors.size());
    const auto [dtype, n] = typed_bytes(which, name, dims);
    if (offset > block.storage.nbytes() || n > block.storage.nbytes() - offset)
      throw nb::value_error((which + " (" + std::to_string(n) + " bytes at " + std::to_string(offset) +
                             ") lies outside its block of " + std::to_string(block.storage.nbytes()) + " bytes")
                                .c_str());
    out.tensors.emplace_back(block.storage, dtype, ferry::Shape(dims.begin(), dims.end()), offset);
  }
  out.structure = PyRef(std::move(structure));
  return out;
}

// A batch a worker thread (or the loader's own thread) collated: each tensor viewed where torch
// holds it, (address, dtype name, shape), the tensors kept alive by `keep` until the last view
// goes (Note [Thread batches through the pipeline] in ferry/_python.py). A view's bytes are read
// by the pin thread; PyBatch keeps the views until the batch is delivered, so that `keep` is
// dropped on the consumer's thread, which holds the GIL then.
TensorBatch host_tensor_batch(nb::object structure, nb::object keep,
                              const std::vector<std::tuple<std::uintptr_t, std::string, std::vector<std::int64_t>>>& views) {
  TensorBatch out;
  out.tensors.reserve(views.size());
  auto owner = std::make_shared<PyRef>(std::move(keep));
  for (const auto& [address, name, dims] : views) {
    const std::string which = "TensorBatch.of_host: tensor " + std::to_string(out.tensors.size());
    const auto [dtype, n] = typed_bytes(which, name, dims);
    if (address == 0 && n > 0) throw nb::value_error((which + ": no address").c_str());
    ferry::Storage storage = ferry::Storage::wrap(reinterpret_cast<void*>(address), n, ferry::Device::host(), owner);
    out.tensors.emplace_back(std::move(storage), dtype, ferry::Shape(dims.begin(), dims.end()));
  }
  out.structure = PyRef(std::move(structure));
  return out;
}

}  // namespace

void register_blocks(nb::module_& m) {
  nb::class_<Block>(m, "Block", "A leased shared block (Note [Shared blocks] in python/src/blocks.cpp).")
      .def_ro("id", &Block::id, "The block's id, the same for every lease of it.")
      .def_ro("fd", &Block::fd, "Its memfd (the pool's: send it, never close it).")
      .def_prop_ro("address", [](const Block& b) { return reinterpret_cast<std::uintptr_t>(b.storage.data()); })
      .def_prop_ro(
          "size", [](const Block& b) { return b.storage.nbytes(); }, "The block's bytes.");
  nb::class_<SharedBlocks>(m, "SharedBlocks", "A Python loader's pool of shared blocks (Note [Shared blocks]).")
      .def(nb::init<bool, std::size_t>(), "page_locked"_a, "limit"_a)
      .def("lease", &SharedBlocks::lease, "nbytes"_a, "may_allocate"_a, "max_blocks"_a,
           "A block of at least nbytes, or None (never waits for a block still held).")
      .def("retired", &SharedBlocks::retired, "Ids of the blocks freed since the last call.")
      .def("holds", &SharedBlocks::holds, "address"_a, "Whether `address` lies in one of the blocks.")
      .def("stats", &SharedBlocks::stats);
  nb::class_<TensorBatch>(m, "TensorBatch",
                          "A batch whose tensors are in a shared block: its structure and the tensors' places "
                          "(Note [Python batches through the pipeline] in python/src/python_datasets.h).")
      .def(
          "__init__",
          [](TensorBatch* self, nb::object structure, const Block& block,
             const std::vector<std::tuple<std::size_t, std::string, std::vector<std::int64_t>>>& regions) {
            new (self) TensorBatch(tensor_batch(std::move(structure), block, regions));
          },
          "structure"_a, "block"_a, "regions"_a)
      .def_static(
          "of_host",
          [](nb::object structure, nb::object keep,
             const std::vector<std::tuple<std::uintptr_t, std::string, std::vector<std::int64_t>>>& views) {
            return host_tensor_batch(std::move(structure), std::move(keep), views);
          },
          "structure"_a, "keep"_a, "views"_a,
          "A batch whose tensors are views (address, dtype name, shape) of host memory that `keep` holds: the pin "
          "thread copies them into a pinned block (Note [Thread batches through the pipeline] in ferry/_python.py).");
  nb::list names;
  for (int k = 0; k < kDTypes; ++k) names.append(ferry::dtype_name(static_cast<ferry::DType>(k)));
  m.attr("DTYPE_NAMES") = nb::tuple(names);
  m.def(
      "with_shared_blocks",
      [](ferry::DataLoaderOptions options, const SharedBlocks& blocks) {
        options.pinned_pool = blocks.pool();
        return options;
      },
      "options"_a, "blocks"_a, "The options with the blocks' pool as the loader's pinned pool (one budget, one fence).");
  m.def(
      "forget_shared_blocks",
      [] {
        std::lock_guard l(registry_mu);
        for (auto& w : registry())
          if (auto b = w.lock()) b->forget();
      },
      "In a process forked from the main one: closes its copies of the shared blocks' descriptors.");
}

}  // namespace ferry_py
