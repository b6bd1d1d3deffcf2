#include "ferry/loaders/idx.h"

#include <bit>
#include <cstring>
#include <sstream>

#include "io.h"

namespace ferry {
namespace {

using loaders::ByteSource;

DType idx_dtype(std::uint8_t code, const ByteSource& src) {
  switch (code) {
    case 0x08: return DType::UInt8;
    case 0x09: return DType::Int8;
    case 0x0B: return DType::Int16;
    case 0x0C: return DType::Int32;
    case 0x0D: return DType::Float32;
    case 0x0E: return DType::Float64;
  }
  std::ostringstream os;
  os << "unknown IDX element type code 0x" << std::hex << int(code) << " (expected 0x08, 0x09, 0x0B, 0x0C, 0x0D or 0x0E)";
  throw DataError(src.name(), 2, os.str());
}

struct Header {
  DType dtype;
  Shape shape;
  std::uint64_t nbytes;
};

Header read_header(ByteSource& src, std::size_t file_size) {
  std::uint8_t magic[4];
  src.read_exact(magic, 4, "IDX header");
  if (magic[0] != 0 || magic[1] != 0) {
    std::ostringstream os;
    os << "not an IDX file: the magic number starts 0x" << std::hex << int(magic[0]) << " 0x" << int(magic[1])
       << ", expected 0x0 0x0";
    throw DataError(src.name(), 0, os.str());
  }
  Header h{idx_dtype(magic[2], src), {}, 0};
  const int ndims = magic[3];
  if (ndims < 1) throw DataError(src.name(), 3, "IDX header declares 0 dimensions");
  std::uint64_t numel = 1;
  for (int d = 0; d < ndims; ++d) {
    std::uint8_t b[4];
    const std::uint64_t at = src.offset();
    src.read_exact(b, 4, "IDX dimension field");
    const std::uint32_t v = (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | b[3];
    if (v > 0x7fffffffu)
      throw DataError(src.name(), at,
                      "IDX dimension " + std::to_string(d) + " is " + std::to_string(v) + ", larger than 2^31 - 1");
    h.shape.push_back(v);
    numel = loaders::checked_mul(numel, v, src.name(), "IDX element count", at);  // `at`: this dimension's field
  }
  h.nbytes = loaders::checked_mul(numel, itemsize(h.dtype), src.name(), "IDX data size");
  // A gzip stream inflates at most ~1032:1; a header claiming more cannot be true (and must not
  // make us allocate it).
  if (src.compressed() && h.nbytes > static_cast<std::uint64_t>(file_size) * 1032 + 4096)
    throw DataError(src.name(), src.offset(),
                    "IDX dimensions " + shape_str(h.shape) + " need " + std::to_string(h.nbytes) + " bytes, more than a " +
                        std::to_string(file_size) + "-byte gzip file can hold");
  return h;
}

void to_host_order(Tensor& t) {
  const std::size_t k = itemsize(t.dtype());
  if (k == 1 || std::endian::native == std::endian::big) return;
  auto* p = static_cast<std::uint8_t*>(t.raw());
  for (std::size_t i = 0, n = t.nbytes(); i < n; i += k)
    for (std::size_t a = 0, b = k - 1; a < b; ++a, --b) std::swap(p[i + a], p[i + b]);
}

std::string size_mismatch(const Header& h, std::uint64_t have) {
  return "IDX dimensions " + shape_str(h.shape) + " of " + dtype_name(h.dtype) + " need " + std::to_string(h.nbytes) +
         " bytes of data, the file has " + std::to_string(have) + (have > h.nbytes ? " (trailing bytes)" : " (truncated)");
}

// `mapped` (if given) is set when the tensor is the file's mapping, used in place.
Tensor parse(std::span<const std::byte> bytes, const std::string& name, const std::shared_ptr<const loaders::MappedFile>& map,
             bool* mapped = nullptr) {
  ByteSource src(bytes, name);
  Header h = read_header(src, bytes.size());
  const std::uint64_t data_at = src.offset();
  if (!src.compressed()) {
    const std::span<const std::byte> rest = src.rest();
    if (rest.size() != h.nbytes) throw DataError(name, data_at, size_mismatch(h, rest.size()));
    if (map && itemsize(h.dtype) == 1) {
      // In place: the tensor keeps the mapping alive.
      Storage s =
          Storage::wrap(map->data() + data_at, h.nbytes, Device::host(), std::const_pointer_cast<loaders::MappedFile>(map));
      if (mapped) *mapped = true;
      return Tensor(std::move(s), h.dtype, std::move(h.shape));
    }
    Tensor t = Tensor::empty(h.dtype, std::move(h.shape));
    std::memcpy(t.raw(), rest.data(), h.nbytes);
    to_host_order(t);
    return t;
  }
  Tensor t = Tensor::empty(h.dtype, h.shape);
  src.read_exact(t.raw(), h.nbytes, "IDX data");
  if (!src.at_end())
    throw DataError(
        name, src.offset(),
        "trailing data after the " + std::to_string(h.nbytes) + " bytes the IDX dimensions " + shape_str(h.shape) + " describe");
  to_host_order(t);
  return t;
}

Tensor read_idx(const std::string& path, bool& mapped) {
  auto map = loaders::MappedFile::open(path);
  return parse(map->bytes(), path, map, &mapped);
}

}  // namespace

Tensor parse_idx(std::span<const std::byte> bytes, const std::string& name) {
  if (bytes.empty()) throw DataError(name, DataError::kNoOffset, "is empty (0 bytes)");
  return parse(bytes, name, nullptr);
}

Tensor read_idx(const std::string& path) {
  auto map = loaders::MappedFile::open(path);
  return parse(map->bytes(), path, map);
}

IdxDataset::IdxDataset(const std::string& images_path, const std::string& labels_path, IdxDatasetOptions options)
    : images_(read_idx(images_path, mapped_)), labels_(read_idx(labels_path)), options_(std::move(options)) {
  if (labels_.dim() != 1)
    throw DataError(labels_path, DataError::kNoOffset, "labels must be 1-D, the file holds " + shape_str(labels_.shape()));
  if (labels_.size(0) != images_.size(0))
    throw DataError(labels_path, DataError::kNoOffset,
                    "holds " + std::to_string(labels_.size(0)) + " labels but " + images_path + " holds " +
                        std::to_string(images_.size(0)) + " images");
  init();
}

IdxDataset::IdxDataset(Tensor images, Tensor labels, IdxDatasetOptions options)
    : images_(std::move(images)), labels_(std::move(labels)), options_(std::move(options)) {
  if (!labels_.defined() || labels_.dim() != 1) throw Error("IdxDataset: labels must be 1-D, got " + labels_.str());
  if (!images_.defined() || images_.dim() < 1 || images_.size(0) != labels_.size(0))
    throw Error("IdxDataset: " + images_.str() + " and " + labels_.str() + " differ in their first dimension");
  init();
}

namespace {
std::int64_t label_at(const Tensor& labels, std::size_t i) {
  const auto k = static_cast<std::int64_t>(i);
  switch (labels.dtype()) {
    case DType::UInt8: return labels.item<std::uint8_t>(k);
    case DType::Int8: return labels.item<std::int8_t>(k);
    case DType::Int16: return labels.item<std::int16_t>(k);
    case DType::Int32: return labels.item<std::int32_t>(k);
    default: return labels.item<std::int64_t>(k);
  }
}
}  // namespace

void IdxDataset::init() {
  switch (labels_.dtype()) {
    case DType::UInt8:
    case DType::Int8:
    case DType::Int16:
    case DType::Int32:
    case DType::Int64: break;
    default: throw Error("IdxDataset: labels must be integers, got " + labels_.str());
  }
  size_ = static_cast<std::size_t>(images_.size(0));
  Shape one(images_.shape().begin() + 1, images_.shape().end());
  sample_dtype_ = images_.dtype();
  if (!options_.transform.empty()) {
    if (one.size() != 2 && one.size() != 3)
      throw Error("IdxDataset: a transform needs images of [N, H, W] or [N, H, W, C], got " + images_.str());
    if (images_.dtype() != DType::UInt8 && images_.dtype() != DType::Float32)
      throw Error("IdxDataset: a transform needs uint8 or float32 images, got " + images_.str());
    one = options_.transform.output_shape(one[0], one[1], one.size() == 3 ? one[2] : 0);
    sample_dtype_ = options_.transform.output_dtype(images_.dtype());
  }
  sample_shape_ = std::move(one);
  labels64_ = Tensor::empty(DType::Int64, {static_cast<std::int64_t>(size_)});
  for (std::size_t i = 0; i < size_; ++i) labels64_.data<std::int64_t>()[i] = label_at(labels_, i);
}

std::vector<HostRows> IdxDataset::host_rows(std::string& why) const {
  const std::size_t row_bytes = size_ ? images_.nbytes() / size_ : 0;
  const Shape one(images_.shape().begin() + 1, images_.shape().end());
  HostRows images{images_.raw(),       images_.size(0), row_bytes,    images_.dtype(), one,
                  "IdxDataset images", mapped_,         std::nullopt, std::nullopt};
  if (!options_.transform.empty()) {
    // Flips, to_float and normalize run in the gather kernel (RowTransform); anything else on the CPU.
    std::string no;
    if (images_.dtype() == DType::UInt8)
      images.transform = options_.transform.row_transform(one[0], one[1], one.size() == 3 ? one[2] : 0, no);
    else
      no = "the images are " + std::string(dtype_name(images_.dtype())) + ", not uint8";
    if (!images.transform) {
      why = "IdxDataset's transform (" + options_.transform.str() + ") runs on the CPU: " + no;
      return {};
    }
  }
  return {std::move(images),
          {labels64_.raw(), labels64_.size(0), sizeof(std::int64_t), DType::Int64, Shape{}, "IdxDataset labels", false,
           std::nullopt, std::nullopt}};
}

LabeledSample IdxDataset::get(std::size_t i, SampleContext& ctx) const {
  if (i >= size_) throw Error("IdxDataset: index " + std::to_string(i) + " out of range for size " + std::to_string(size_));
  const Tensor img = images_.select(static_cast<std::int64_t>(i));
  if (options_.transform.empty()) return {img, label_at(labels_, i)};
  const Stage prev = ctx.enter(Stage::Transform);
  Tensor out = options_.transform(img, ctx.rng());
  ctx.enter(prev);
  return {std::move(out), label_at(labels_, i)};
}

LabeledBatch IdxDataset::make_batch(std::size_t rows, BatchAllocator& allocator) const {
  Shape s = sample_shape_;
  s.insert(s.begin(), static_cast<std::int64_t>(rows));
  return {empty(sample_dtype_, std::move(s), allocator), empty(DType::Int64, {static_cast<std::int64_t>(rows)}, allocator)};
}

void IdxDataset::get_into(std::size_t i, LabeledBatch& batch, std::size_t row, SampleContext& ctx) const {
  if (i >= size_) throw Error("IdxDataset: index " + std::to_string(i) + " out of range for size " + std::to_string(size_));
  const Tensor img = images_.select(static_cast<std::int64_t>(i));
  const Tensor slot = batch.image.select(static_cast<std::int64_t>(row));
  if (options_.transform.empty())
    std::memcpy(slot.raw(), img.raw(), img.nbytes());
  else {
    const Stage prev = ctx.enter(Stage::Transform);
    options_.transform.apply_into(img, slot, ctx.rng());
    ctx.enter(prev);
  }
  batch.label.data<std::int64_t>()[row] = label_at(labels_, i);
}

}  // namespace ferry
