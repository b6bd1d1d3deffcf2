// ferry/collate/collate.h — turning a list of samples into one batch.
//
// The default rules follow PyTorch's default_collate:
//
//   sample type                         batch type
//   ferry::Tensor [d...]                ferry::Tensor [n, d...] (stacked; shapes and dtypes must match)
//   integral (not bool)                 ferry::Tensor int64 [n]
//   float, double                       ferry::Tensor float64 [n]
//   bool                                ferry::Tensor bool [n]
//   std::string                         std::vector<std::string>
//   std::pair, std::tuple, std::array   the same container of collated elements
//   std::vector<T> (one length)         std::vector<batch of T>
//   std::map<std::string, T>            std::map<std::string, batch of T> (keys must match)
//
// Collate writes into memory it is given: it first asks each rule how many bytes the batch needs
// (`bytes`), takes one buffer of that size from a BatchAllocator, then carves every tensor of the
// batch out of it (`apply`). With the pinning stage that buffer is a pinned block, so the batch is
// built in page-locked memory with no second copy.
//
// Your own types take part in one of two ways:
//
// 1. A field list (the usual way): name the sample's fields and where each goes in the batch.
//
//      struct Sample { ferry::Tensor image; int label; };
//      struct Batch  { ferry::Tensor image; ferry::Tensor label; };
//      template <> struct ferry::CollateFields<Sample> {
//        using batch_type = Batch;
//        static constexpr auto fields = std::make_tuple(std::pair{&Sample::image, &Batch::image},
//                                                       std::pair{&Sample::label, &Batch::label});
//      };
//
// 2. A full specialization of ferry::Collate<T> with `using Batch`, `bytes` and `apply`, with the
//    signatures of the rules below, for anything the rules cannot express.
//
// Or pass any callable `Batch(std::vector<Sample>&&)` as the loader's collate_fn.
//
// Errors name the offending samples by their dataset index: mismatched shapes, dtypes, lengths or
// keys throw ferry::Error.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/error.h"
#include "ferry/core/parallel.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// Alignment of every tensor carved from a batch buffer.
inline constexpr std::size_t kCollateAlign = 64;
constexpr std::size_t align_up(std::size_t n, std::size_t a = kCollateAlign) noexcept { return (n + a - 1) / a * a; }

/// What a collate rule gets: the batch's sample indices (for error messages), the buffer to carve
/// tensors from, and a pool for large copies.
class CollateContext {
 public:
  CollateContext(std::span<const std::size_t> sample_indices, Storage buffer, const ParallelFor* pool = nullptr)
      : indices_(sample_indices), buffer_(std::move(buffer)), pool_(pool) {}
  /// Dataset index of the i-th sample of the batch.
  std::size_t sample_index(std::size_t i) const { return i < indices_.size() ? indices_[i] : i; }
  std::span<const std::size_t> sample_indices() const noexcept { return indices_; }
  /// The next `nbytes(dtype, shape)` of the buffer, 64-byte aligned, as an uninitialized tensor.
  /// Throws ferry::Error if a rule asks for more than its bytes() promised.
  Tensor allocate(DType dtype, Shape shape);
  /// Copies with the large-batch pool when there is one.
  void copy(void* dst, const void* src, std::size_t bytes) const { parallel_memcpy(dst, src, bytes, pool_); }
  const ParallelFor* pool() const noexcept { return pool_; }
  /// Bytes carved so far.
  std::size_t used() const noexcept { return used_; }

 private:
  std::span<const std::size_t> indices_;
  Storage buffer_;
  const ParallelFor* pool_;
  std::size_t used_ = 0;
};

/// The collate rule for T. Each rule has
///   using Batch = ...;
///   template <class Get> static std::size_t bytes(std::size_t n, Get&& get);            // buffer bytes
///   template <class Get> static Batch apply(std::size_t n, Get&& get, CollateContext&);  // build it
/// where get(i) returns a const reference to the i-th sample's T.
template <class T>
struct Collate;

/// Specialize to collate a user struct field by field (see the header comment).
template <class T>
struct CollateFields;

template <class T>
concept Collatable = requires {
  typename Collate<T>::Batch;
};

namespace detail {
[[noreturn]] void throw_shape_mismatch(const Tensor& first, std::size_t first_index, const Tensor& other,
                                       std::size_t other_index);
[[noreturn]] void throw_length_mismatch(const char* what, std::size_t first_len, std::size_t first_index, std::size_t len,
                                        std::size_t index);
[[noreturn]] void throw_key_mismatch(const std::string& key, std::size_t first_index, std::size_t index, bool missing);
[[noreturn]] void throw_empty_batch();
void stack_into(const Tensor& out, std::size_t n, const Tensor* const* rows, CollateContext& ctx);
}  // namespace detail

