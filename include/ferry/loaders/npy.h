// ferry/loaders/npy.h — NumPy .npy arrays, memory-mapped, rows as samples.
//
//   ferry::NpyDataset features("features.npy");      // float32 [N, 784] on disk
//   features.get(7);                                 // float32 [784], a view into the mapping
//   ferry::DataLoader loader(features, {.batch_size = 256});
//
// Supported: format versions 1.0, 2.0 and 3.0; C order; little-endian (or byte-order-free)
// bool, int8/16/32/64, uint8, float16/32/64. Big-endian, Fortran-order, structured and object
// arrays are refused with a DataError naming the file and what it holds; so are truncated data,
// a header that does not parse, and data whose size does not match the shape.
//
// Thread safety: immutable after construction.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// Maps a .npy file; the tensor shares the mapping (copy-on-write: writes never reach the file).
Tensor read_npy(const std::string& path);
/// Parses .npy bytes in memory (copied out); `name` is used in errors.
Tensor parse_npy(std::span<const std::byte> bytes, const std::string& name);

/// Row i of a .npy array (a 0-dimensional array is refused). Direct mode supported.
class NpyDataset : public DatasetBase<NpyDataset> {
 public:
  explicit NpyDataset(const std::string& path);
  explicit NpyDataset(Tensor array);
  std::size_t size() const noexcept { return static_cast<std::size_t>(array_.size(0)); }
  /// A view of row i (no copy).
  Tensor get(std::size_t i) const;
  Tensor make_batch(std::size_t rows, BatchAllocator& allocator) const;
  void get_into(std::size_t i, Tensor& batch, std::size_t row, SampleContext&) const;
  const Tensor& array() const noexcept { return array_; }
  /// Its rows for the device gather (Note [Device gather], ferry/pinning/gather.h).
  std::vector<HostRows> host_rows(std::string& why) const;

 private:
  Tensor array_;
  std::string name_;
  bool mapped_ = false;  // the array is the mapping of a file (HostRows::mapped_file)
};

}  // namespace ferry
