// ferry/loaders/image.h — JPEG and PNG decoding, and folders of images as a dataset.
//
// decode_image() turns the bytes of a JPEG (libjpeg-turbo) or PNG (libpng) file into a uint8
// [H, W, C] tensor. Corrupt or truncated data, a format that is neither, or an image larger than
// the pixel limit is a ferry::DataError naming the image; libjpeg's warnings (such as "premature
// end of data") count as errors, so a damaged file never yields a half-grey image silently.
//
// ImageFolder reads a tree laid out as torchvision.datasets.ImageFolder expects:
//
//   root/cat/001.jpg          classes are the subfolders of root, sorted by name (byte order);
//   root/cat/nested/002.png   label = the class's position; files are found recursively and
//   root/dog/003.jpeg         sorted by path, so indices are the same on every machine.
//
//   ferry::ImageFolder train("photos/train", {.transform = ferry::ImageTransform()
//                                                  .random_resized_crop(224, 224)
//                                                  .horizontal_flip()
//                                                  .to_float()});
//   ferry::DataLoader loader(train, {.batch_size = 256, .num_workers = 8});
//
// With a transform whose output size is fixed, ImageFolder supports the loader's direct mode:
// each worker decodes into a reused per-thread buffer and transforms straight into the sample's
// row of the batch (which is pinned memory when pinning in direct mode).
//
// Thread safety: decode_image() may run on many threads at once (decoder state is per thread);
// an ImageFolder is immutable after construction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/tensor.h"
#include "ferry/loaders/sample.h"
#include "ferry/loaders/transforms.h"

namespace ferry {

/// Image file formats ferry decodes.
enum class ImageFormat : std::uint8_t { Unknown, Jpeg, Png };
/// Recognizes JPEG and PNG by their magic bytes.
ImageFormat sniff_image(std::span<const std::byte> bytes) noexcept;

struct DecodeOptions {
  /// Channels to produce: 0 = the file's own (1 gray, 3 RGB, 4 RGBA; gray+alpha becomes RGBA),
  /// 1 = grayscale, 3 = RGB, 4 = RGBA (alpha 255 where the file has none).
  int channels = 0;
  /// Images with more pixels than this are refused (a DataError), before any allocation.
  std::int64_t max_pixels = std::int64_t{1} << 28;
  /// decode_transformed_into() only: decode a JPEG at 1/2, 1/4 or 1/8 scale (libjpeg-turbo's IDCT
  /// scaling) when the transform's crop box is at least that many times its output on both axes.
  /// Faster on large images; the values are then close to, not equal to, a full decode's.
  bool dct_scaling = false;
};

/// Decodes a JPEG or PNG held in memory into a new uint8 [H, W, C] tensor. `name` is used in errors.
Tensor decode_image(std::span<const std::byte> bytes, const std::string& name, const DecodeOptions& options = {});
/// transform.apply_into(decode_image(bytes, name, options), out, rng), decoding only the part of a
/// JPEG the transform reads: the rows down to the last one it needs, and IDCT and colour conversion
/// only for its columns. The result is the same bit for bit (unless options.dct_scaling); a file
/// damaged only below those rows is not an error here. Used by ImageFolder and tar image records.
/// `out` as apply_into() requires: output_shape() and output_dtype() of the decoded image.
void decode_transformed_into(std::span<const std::byte> bytes, const std::string& name, const ImageTransform& transform,
                             Generator& rng, const Tensor& out, const DecodeOptions& options = {});
/// Reads and decodes an image file.
Tensor read_image(const std::string& path, const DecodeOptions& options = {});

/// GPU decode's worker side for one file (ImageFolderOptions::decode = Gpu): checks that `bytes`
/// is a JPEG whose header reads and whose size is within `max_pixels` (a DataError naming `name`
/// otherwise), and draws its transform's single-pass plan from `rng` as the CPU path would.
struct JpegPlan {
  int height = 0, width = 0;
  ImagePassPlan plan;
};
JpegPlan plan_jpeg(std::span<const std::byte> bytes, const std::string& name, const ImageTransform& transform, Generator& rng,
                   std::int64_t max_pixels = std::int64_t{1} << 28);

/// One JPEG left compressed for the device stage, as a sample: a stream's GPU decode
/// (encode_labeled_image in ferry/loaders/tar.h). The loader's default collate packs a batch of
/// them into one LabeledBatch (LabeledBatch::encoded and encoded_index), which the device stage
/// decodes, crops, flips and normalizes into `image`, as it does ImageFolder's and TarImages'
/// decode = Gpu batches; a loader of them needs `device` and the default collate.
struct EncodedImage {
  std::vector<std::byte> bytes;  ///< the JPEG file
  JpegPlan plan;                 ///< its size and its transform's pass (plan_jpeg)
  std::int64_t label = 0;
  /// Tells the loader that these samples are decoded on the device (DataLoader checks it).
  static constexpr bool decoded_on_device = true;
};

namespace detail {
/// Fills one row (kEncodedIndexWords words) of an encoded batch's index: the file's `bytes` at
/// `offset` of the batch's block, decoded and transformed as `plan` says.
void write_encoded_row(std::int64_t* row, std::size_t offset, std::size_t bytes, const JpegPlan& plan);
/// Words a row of an encoded batch's index holds.
std::int64_t encoded_index_words() noexcept;
}  // namespace detail

/// The default collate of EncodedImages: their files end to end in one block (each at a 64-byte
/// boundary), one index row and one label each.
template <>
struct Collate<EncodedImage> {
  using Batch = LabeledBatch;
  template <class Get>
  static std::size_t bytes(std::size_t n, Get&& get) {
    if (n == 0) detail::throw_empty_batch();
    std::size_t block = 0;
    for (std::size_t i = 0; i < n; ++i) block += align_up(get(i).bytes.size());
    const auto words = static_cast<std::size_t>(detail::encoded_index_words());
    return align_up(n * sizeof(std::int64_t)) + align_up(n * words * sizeof(std::int64_t)) +
           align_up(std::max<std::size_t>(block, 1));
  }
  template <class Get>
  static Batch apply(std::size_t n, Get&& get, CollateContext& ctx) {
    std::size_t block = 0;
    for (std::size_t i = 0; i < n; ++i) block += align_up(get(i).bytes.size());
    const auto rows = static_cast<std::int64_t>(n);
    LabeledBatch b;
    b.label = ctx.allocate(DType::Int64, {rows});
    b.encoded_index = ctx.allocate(DType::Int64, {rows, detail::encoded_index_words()});
    b.encoded = ctx.allocate(DType::UInt8, {static_cast<std::int64_t>(std::max<std::size_t>(block, 1))});
    std::size_t at = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const EncodedImage& e = get(i);
      if (!e.bytes.empty()) std::memcpy(b.encoded.data<std::uint8_t>() + at, e.bytes.data(), e.bytes.size());
      detail::write_encoded_row(
          b.encoded_index.data<std::int64_t>() + static_cast<std::int64_t>(i) * detail::encoded_index_words(), at, e.bytes.size(),
          e.plan);
      b.label.data<std::int64_t>()[i] = e.label;
      at += align_up(e.bytes.size());
    }
    return b;
  }
};

