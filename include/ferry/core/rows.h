// ferry/core/rows.h — datasets whose samples are rows of host arrays, for the device gather
// (Note [Device gather] in ferry/pinning/gather.h).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// How the loader makes device batches of row datasets (Note [Device gather]).
enum class Gather {
  Auto,    ///< the device gather where it applies (device set, a RowGatherDataset, no collate_fn)
  Host,    ///< workers copy rows into pinned blocks, the copy engine moves them (the general path)
  Device,  ///< the device gather, or an Error saying why it cannot apply
};

/// One field of a dataset as rows of one host array: sample i's field is the `row_bytes` bytes at
/// `data + i * row_bytes`, of type `dtype` and shape `row_shape`.
struct HostRows {
  const void* data = nullptr;
  std::int64_t rows = 0;
  std::size_t row_bytes = 0;
  DType dtype = DType::UInt8;
  Shape row_shape;
  std::string name;  ///< for errors: "tensor 1", "features.npy"
  /// The rows are a memory-mapped file (a .npy). Gather::Auto leaves such rows to the host path
  /// (Note [Device gather], "mapped files"); Gather::Device gathers them.
  bool mapped_file = false;
};

/// A dataset whose batch fields are rows of host arrays (see the Note). host_rows() gives one
/// HostRows per field of the batch, in order (or none, with `why` set, to decline). The batch is a
/// Tensor (one field), a std::vector<Tensor>, or a FieldsBatch.
template <class D>
concept RowGatherDataset = requires(const D& d, std::string& why) {
  { d.host_rows(why) } -> std::same_as<std::vector<HostRows>>;
};

/// A batch type the device gather can assemble from its fields' device tensors, in host_rows()
/// order (LabeledBatch: image, label).
template <class B>
concept FieldsBatch = requires(std::vector<Tensor>&& fields) {
  { B::from_fields(std::move(fields)) } -> std::same_as<B>;
  { B::kGatheredFields } -> std::convertible_to<std::size_t>;
};

namespace detail {
/// The indices of a batch as an int64 tensor from `allocator`; an Error for an index past `n`
/// (the same message as the host path's).
Tensor gather_index(std::span<const std::size_t> indices, std::size_t n, BatchAllocator& allocator);
}  // namespace detail

}  // namespace ferry
