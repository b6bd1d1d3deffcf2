// Tests that IDX files (raw and gzip) parse into the right tensors, that every kind of damage is a
// DataError naming the file and offset, and that IdxDataset keeps images and labels paired through
// the loader (including the real Fashion-MNIST files when Debian's package is installed).
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <map>

#include "ferry/detail/pass_math.h"
#include "ferry/ferry.h"
#include "files.h"
#include "pattern_images.h"

using namespace ferry;
using namespace ferry::test;

namespace {

Bytes u8_images(std::uint32_t n, std::uint32_t h, std::uint32_t w) {
  Bytes d(n * h * w);
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = std::byte(i / (h * w) * 5 + i % (h * w) % 5);  // pixel 0 of image i: 5i
  return d;
}
Bytes u8_labels(std::uint32_t n) {
  Bytes d(n);
  for (std::uint32_t i = 0; i < n; ++i) d[i] = std::byte(i * 7 % 10);
  return d;
}

// The DataError `f` throws; fails the test when it throws nothing or something else.
template <class F>
DataError data_error(F&& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e;
  }
  FAIL("expected a DataError");
  throw;
}

}  // namespace

TEST_CASE("IDX files parse raw and gzip, in host byte order", "[unit][idx]") {
  TempDir dir;
  const Bytes images = idx_bytes(0x08, {3, 2, 4}, u8_images(3, 2, 4));
  write_file(dir / "img", images);
  write_file(dir / "img.gz", gzip(images));
  for (const char* name : {"img", "img.gz"}) {
    Tensor t = read_idx(dir / name);
    CHECK(t.dtype() == DType::UInt8);
    CHECK(t.shape() == Shape{3, 2, 4});
    CHECK(t.item<std::uint8_t>(8) == 5);  // image 1, pixel 0
    CHECK(t.item<std::uint8_t>(9) == 6);
  }
  // Multi-byte types are big-endian on disk.
  Tensor i32 = parse_idx(idx_bytes(0x0C, {2},
                                   Bytes{std::byte{0}, std::byte{0}, std::byte{1}, std::byte{2}, std::byte{0xff}, std::byte{0xff},
                                         std::byte{0xff}, std::byte{0xfe}}),
                         "mem");
  CHECK(i32.item<std::int32_t>(0) == 258);
  CHECK(i32.item<std::int32_t>(1) == -2);
  Tensor f32 = parse_idx(idx_bytes(0x0D, {1}, Bytes{std::byte{0x3f}, std::byte{0xc0}, std::byte{0}, std::byte{0}}), "mem");
  CHECK(f32.item<float>(0) == 1.5f);
  Tensor i16 = parse_idx(gzip(idx_bytes(0x0B, {1}, Bytes{std::byte{0x80}, std::byte{0x01}})), "mem.gz");
  CHECK(i16.item<std::int16_t>(0) == -32767);
}

TEST_CASE("a mapped IDX tensor can be written without touching the file", "[unit][idx]") {
  TempDir dir;
  const Bytes images = idx_bytes(0x08, {2, 2, 2}, u8_images(2, 2, 2));
  write_file(dir / "img", images);
  {
    Tensor t = read_idx(dir / "img");
    t.data<std::uint8_t>()[0] = 99;  // copy-on-write page
    CHECK(t.item<std::uint8_t>(0) == 99);
  }
  CHECK(read_idx(dir / "img").item<std::uint8_t>(0) == 0);
}

