// ferry/core/tensor.h — dtypes, storage and the contiguous Tensor that batches are made of.
//
// A Tensor is a dtype, a shape and a byte offset into a Storage. Storage is a reference-counted
// block of bytes that knows which memory it lives in (pageable host, pinned host, or a device) and
// who owns it; copying a Tensor or a Storage shares the bytes, never copies them. Tensors are
// always C-contiguous: the only views are along the first dimension (`select`, `narrow`), which
// keep that property.
//
//   ferry::Tensor t = ferry::Tensor::empty(ferry::DType::Float32, {256, 784});
//   float* rows = t.data<float>();
//   ferry::Tensor first = t.select(0);          // shape {784}, shares t's storage
//   ferry::Tensor half  = t.narrow(0, 128);     // shape {128, 784}
//
// Thread safety: a Tensor value may be read from many threads at once; the bytes it points to are
// not synchronized by ferry (as with any buffer). Reference counts are atomic, so copies of one
// Tensor may be made and destroyed concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace ferry {

/// Element types, as in PyTorch.
enum class DType : std::uint8_t { Bool, UInt8, Int8, Int16, Int32, Int64, Float16, BFloat16, Float32, Float64 };

/// Bytes per element.
std::size_t itemsize(DType dtype) noexcept;
/// "float32", "uint8", ...
const char* dtype_name(DType dtype) noexcept;

/// Storage for 16-bit floats: ferry moves them, it does no arithmetic on them.
struct Half {
  std::uint16_t bits;
};
struct BFloat16 {
  std::uint16_t bits;
};

/// The DType of a C++ element type (compile error for types with none).
template <class T>
struct dtype_of;
template <>
struct dtype_of<bool> {
  static constexpr DType value = DType::Bool;
};
template <>
struct dtype_of<std::uint8_t> {
  static constexpr DType value = DType::UInt8;
};
template <>
struct dtype_of<std::int8_t> {
  static constexpr DType value = DType::Int8;
};
template <>
struct dtype_of<std::int16_t> {
  static constexpr DType value = DType::Int16;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr DType value = DType::Int32;
};
template <>
struct dtype_of<std::int64_t> {
  static constexpr DType value = DType::Int64;
};
template <>
struct dtype_of<Half> {
  static constexpr DType value = DType::Float16;
};
template <>
struct dtype_of<BFloat16> {
  static constexpr DType value = DType::BFloat16;
};
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::Float32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::Float64;
};
template <class T>
inline constexpr DType dtype_v = dtype_of<std::remove_cv_t<T>>::value;

/// Which memory a Storage lives in.
enum class MemoryKind : std::uint8_t { Host, PinnedHost, Device };

/// Where bytes live: pageable host, pinned host, or device `index`.
struct Device {
  MemoryKind kind = MemoryKind::Host;
  int index = 0;  ///< device ordinal; 0 for host memory
  static Device host() noexcept { return {MemoryKind::Host, 0}; }
  static Device pinned() noexcept { return {MemoryKind::PinnedHost, 0}; }
  static Device cuda(int index = 0) noexcept { return {MemoryKind::Device, index}; }
  bool is_host() const noexcept { return kind != MemoryKind::Device; }
  friend bool operator==(const Device&, const Device&) = default;
  /// "cpu", "cpu(pinned)", "cuda:0".
  std::string str() const;
};

/// Shape of a tensor: extents of each dimension, outermost first.
using Shape = std::vector<std::int64_t>;
/// "[256, 3, 224, 224]".
std::string shape_str(std::span<const std::int64_t> shape);

/// A reference-counted block of bytes in some memory. Copies share the block.
class Storage {
 public:
  Storage() = default;
  /// Fresh pageable host memory, 64-byte aligned, uninitialized.
  static Storage allocate(std::size_t nbytes);
  /// Wraps memory owned elsewhere: `owner` keeps it alive and is released with the last reference.
  static Storage wrap(void* data, std::size_t nbytes, Device device, std::shared_ptr<void> owner);