template <>
struct Collate<Tensor> {
  using Batch = Tensor;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&& get) {
    if (n == 0) detail::throw_empty_batch();
    return align_up(n * get(0).nbytes());
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    const Tensor& first = get(0);
    std::vector<const Tensor*> rows(n);
    for (std::size_t i = 0; i < n; ++i) {
      const Tensor& t = get(i);
      if (t.dtype() != first.dtype() || t.shape() != first.shape())
        detail::throw_shape_mismatch(first, ctx.sample_index(0), t, ctx.sample_index(i));
      rows[i] = &t;
    }
    Shape shape{static_cast<std::int64_t>(n)};
    shape.insert(shape.end(), first.shape().begin(), first.shape().end());
    Tensor out = ctx.allocate(first.dtype(), std::move(shape));
    detail::stack_into(out, n, rows.data(), ctx);
    return out;
  }
};

namespace detail {
template <class T, class Out>
struct ScalarCollate {
  using Batch = Tensor;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&&) {
    return align_up(n * sizeof(Out));
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    Tensor out = ctx.allocate(dtype_v<Out>, {static_cast<std::int64_t>(n)});
    Out* p = out.data<Out>();
    for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<Out>(get(i));
    return out;
  }
};
}  // namespace detail

template <>
struct Collate<bool> : detail::ScalarCollate<bool, bool> {};
template <class T>
requires(std::integral<T> && !std::same_as<T, bool>) struct Collate<T> : detail::ScalarCollate<T, std::int64_t> {
};
template <std::floating_point T>
struct Collate<T> : detail::ScalarCollate<T, double> {};

template <>
struct Collate<std::string> {
  using Batch = std::vector<std::string>;
  template <class Get>
  static std::size_t bytes(std::size_t, Get&&) {
    return 0;
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext&) {
    Batch out;
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) out.push_back(get(i));
    return out;
  }
};

/// std::tuple, std::pair: element-wise.
namespace detail {
template <class Tup, template <class...> class Out>
struct TupleCollate;
template <template <class...> class Tup, class... Ts, template <class...> class Out>
struct TupleCollate<Tup<Ts...>, Out> {
  using Batch = Out<typename Collate<Ts>::Batch...>;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&& get) {
    return bytes_impl(n, get, std::index_sequence_for<Ts...>{});
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    return apply_impl(n, get, ctx, std::index_sequence_for<Ts...>{});
  }

 private:
  template <class Get, std::size_t... I>
  static std::size_t bytes_impl(std::size_t n, Get& get, std::index_sequence<I...>) {
    return (std::size_t{0} + ... + Collate<Ts>::bytes(n, [&](std::size_t i) -> const Ts& { return std::get<I>(get(i)); }));
  }
  template <class Get, std::size_t... I>
  static Batch apply_impl(std::size_t n, Get& get, CollateContext& ctx, std::index_sequence<I...>) {
    // Braced initialization evaluates left to right, so tensors are carved in field order.
    return Batch{Collate<Ts>::apply(
        n, [&](std::size_t i) -> const Ts& { return std::get<I>(get(i)); }, ctx)...};
  }
};
}  // namespace detail

template <class... Ts>
struct Collate<std::tuple<Ts...>> : detail::TupleCollate<std::tuple<Ts...>, std::tuple> {};
template <class A, class B>
struct Collate<std::pair<A, B>> : detail::TupleCollate<std::pair<A, B>, std::pair> {};

template <class T, std::size_t N>
struct Collate<std::array<T, N>> {
  using Batch = std::array<typename Collate<T>::Batch, N>;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&& get) {
    std::size_t total = 0;
    for (std::size_t j = 0; j < N; ++j) total += Collate<T>::bytes(n, [&](std::size_t i) -> const T& { return get(i)[j]; });
    return total;
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    return apply_impl(n, get, ctx, std::make_index_sequence<N>{});
  }

 private:
  template <class Get, std::size_t... J>
  static Batch apply_impl(std::size_t n, Get& get, CollateContext& ctx, std::index_sequence<J...>) {
    return Batch{Collate<T>::apply(
        n, [&](std::size_t i) -> const T& { return get(i)[J]; }, ctx)...};
  }
};

template <class T>
struct Collate<std::vector<T>> {
  using Batch = std::vector<typename Collate<T>::Batch>;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&& get) {
    if (n == 0) detail::throw_empty_batch();
    const std::size_t len = get(0).size();
    std::size_t total = 0;
    for (std::size_t j = 0; j < len; ++j) total += Collate<T>::bytes(n, [&](std::size_t i) -> const T& { return get(i)[j]; });
    return total;
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    const std::size_t len = get(0).size();
    for (std::size_t i = 1; i < n; ++i)
      if (get(i).size() != len)
        detail::throw_length_mismatch("std::vector", len, ctx.sample_index(0), get(i).size(), ctx.sample_index(i));
    Batch out;
    out.reserve(len);
    for (std::size_t j = 0; j < len; ++j)
      out.push_back(Collate<T>::apply(
          n, [&](std::size_t i) -> const T& { return get(i)[j]; }, ctx));
    return out;
  }
};