TEST_CASE("damaged IDX files are DataErrors naming the file and the offset", "[errors][idx]") {
  TempDir dir;
  const Bytes good = idx_bytes(0x08, {2, 3}, Bytes(6));
  struct Case {
    std::string name;
    Bytes bytes;
    std::string message;
    std::uint64_t offset;
  };
  Bytes truncated = good;
  truncated.pop_back();
  Bytes trailing = good;
  trailing.push_back(std::byte{1});
  Bytes short_header(good.begin(), good.begin() + 6);
  Bytes cut_gz = gzip(good);
  cut_gz.resize(cut_gz.size() / 2);
  Bytes garbage_gz = gzip(idx_bytes(0x08, {64}, Bytes(64)));
  std::fill(garbage_gz.begin() + 10, garbage_gz.end(), std::byte{0xA5});
  std::vector<Case> cases{
      {"magic", bytes_of("PK\x03\x04 not idx"), "not an IDX file", 0},
      {"type", idx_bytes(0x0A, {1}, Bytes(1)), "unknown IDX element type code 0xa", 2},
      {"dims0", idx_bytes(0x08, {}, Bytes()), "0 dimensions", 3},
      {"header", short_header, "truncated IDX dimension field", 4},
      {"truncated", truncated, "(truncated)", 12},
      {"trailing", trailing, "(trailing bytes)", 12},
      // The third dimension's field (bytes 12-15) makes the element count overflow: named there.
      {"huge", idx_bytes(0x0E, {0x7fffffff, 0x7fffffff, 0x7fffffff}, Bytes()), "IDX element count overflows", 12},
      {"bomb.gz", gzip(idx_bytes(0x08, {100000, 100000}, Bytes(10))), "more than a", 12},
      {"cut.gz", cut_gz, "truncated", 0},
      {"garbage.gz", garbage_gz, "gzip", 0},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    write_file(dir / c.name, c.bytes);
    DataError e = data_error([&] { read_idx(dir / c.name); });
    CHECK_THAT(e.what(), Catch::Contains(dir / c.name) && Catch::Contains(c.message));
    if (c.name != "cut.gz" && c.name != "garbage.gz") CHECK(e.offset() == c.offset);
  }
  write_file(dir / "empty", Bytes());
  CHECK_THAT(data_error([&] { read_idx(dir / "empty"); }).what(), Catch::Contains("is empty"));
  CHECK_THAT(data_error([&] { read_idx(dir / "missing"); }).what(), Catch::Contains("cannot open") && Catch::Contains("missing"));
  CHECK_THAT(data_error([&] { read_idx(dir.path().string()); }).what(), Catch::Contains("is a directory"));
}

TEST_CASE("IdxDataset refuses labels that do not match the images", "[errors][idx]") {
  TempDir dir;
  write_file(dir / "img", idx_bytes(0x08, {3, 2, 2}, u8_images(3, 2, 2)));
  write_file(dir / "lbl", idx_bytes(0x08, {4}, u8_labels(4)));
  write_file(dir / "lbl2d", idx_bytes(0x08, {3, 1}, u8_labels(3)));
  CHECK_THAT(data_error([&] { IdxDataset(dir / "img", dir / "lbl"); }).what(),
             Catch::Contains("holds 4 labels but") && Catch::Contains("holds 3 images"));
  CHECK_THAT(data_error([&] { IdxDataset(dir / "img", dir / "lbl2d"); }).what(), Catch::Contains("labels must be 1-D"));
}

TEST_CASE("IdxDataset keeps images and labels paired through the loader", "[loader][idx]") {
  TempDir dir;
  const std::uint32_t n = 50;
  write_file(dir / "img.gz", gzip(idx_bytes(0x08, {n, 4, 4}, u8_images(n, 4, 4))));
  write_file(dir / "lbl", idx_bytes(0x08, {n}, u8_labels(n)));
  for (bool transform : {false, true}) {
    IdxDatasetOptions o;
    if (transform) o.transform.to_float();
    IdxDataset ds(dir / "img.gz", dir / "lbl", o);
    CHECK(ds.sample_shape() == (transform ? Shape{1, 4, 4} : Shape{4, 4}));
    for (int workers : {0, 2}) {
      DataLoaderOptions lo;
      lo.batch_size = 8;
      lo.shuffle = true;
      lo.num_workers = workers;
      DataLoader loader(ds, lo);
      std::size_t seen = 0;
      for (LabeledBatch& b : loader) {
        for (std::int64_t r = 0; r < b.label.size(0); ++r) {
          // Pixel 0 of image i is 5i; its label is 7i mod 10.
          const double px = transform ? b.image.data<float>()[r * 16] * 255.0 : b.image.data<std::uint8_t>()[r * 16];
          const auto i = static_cast<std::int64_t>(std::lround(px)) / 5;
          CHECK(b.label.data<std::int64_t>()[r] == i * 7 % 10);
          ++seen;
        }
      }
      CHECK(seen == n);
    }
  }
}