  std::byte* data() const noexcept { return data_; }
  std::size_t nbytes() const noexcept { return nbytes_; }
  Device device() const noexcept { return device_; }
  /// The object keeping the bytes alive (shared with every Tensor over them).
  const std::shared_ptr<void>& owner() const noexcept { return owner_; }
  explicit operator bool() const noexcept { return owner_ != nullptr; }
  /// Number of Storage and Tensor references to the bytes.
  long use_count() const noexcept { return owner_.use_count(); }

 private:
  std::byte* data_ = nullptr;
  std::size_t nbytes_ = 0;
  Device device_{};
  std::shared_ptr<void> owner_;
};

/// A contiguous n-dimensional array over a Storage.
class Tensor {
 public:
  /// An undefined tensor (defined() is false).
  Tensor() = default;
  /// A tensor over `storage` starting `offset` bytes in; throws ferry::Error if it does not fit.
  Tensor(Storage storage, DType dtype, Shape shape, std::size_t offset = 0);

  /// Uninitialized pageable host tensor.
  static Tensor empty(DType dtype, Shape shape);
  /// Zero-filled pageable host tensor.
  static Tensor zeros(DType dtype, Shape shape);
  /// Copies `values` into a new 1-D tensor, or one of `shape` when given (numel must match).
  template <class T>
  static Tensor from(std::span<const T> values, Shape shape = {}) {
    Tensor t = empty(dtype_v<T>, shape.empty() ? Shape{static_cast<std::int64_t>(values.size())} : std::move(shape));
    t.copy_from_bytes(values.data(), values.size_bytes());
    return t;
  }
  template <class T>
  static Tensor from(const std::vector<T>& values, Shape shape = {}) {
    return from(std::span<const T>(values), std::move(shape));
  }
  /// A 0-dimensional tensor holding one value.
  template <class T>
  static Tensor scalar(T value) {
    Tensor t = empty(dtype_v<T>, {});
    *t.data<T>() = value;
    return t;
  }

  bool defined() const noexcept { return static_cast<bool>(storage_.owner()); }
  DType dtype() const noexcept { return dtype_; }
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t dim() const noexcept { return static_cast<std::int64_t>(shape_.size()); }
  /// Extent of dimension `d` (negative counts from the end); throws ferry::Error when out of range.
  std::int64_t size(std::int64_t d) const;
  std::int64_t numel() const noexcept { return numel_; }
  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(numel_) * itemsize(dtype_); }
  std::size_t offset() const noexcept { return offset_; }
  const Storage& storage() const noexcept { return storage_; }
  Device device() const noexcept { return storage_.device(); }
  bool is_pinned() const noexcept { return storage_.device().kind == MemoryKind::PinnedHost; }

  /// Untyped pointer to the first element.
  void* raw() const noexcept { return storage_.data() + offset_; }
  /// Typed pointer; throws ferry::Error when T does not match dtype().
  template <class T>
  T* data() const {
    check_dtype(dtype_v<T>);
    return reinterpret_cast<T*>(raw());
  }
  /// Element at flat index `i` (host memory only; not bounds-checked).
  template <class T>
  T item(std::int64_t i = 0) const {
    return data<T>()[i];
  }

  /// Row `i` of the first dimension, with that dimension removed. Shares storage.
  Tensor select(std::int64_t i) const;
  /// Rows [start, start + length) of the first dimension. Shares storage.
  Tensor narrow(std::int64_t start, std::int64_t length) const;
  /// Same bytes, another shape with the same numel. Shares storage.
  Tensor reshape(Shape shape) const;
  /// A deep copy into fresh pageable host memory (host tensors only).
  Tensor clone() const;
  /// Bytewise equality of dtype, shape and contents (host tensors only).
  bool equal(const Tensor& other) const;
  /// Copies raw bytes in; throws when `nbytes` differs from this->nbytes().
  void copy_from_bytes(const void* src, std::size_t nbytes);
  /// "Tensor(float32, [256, 784], cpu)".
  std::string str() const;

 private:
  void check_dtype(DType expected) const;
  Storage storage_;
  std::size_t offset_ = 0;
  DType dtype_ = DType::Float32;
  Shape shape_;
  std::int64_t numel_ = 0;
};

}  // namespace ferry
