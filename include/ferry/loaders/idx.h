// ferry/loaders/idx.h — the IDX format of MNIST and Fashion-MNIST.
//
// An IDX file is a big-endian header (two zero bytes, a type code, the number of dimensions, then
// each dimension as a 32-bit integer) followed by the elements. Files may be gzip-compressed, as
// the published ones are: read_idx() inflates them once into memory; raw files are memory-mapped
// (uint8 data is used in place, other types are byte-swapped into host order once).
//
//   ferry::IdxDataset train("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz",
//                           "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz",
//                           {.transform = ferry::ImageTransform().to_float().normalize({0.286f}, {0.353f})});
//   train.get(0).image;   // [1, 28, 28] float32 (uint8 [28, 28] without a transform)
//
// Every malformed file (wrong magic, unknown type code, dimensions that do not match the file
// size, truncated data, trailing bytes, corrupt gzip) is a ferry::DataError naming the file and
// the byte offset.
//
// Thread safety: the dataset is immutable after construction; get() and get_into() may run on
// many threads at once.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/rows.h"
#include "ferry/core/tensor.h"
#include "ferry/loaders/sample.h"
#include "ferry/loaders/transforms.h"

namespace ferry {

/// Reads an IDX file (raw or gzip). Raw uint8/int8 files are mapped and shared, not copied.
Tensor read_idx(const std::string& path);
/// Parses IDX data already in memory (raw or gzip); `name` is used in errors. The result copies
/// the data out of `bytes`.
Tensor parse_idx(std::span<const std::byte> bytes, const std::string& name);

struct IdxDatasetOptions {
  /// Applied to each image ([H, W] uint8, as grayscale) in the worker; empty = none.
  ImageTransform transform;
};

/// Images and labels from two IDX files, as torchvision.datasets.MNIST. Samples are
/// LabeledSample{image, label}; supports the loader's direct mode (each image is written, and
/// transformed, straight into its row of the batch).
class IdxDataset : public DatasetBase<IdxDataset> {
 public:
  /// Throws DataError when either file is malformed, the labels are not 1-D, or the counts differ.
  IdxDataset(const std::string& images_path, const std::string& labels_path, IdxDatasetOptions options = {});
  /// From tensors already read (images [N, H, W] uint8, labels [N] integer).
  IdxDataset(Tensor images, Tensor labels, IdxDatasetOptions options = {});

  std::size_t size() const noexcept { return size_; }
  LabeledSample get(std::size_t i, SampleContext& ctx) const;
  LabeledBatch make_batch(std::size_t rows, BatchAllocator& allocator) const;
  void get_into(std::size_t i, LabeledBatch& batch, std::size_t row, SampleContext& ctx) const;

  /// The device gather (ferry/core/rows.h): images and labels as rows (labels as int64, as the
  /// batch holds them). A transform that only flips, converts and normalizes uint8 images runs in
  /// the gather kernel (ImageTransform::row_transform); with any other, none, with `why`.
  std::vector<HostRows> host_rows(std::string& why) const;

  const Tensor& images() const noexcept { return images_; }
  const Tensor& labels() const noexcept { return labels_; }
  /// The shape of one (transformed) sample image.
  const Shape& sample_shape() const noexcept { return sample_shape_; }

 private:
  void init();
  bool mapped_ = false;  // images_ is a file's mapping (raw IDX); set while images_ is read, so declared first
  Tensor images_, labels_;
  Tensor labels64_;  // labels as int64 [N], the rows the device gather reads
  IdxDatasetOptions options_;
  std::size_t size_ = 0;
  Shape sample_shape_;
  DType sample_dtype_ = DType::UInt8;
};

}  // namespace ferry
