// Tests that IDX files (raw and gzip) parse into the right tensors, that every kind of damage is a
// DataError naming the file and offset, and that IdxDataset keeps images and labels paired through
// the loader (including the real Fashion-MNIST files when Debian's package is installed).
#include <catch2/catch.hpp>

#include <filesystem>
#include <map>

#include "ferry/ferry.h"
#include "files.h"

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
  Tensor i32 = parse_idx(idx_bytes(0x0C, {2}, Bytes{std::byte{0}, std::byte{0}, std::byte{1}, std::byte{2},
                                                     std::byte{0xff}, std::byte{0xff}, std::byte{0xff}, std::byte{0xfe}}), "mem");
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
      {"huge", idx_bytes(0x0E, {0x7fffffff, 0x7fffffff, 0x7fffffff}, Bytes()), "overflows", DataError::kNoOffset},
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
  // A transform runs on the CPU: no rows, and the loader says why.
  IdxDatasetOptions flip;
  flip.transform.horizontal_flip();
  IdxDataset flipped(dir / "img.gz", dir / "lbl", flip);
  std::vector<HostRows> rows;
  CHECK_THAT((detail::gather_unavailable<IdxDataset, LabeledBatch>(o, true, flipped, rows)),
             Catch::Contains("IdxDataset's transform") && Catch::Contains("runs on the CPU"));
  CHECK(rows.empty());
}