TEST_CASE("the real Fashion-MNIST files read as 60,000 + 10,000 labelled 28x28 images", "[idx][data]") {
  const std::string root = "/usr/share/datasets/fashion-mnist/";
  if (!std::filesystem::exists(root + "train-images-idx3-ubyte.gz")) {
    WARN("Debian's dataset-fashion-mnist is not installed; skipped");
    return;
  }
  IdxDataset train(root + "train-images-idx3-ubyte.gz", root + "train-labels-idx1-ubyte.gz");
  IdxDataset test(root + "t10k-images-idx3-ubyte.gz", root + "t10k-labels-idx1-ubyte.gz");
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.sample_shape() == Shape{28, 28});
  std::map<std::int64_t, int> per_class;
  for (std::int64_t i = 0; i < 60000; ++i) ++per_class[train.labels().item<std::uint8_t>(i)];
  CHECK(per_class.size() == 10);
  for (auto& [label, count] : per_class) CHECK(count == 6000);
  WorkerInfo w;
  SampleContext ctx(0, 0, 0, w);
  LabeledSample first = train.get(0, ctx);
  CHECK(first.label == 9);  // an ankle boot
  std::int64_t sum = 0;
  for (int k = 0; k < 784; ++k) sum += first.image.item<std::uint8_t>(k);
  CHECK(sum == 76247);  // checked with Python's gzip module
  CHECK(test.get(1, ctx).label == 2);
}

TEST_CASE("IdxDataset offers its images and labels as rows for the device gather", "[unit][idx][gather]") {
  TempDir dir;
  const std::uint32_t n = 12;
  write_file(dir / "img", idx_bytes(0x08, {n, 3, 5}, u8_images(n, 3, 5)));
  write_file(dir / "img.gz", gzip(idx_bytes(0x08, {n, 3, 5}, u8_images(n, 3, 5))));
  write_file(dir / "lbl", idx_bytes(0x08, {n}, u8_labels(n)));
  DataLoaderOptions o;
  o.device = 0;
  for (bool raw : {true, false}) {
    INFO((raw ? "raw" : "gzip") << " images");
    IdxDataset ds(dir / (raw ? "img" : "img.gz"), dir / "lbl");
    std::vector<HostRows> rows;
    const std::string why = detail::gather_unavailable<IdxDataset, LabeledBatch>(o, true, ds, rows);
    if (raw) {
      // A file's mapping, which gather = Auto leaves to the host path; gather = Device takes it.
      CHECK_THAT(why, Catch::Contains("IdxDataset images is a memory-mapped file"));
      DataLoaderOptions d = o;
      d.gather = Gather::Device;
      rows.clear();
      const std::string device_why = detail::gather_unavailable<IdxDataset, LabeledBatch>(d, true, ds, rows);
      if (DeviceStage::can_gather()) CHECK(device_why.empty());
    } else if (DeviceStage::can_gather()) {
      CHECK(why.empty());
    }
    std::string unused;
    rows = ds.host_rows(unused);
    REQUIRE(rows.size() == 2);
    CHECK(rows[0].mapped_file == raw);
    CHECK(rows[0].rows == n);
    CHECK(rows[0].row_bytes == 15);
    CHECK(rows[0].row_shape == Shape{3, 5});
    CHECK(rows[0].dtype == DType::UInt8);
    CHECK(rows[0].data == ds.images().raw());
    CHECK(rows[1].dtype == DType::Int64);
    CHECK(rows[1].row_bytes == 8);
    // The label rows hold what the host path's batches hold.
    SampleContext ctx(0, 1, 0, WorkerInfo{});
    for (std::uint32_t i = 0; i < n; ++i) CHECK(static_cast<const std::int64_t*>(rows[1].data)[i] == ds.get(i, ctx).label);
  }
  // A transform that crops runs on the CPU: no rows, and the loader says why.
  IdxDatasetOptions crop;
  crop.transform.center_crop(2, 2).horizontal_flip();
  IdxDataset cropped(dir / "img.gz", dir / "lbl", crop);
  std::vector<HostRows> rows;
  CHECK_THAT(
      (detail::gather_unavailable<IdxDataset, LabeledBatch>(o, true, cropped, rows)),
      Catch::Contains("IdxDataset's transform") && Catch::Contains("runs on the CPU") && Catch::Contains("crops or resizes"));
  CHECK(rows.empty());
  // Flips, to_float and normalize go to the gather kernel as the image field's RowTransform.
  IdxDatasetOptions demo;
  demo.transform.horizontal_flip(0.25).to_float(DType::BFloat16).normalize({0.5f}, {0.25f});
  IdxDataset flipped(dir / "img.gz", dir / "lbl", demo);
  rows.clear();
  const std::string why = detail::gather_unavailable<IdxDataset, LabeledBatch>(o, true, flipped, rows);
  if (DeviceStage::can_gather()) CHECK(why.empty());
  std::string unused;
  rows = flipped.host_rows(unused);
  REQUIRE(rows.size() == 2);
  REQUIRE(rows[0].transform);
  const RowTransform& t = *rows[0].transform;
  CHECK(t.height == 3);
  CHECK(t.width == 5);
  CHECK(t.channels == 1);
  CHECK(t.flip_p == 0.25);
  CHECK(t.dtype == DType::BFloat16);
  CHECK(t.shape == Shape{1, 3, 5});
  CHECK(t.shape == flipped.sample_shape());
  CHECK(t.a[0] == 1.f / 255.f / 0.25f);
  CHECK(t.b[0] == (0.f - 0.5f) / 0.25f);
  CHECK(rows[0].row_shape == Shape{3, 5});
  CHECK_FALSE(rows[1].transform);
  // Two flips in one transform draw twice: the CPU's.
  IdxDatasetOptions twice;
  twice.transform.horizontal_flip().horizontal_flip();
  CHECK(IdxDataset(dir / "img.gz", dir / "lbl", twice).host_rows(unused).empty());
  CHECK_THAT(unused, Catch::Contains("flips more than once"));
}

