#include "ferry/collate/collate.h"

#include <cstring>

namespace ferry {

Tensor CollateContext::allocate(DType dtype, Shape shape) {
  std::int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const std::size_t nbytes = static_cast<std::size_t>(numel) * itemsize(dtype);
  const std::size_t need = align_up(nbytes);
  if (used_ + need > buffer_.nbytes())
    throw Error("collate: a rule asked for " + std::to_string(need) + " more bytes than its bytes() reserved (" +
                std::to_string(used_) + " of " + std::to_string(buffer_.nbytes()) + " used); its bytes() and apply() disagree");
  Tensor t(buffer_, dtype, std::move(shape), used_);
  used_ += need;
  return t;
}

namespace detail {

void throw_shape_mismatch(const Tensor& first, std::size_t first_index, const Tensor& other, std::size_t other_index) {
  throw Error("collate: cannot stack sample " + std::to_string(other_index) + " (" + dtype_name(other.dtype()) + " " +
              shape_str(other.shape()) + ") with sample " + std::to_string(first_index) + " (" + dtype_name(first.dtype()) + " " +
              shape_str(first.shape()) +
              "); tensors in one batch must have the same shape and dtype (pad them, or pass a collate_fn)");
}

void throw_length_mismatch(const char* what, std::size_t first_len, std::size_t first_index, std::size_t len, std::size_t index) {
  throw Error(std::string("collate: ") + what + " of sample " + std::to_string(index) + " has " + std::to_string(len) +
              " elements but sample " + std::to_string(first_index) + " has " + std::to_string(first_len) + "; every sample's " +
              what + " must have the same length");
}

void throw_key_mismatch(const std::string& key, std::size_t first_index, std::size_t index, bool missing) {
  throw Error("collate: key '" + key + "' is " + (missing ? "missing from" : "only in") + " sample " + std::to_string(index) +
              (missing ? " but present in" : ", not in") + " sample " + std::to_string(first_index) +
              "; every map in a batch must have the same keys");
}

void throw_empty_batch() { throw Error("collate: cannot collate an empty batch"); }

void stack_into(const Tensor& out, std::size_t n, const Tensor* const* rows, CollateContext& ctx) {
  if (n == 0) return;
  const std::size_t row = rows[0]->nbytes();
  auto* dst = static_cast<std::byte*>(out.raw());
  const ParallelFor* pool = ctx.pool();
  // Large batches: rows in parallel. Each row is one memcpy.
  if (pool && pool->threads() > 1 && row * n >= (std::size_t{4} << 20)) {
    const std::size_t grain = std::max<std::size_t>(1, (std::size_t{1} << 20) / std::max<std::size_t>(row, 1));
    pool->run(
        n,
        [&](std::size_t b, std::size_t e) {
          for (std::size_t i = b; i < e; ++i) std::memcpy(dst + i * row, rows[i]->raw(), row);
        },
        grain);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) std::memcpy(dst + i * row, rows[i]->raw(), row);
}

}  // namespace detail
}  // namespace ferry
