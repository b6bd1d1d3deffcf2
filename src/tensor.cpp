#include "ferry/core/tensor.h"

#include <pthread.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <sstream>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/error.h"

namespace ferry {

std::size_t itemsize(DType dtype) noexcept {
  switch (dtype) {
    case DType::Bool:
    case DType::UInt8:
    case DType::Int8: return 1;
    case DType::Int16:
    case DType::Float16:
    case DType::BFloat16: return 2;
    case DType::Int32:
    case DType::Float32: return 4;
    case DType::Int64:
    case DType::Float64: return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::Bool: return "bool";
    case DType::UInt8: return "uint8";
    case DType::Int8: return "int8";
    case DType::Int16: return "int16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
  }
  return "?";
}

std::string Device::str() const {
  switch (kind) {
    case MemoryKind::Host: return "cpu";
    case MemoryKind::PinnedHost: return "cpu(pinned)";
    case MemoryKind::Device: return "cuda:" + std::to_string(index);
  }
  return "?";
}

std::string shape_str(std::span<const std::int64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

constexpr std::size_t kAlign = 64;

// Host blocks of 1 to 32 KiB, kept when their last Storage goes for the next allocation of their
// size class. glibc's malloc serves these sizes past its per-thread cache, from its arena under a
// lock (and aligned_alloc splits a larger chunk each time): about a tenth of the pin thread's time
// in the device gather went to a small batch's 2 KiB index tensor, allocated and freed tens of
// thousands of times a second (bench/RESULTS.md). At most kKeep blocks a class are kept (2 MiB in
// all); the rest go back to the allocator.
class SmallBlocks {
 public:
#if defined(__SANITIZE_ADDRESS__)
  static constexpr std::size_t kKeep = 0;  // AddressSanitizer sees every block's use after its free
#else
  static constexpr std::size_t kKeep = 32;
#endif
  static constexpr std::size_t kMin = 1024, kMax = 32 * 1024;

  SmallBlocks() {
    for (Class& c : classes_) c.free.reserve(kKeep);
  }
  // The class of a block of `n` bytes (n <= kMax): its size, a power of two, at least kMin.
  static std::size_t class_size(std::size_t n) noexcept { return std::bit_ceil(std::max(n, kMin)); }
  void* take(std::size_t size) {
    Class& c = of(size);
    {
      std::lock_guard l(c.mu);
      if (!c.free.empty()) {
        void* p = c.free.back();
        c.free.pop_back();
        return p;
      }
    }
    return std::aligned_alloc(kAlign, size);
  }
  void give(void* p, std::size_t size) noexcept {
    Class& c = of(size);
    {
      std::lock_guard l(c.mu);
      if (c.free.size() < kKeep) {
        c.free.push_back(p);  // capacity reserved: never allocates
        return;
      }
    }
    std::free(p);
  }
  // fork() while another thread holds a class's lock would leave it held in the child, whose
  // next small allocation would wait for good: the locks are taken around fork(), as glibc's
  // malloc does with its own (registered once the blocks are made: small_blocks()).
  void lock_all() noexcept {
    for (Class& c : classes_) c.mu.lock();
  }
  void unlock_all() noexcept {
    for (std::size_t k = kClasses; k-- > 0;) classes_[k].mu.unlock();
  }

 private:
  struct Class {
    std::mutex mu;
    std::vector<void*> free;
  };
  static constexpr std::size_t kClasses = 6;                                                // 1, 2, 4, 8, 16, 32 KiB
  Class& of(std::size_t size) noexcept { return classes_[std::countr_zero(size / kMin)]; }  // size: a class_size()
  Class classes_[kClasses];
};

SmallBlocks& small_blocks() {
  static SmallBlocks* blocks = [] {
    auto* b = new SmallBlocks;  // outlives every Storage, those of static objects too
    ::pthread_atfork([] { small_blocks().lock_all(); }, [] { small_blocks().unlock_all(); }, [] { small_blocks().unlock_all(); });
    return b;
  }();
  return *blocks;
}
// Made as the library loads, before any thread of its: a fork() while a first allocation was
// making them would leave the child waiting on the static's guard.
[[maybe_unused]] SmallBlocks& small_blocks_made_at_load = small_blocks();

}  // namespace

// 64-byte aligned. From 961 bytes to 32 KiB from SmallBlocks; otherwise from malloc (whose
// per-thread cache holds the smaller ones) with the alignment made here (glibc's aligned_alloc
// takes a slower path: a larger chunk split, its remainders freed).
Storage Storage::allocate(std::size_t nbytes) {
  if (nbytes > SmallBlocks::kMin - kAlign && nbytes <= SmallBlocks::kMax) {
    const std::size_t size = SmallBlocks::class_size(nbytes);
    void* p = small_blocks().take(size);
    if (!p) throw Error("Storage::allocate: out of host memory allocating " + std::to_string(nbytes) + " bytes");
    // (shared_ptr's constructor gives the block back itself if it throws)
    return wrap(p, nbytes, Device::host(), std::shared_ptr<void>(p, [size](void* q) { small_blocks().give(q, size); }));
  }
  if (nbytes > std::numeric_limits<std::size_t>::max() - kAlign)
    throw Error("Storage::allocate: " + std::to_string(nbytes) + " bytes is more than host memory can hold");
  void* base = std::malloc(std::max<std::size_t>(nbytes, 1) + kAlign - 1);
  if (!base) throw Error("Storage::allocate: out of host memory allocating " + std::to_string(nbytes) + " bytes");
  const auto at = (reinterpret_cast<std::uintptr_t>(base) + kAlign - 1) / kAlign * kAlign;
  return wrap(reinterpret_cast<void*>(at), nbytes, Device::host(), std::shared_ptr<void>(base, [](void* q) { std::free(q); }));
}

Storage Storage::wrap(void* data, std::size_t nbytes, Device device, std::shared_ptr<void> owner) {
  if (!owner) throw Error("Storage::wrap: an owner is required (it keeps the memory alive)");
  Storage s;
  s.data_ = static_cast<std::byte*>(data);
  s.nbytes_ = nbytes;
  s.device_ = device;
  s.owner_ = std::move(owner);
  return s;
}

namespace {
std::int64_t checked_numel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) throw Error("Tensor: negative dimension in shape " + shape_str(shape));
    n *= d;
  }
  return n;
}
}  // namespace