namespace {
// What the gather kernel writes for a batch (the same per-element functions, run on the host):
// row k of `index` (with its flip bit) through `rows`' transform.
Tensor gather_on_host(const HostRows& rows, const Tensor& index) {
  const RowTransform& t = *rows.transform;
  Shape shape{index.size(0)};
  shape.insert(shape.end(), t.shape.begin(), t.shape.end());
  Tensor out = Tensor::empty(t.dtype, shape);
  const int kind = detail::pass_output_of(t.dtype);
  const bool chw = t.dtype != DType::UInt8 && !t.channels_last;
  bool stepped = true;
  for (std::int64_t k = 0; k < index.size(0); ++k) {
    const std::int64_t word = index.data<std::int64_t>()[k];
    const bool flip = (word & detail::kRowFlipBit) != 0;
    const auto* src =
        static_cast<const std::uint8_t*>(rows.data) + (word & ~detail::kRowFlipBit) * static_cast<std::int64_t>(rows.row_bytes);
    std::byte* dst = static_cast<std::byte*>(out.raw()) + k * static_cast<std::int64_t>(rows.row_bytes * itemsize(t.dtype));
    detail::RowCursor at(0, static_cast<int>(t.height), static_cast<int>(t.width), static_cast<int>(t.channels), flip, chw);
    for (std::size_t p = 0; p < rows.row_bytes; ++p, at.next()) {
      stepped = stepped && at.o == at.out();  // the stepped element is the one worked out afresh
      detail::pass_store(dst, at.o, kind, static_cast<float>(src[p]), t.a[at.c], t.b[at.c]);
    }
  }
  CHECK(stepped);
  return out;
}
}  // namespace