struct ImageFolderOptions {
  /// Channels of every decoded image (see DecodeOptions::channels); 3 unless set.
  int channels = 3;
  /// Applied to each decoded [H, W, C] uint8 image in the worker; empty = none (the loader can then
  /// batch only images that all have one size).
  ImageTransform transform;
  /// File extensions to include, lower case, with the dot.
  std::vector<std::string> extensions{".jpg", ".jpeg", ".png"};
  std::int64_t max_pixels = std::int64_t{1} << 28;
  /// Decode JPEGs at 1/2, 1/4 or 1/8 scale where the crop is that much larger than the output
  /// (DecodeOptions::dct_scaling). Cpu decode only.
  bool dct_scaling = false;
  /// Where JPEGs are decoded. Cpu: in the workers (TurboJPEG, then the transform). Gpu: the workers
  /// only read each file and draw its crop and flip (the same draws as on the CPU, from the
  /// sample's generator); the loader's device stage decodes the batch with nvJPEG and applies the
  /// transform in one kernel (DeviceStage::decode_images). Gpu needs DataLoaderOptions::device,
  /// JPEG files (a PNG is a DataError naming it), channels = 3 and a transform that runs as one
  /// pass (ImageTransform::plan). In direct mode only (the default collate).
  enum class Decode : std::uint8_t { Cpu, Gpu };
  Decode decode = Decode::Cpu;
};

/// One class per subfolder of `root`; samples are LabeledSample{image, class index}.
class ImageFolder : public DatasetBase<ImageFolder> {
 public:
  /// Scans `root`: a local folder, or a prefix in S3-compatible storage ("s3://bucket/train/",
  /// listed once with ListObjectsV2; each image is then one GET, settings as loaders/s3.h's Note
  /// [S3 settings]). DataError names the folder when root is missing or unreadable, has no class
  /// folders, or a class folder holds no image.
  explicit ImageFolder(const std::string& root, ImageFolderOptions options = {});

  std::size_t size() const noexcept { return files_.size(); }
  LabeledSample get(std::size_t i, SampleContext& ctx) const;
  /// Direct mode; throws ferry::Error unless the transform fixes the output size.
  LabeledBatch make_batch(std::size_t rows, BatchAllocator& allocator) const;
  void get_into(std::size_t i, LabeledBatch& batch, std::size_t row, SampleContext& ctx) const;
  /// Under an s3:// root, requests a batch's images together on the calling worker's
  /// connections (the loader calls it before the batch's samples); nothing for a local folder.
  void prefetch(std::span<const std::size_t> indices) const;

  /// Class names, sorted; a label indexes this list.
  const std::vector<std::string>& classes() const noexcept { return classes_; }
  /// Whether batches hold compressed JPEGs that the device stage decodes (Decode::Gpu).
  bool decodes_on_device() const noexcept { return options_.decode == ImageFolderOptions::Decode::Gpu; }
  /// The file and label of sample i.
  const std::string& path(std::size_t i) const { return files_.at(i).path; }
  std::int64_t label(std::size_t i) const { return files_.at(i).label; }

 private:
  struct File {
    std::string path;
    std::int64_t label;
  };
  std::vector<std::string> classes_;
  std::vector<File> files_;
  ImageFolderOptions options_;
  bool remote_ = false;   // root is an s3:// prefix
  std::size_t slot_ = 0;  // Decode::Gpu: bytes per image in a batch's encoded block (the largest file)
  struct Rows;
  Rows rows() const;
};

}  // namespace ferry