template <class T>
struct Collate<std::map<std::string, T>> {
  using Batch = std::map<std::string, typename Collate<T>::Batch>;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&& get) {
    if (n == 0) detail::throw_empty_batch();
    std::size_t total = 0;
    for (const auto& kv : get(0)) {
      const std::string& key = kv.first;
      total += Collate<T>::bytes(n, [&](std::size_t i) -> const T& { return value(get(i), key, i); });
    }
    return total;
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    const auto& first = get(0);
    for (std::size_t i = 1; i < n; ++i) {
      const auto& m = get(i);
      for (const auto& kv : first)
        if (!m.count(kv.first)) detail::throw_key_mismatch(kv.first, ctx.sample_index(0), ctx.sample_index(i), true);
      if (m.size() != first.size())
        for (const auto& kv : m)
          if (!first.count(kv.first)) detail::throw_key_mismatch(kv.first, ctx.sample_index(0), ctx.sample_index(i), false);
    }
    Batch out;
    for (const auto& kv : first) {
      const std::string& key = kv.first;
      out.emplace(key, Collate<T>::apply(
                           n, [&](std::size_t i) -> const T& { return get(i).at(key); }, ctx));
    }
    return out;
  }

 private:
  static const T& value(const std::map<std::string, T>& m, const std::string& key, std::size_t i) {
    auto it = m.find(key);
    if (it == m.end()) detail::throw_key_mismatch(key, 0, i, true);
    return it->second;
  }
};

/// User structs described by CollateFields<T>.
template <class T>
requires requires { typename CollateFields<T>::batch_type; }
struct Collate<T> {
  using Batch = typename CollateFields<T>::batch_type;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&& get) {
    std::size_t total = 0;
    std::apply([&](const auto&... f) { ((total += field_bytes(n, get, f)), ...); }, CollateFields<T>::fields);
    return total;
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    Batch out{};
    std::apply([&](const auto&... f) { (field_apply(n, get, ctx, out, f), ...); }, CollateFields<T>::fields);
    return out;
  }

 private:
  template <class Get, class F>
  static std::size_t field_bytes(std::size_t n, Get& get, const F& f) {
    using Field = std::remove_cvref_t<decltype(get(0).*(f.first))>;
    return Collate<Field>::bytes(n, [&](std::size_t i) -> const Field& { return get(i).*(f.first); });
  }
  template <class Get, class F>
  static void field_apply(std::size_t n, Get& get, CollateContext& ctx, Batch& out, const F& f) {
    using Field = std::remove_cvref_t<decltype(get(0).*(f.first))>;
    out.*(f.second) = Collate<Field>::apply(
        n, [&](std::size_t i) -> const Field& { return get(i).*(f.first); }, ctx);
  }
};

/// Collates n samples, get(i) returning the i-th, into one buffer from `allocator`; `indices` are
/// the samples' dataset indices, used in error messages.
template <class S, class Get>
typename Collate<S>::Batch collate_with(std::size_t n, Get&& get, std::span<const std::size_t> indices,
                                        BatchAllocator& allocator = pageable_allocator(), const ParallelFor* pool = nullptr) {
  if (n == 0) detail::throw_empty_batch();
  const std::size_t nbytes = Collate<S>::bytes(n, get);
  CollateContext ctx(indices, allocator.allocate(nbytes), pool);
  return Collate<S>::apply(n, get, ctx);
}

/// Collates `samples` (whose dataset indices are `indices`) into one buffer from `allocator`.
template <Collatable S>
typename Collate<S>::Batch collate(std::span<const S> samples, std::span<const std::size_t> indices,
                                   BatchAllocator& allocator = pageable_allocator(), const ParallelFor* pool = nullptr) {
  return collate_with<S>(
      samples.size(), [&](std::size_t i) -> const S& { return samples[i]; }, indices, allocator, pool);
}

/// Collates a vector of samples whose dataset indices are 0..n-1.
template <Collatable S>
typename Collate<S>::Batch collate(const std::vector<S>& samples) {
  std::vector<std::size_t> idx(samples.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  if constexpr (std::is_same_v<S, bool>) {
    return collate_with<S>(
        samples.size(), [&](std::size_t i) -> bool { return samples[i]; }, idx);
  } else {
    return collate_with<S>(
        samples.size(), [&](std::size_t i) -> const S& { return samples[i]; }, idx);
  }
}

/// The loader's default collate_fn: the rules above.
struct DefaultCollate {};

}  // namespace ferry