TEST_CASE("device gather: the row transform's flips and values equal the CPU transform's", "[idx][gather]") {
  // The kernel's arithmetic and the flips the index carries, checked without a GPU: every output
  // type and layout, gray and RGB, against IdxDataset's CPU path (ImageTransform) bit for bit.
  const std::int64_t n = 64;
  auto images = [&](std::int64_t h, std::int64_t w, std::int64_t c) { return test::pattern_images(n, h, w, c); };
  Tensor labels = Tensor::zeros(DType::Int64, {n});
  const std::vector<std::pair<Tensor, ImageTransform>> cases{
      {images(28, 28, 0), ImageTransform().horizontal_flip().to_float().normalize({0.286f}, {0.353f})},
      {images(28, 28, 0), ImageTransform().horizontal_flip(0.3)},
      {images(5, 7, 3),
       ImageTransform().horizontal_flip().to_float(DType::BFloat16).normalize({0.4f, 0.5f, 0.6f}, {0.2f, 0.25f, 0.3f})},
      {images(5, 7, 3), ImageTransform().to_float(DType::Float16).channels_last().horizontal_flip()},
      {images(3, 4, 4), ImageTransform().to_float().normalize({-300.f}, {0.001f}).horizontal_flip(1.0)},
  };
  std::vector<std::size_t> idx(n);
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = (i * 29 + 5) % static_cast<std::size_t>(n);
  for (std::size_t c = 0; c < cases.size(); ++c) {
    INFO("case " << c << ": " << cases[c].second.str());
    const IdxDataset ds(cases[c].first, labels, {cases[c].second});
    std::string why;
    const std::vector<HostRows> rows = ds.host_rows(why);
    REQUIRE(rows.size() == 2);
    REQUIRE(rows[0].transform);
    CHECK(detail::row_transform_problem(rows[0]).empty());
    for (std::uint64_t epoch : {0u, 3u}) {
      const std::uint64_t seed = 77;
      const Tensor index = detail::gather_index(idx, ds.size(), pageable_allocator(), {rows[0].transform->flip_p, seed, epoch});
      std::size_t flips = 0;
      for (std::int64_t k = 0; k < index.size(0); ++k) flips += (index.data<std::int64_t>()[k] & detail::kRowFlipBit) != 0;
      if (rows[0].transform->flip_p == 1.0)
        CHECK(flips == idx.size());
      else if (rows[0].transform->flip_p > 0)
        CHECK((flips > 0 && flips < idx.size()));
      const Tensor got = gather_on_host(rows[0], index);
      LabeledBatch want = ds.make_batch(idx.size(), pageable_allocator());
      WorkerInfo worker;
      for (std::size_t row = 0; row < idx.size(); ++row) {
        SampleContext ctx(idx[row], seed, epoch, worker);
        ds.get_into(idx[row], want, row, ctx);
      }
      REQUIRE(got.shape() == want.image.shape());
      REQUIRE(got.dtype() == want.image.dtype());
      CHECK(std::memcmp(got.raw(), want.image.raw(), got.nbytes()) == 0);
    }
  }
}

TEST_CASE("device gather: row transforms the kernel cannot run are named", "[idx][gather]") {
  HostRows r{nullptr, 10, 12, DType::UInt8, {3, 4}, "images", false, RowTransform{}, std::nullopt};
  r.transform->height = 3;
  r.transform->width = 4;
  r.transform->shape = {3, 4};
  CHECK(detail::row_transform_problem(r).empty());
  HostRows bad = r;
  bad.row_bytes = 13;
  CHECK_THAT(detail::row_transform_problem(bad),
             Catch::Contains("images's row transform") && Catch::Contains("12 bytes in rows of 13"));
  bad = r;
  bad.dtype = DType::Float32;
  bad.row_bytes = 48;
  CHECK_THAT(detail::row_transform_problem(bad), Catch::Contains("not uint8 images"));
  bad = r;
  bad.transform->channels = 5;
  CHECK_THAT(detail::row_transform_problem(bad), Catch::Contains("1 to 4 channels"));
  bad = r;
  bad.transform->dtype = DType::Int32;
  CHECK_THAT(detail::row_transform_problem(bad), Catch::Contains("writes int32"));
  bad = r;
  bad.transform->shape = {3, 5};
  CHECK_THAT(detail::row_transform_problem(bad), Catch::Contains("shape does not hold"));
  bad = r;
  bad.transform->flip_p = 1.5;
  CHECK_THAT(detail::row_transform_problem(bad), Catch::Contains("flip probability"));
}