Tensor::Tensor(Storage storage, DType dtype, Shape shape, std::size_t offset)
    : storage_(std::move(storage)), offset_(offset), dtype_(dtype), shape_(std::move(shape)) {
  numel_ = checked_numel(shape_);
  if (offset_ + nbytes() > storage_.nbytes())
    throw Error("Tensor: " + std::string(dtype_name(dtype_)) + " " + shape_str(shape_) + " at offset " + std::to_string(offset_) +
                " needs " + std::to_string(offset_ + nbytes()) + " bytes but the storage has " +
                std::to_string(storage_.nbytes()));
}

Tensor Tensor::empty(DType dtype, Shape shape) {
  const std::int64_t n = checked_numel(shape);
  return Tensor(Storage::allocate(static_cast<std::size_t>(n) * itemsize(dtype)), dtype, std::move(shape));
}

Tensor Tensor::zeros(DType dtype, Shape shape) {
  Tensor t = empty(dtype, std::move(shape));
  std::memset(t.raw(), 0, t.nbytes());
  return t;
}

std::int64_t Tensor::size(std::int64_t d) const {
  const std::int64_t nd = dim();
  const std::int64_t k = d < 0 ? d + nd : d;
  if (k < 0 || k >= nd)
    throw Error("Tensor::size: dimension " + std::to_string(d) + " out of range for shape " + shape_str(shape_));
  return shape_[static_cast<std::size_t>(k)];
}

Tensor Tensor::select(std::int64_t i) const {
  if (dim() == 0) throw Error("Tensor::select: cannot select from a 0-dimensional tensor");
  if (i < 0 || i >= shape_[0])
    throw Error("Tensor::select: index " + std::to_string(i) + " out of range for shape " + shape_str(shape_));
  Shape rest(shape_.begin() + 1, shape_.end());
  const std::size_t row = nbytes() / static_cast<std::size_t>(shape_[0]);
  return Tensor(storage_, dtype_, std::move(rest), offset_ + static_cast<std::size_t>(i) * row);
}

Tensor Tensor::narrow(std::int64_t start, std::int64_t length) const {
  if (dim() == 0) throw Error("Tensor::narrow: cannot narrow a 0-dimensional tensor");
  if (start < 0 || length < 0 || start + length > shape_[0])
    throw Error("Tensor::narrow: rows [" + std::to_string(start) + ", " + std::to_string(start + length) +
                ") out of range for shape " + shape_str(shape_));
  Shape s = shape_;
  const std::size_t row = shape_[0] ? nbytes() / static_cast<std::size_t>(shape_[0]) : 0;
  s[0] = length;
  return Tensor(storage_, dtype_, std::move(s), offset_ + static_cast<std::size_t>(start) * row);
}

Tensor Tensor::reshape(Shape shape) const {
  if (checked_numel(shape) != numel_)
    throw Error("Tensor::reshape: cannot view " + shape_str(shape_) + " as " + shape_str(shape));
  return Tensor(storage_, dtype_, std::move(shape), offset_);
}

Tensor Tensor::clone() const {
  if (!device().is_host())
    throw Error("Tensor::clone: only host tensors can be cloned on the host, this one is on " + device().str());
  Tensor t = empty(dtype_, shape_);
  if (nbytes()) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

bool Tensor::equal(const Tensor& other) const {
  if (!device().is_host() || !other.device().is_host()) throw Error("Tensor::equal: host tensors only");
  return dtype_ == other.dtype_ && shape_ == other.shape_ && (nbytes() == 0 || std::memcmp(raw(), other.raw(), nbytes()) == 0);
}

void Tensor::copy_from_bytes(const void* src, std::size_t n) {
  if (n != nbytes())
    throw Error("Tensor::copy_from_bytes: got " + std::to_string(n) + " bytes for " + str() + " which holds " +
                std::to_string(nbytes()));
  if (n) std::memcpy(raw(), src, n);
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return "Tensor(" + std::string(dtype_name(dtype_)) + ", " + shape_str(shape_) + ", " + device().str() + ")";
}

void Tensor::check_dtype(DType expected) const {
  if (expected != dtype_) throw Error("Tensor::data: asked for " + std::string(dtype_name(expected)) + " elements of a " + str());
}

namespace {
class PageableAllocator final : public BatchAllocator {
 public:
  Storage allocate(std::size_t nbytes) override { return Storage::allocate(nbytes); }
};
}  // namespace

BatchAllocator& pageable_allocator() noexcept {
  static PageableAllocator a;
  return a;
}

Tensor empty(DType dtype, Shape shape, BatchAllocator& allocator) {
  const std::int64_t n = checked_numel(shape);
  return Tensor(allocator.allocate(static_cast<std::size_t>(n) * itemsize(dtype)), dtype, std::move(shape));
}

}  // namespace ferry
