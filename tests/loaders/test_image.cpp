// Tests that JPEG and PNG decode to the right pixels and channel counts, that damaged images are
// DataErrors naming the file, and that ImageFolder orders classes and files deterministically and
// keeps images paired with their labels through the loader, bad files included.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <set>

#include "ferry/ferry.h"
#include "files.h"
#include "helpers.h"

using namespace ferry;
using namespace ferry::test;

namespace {
int max_diff(const Tensor& t, const std::vector<std::uint8_t>& ref) {
  REQUIRE(static_cast<std::size_t>(t.numel()) == ref.size());
  int d = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) d = std::max(d, std::abs(t.data<std::uint8_t>()[i] - ref[i]));
  return d;
}
// A flat image of one colour per class, so a label can be read back from the pixels.
Bytes class_image(int label, int w, int h, bool png) {
  std::vector<std::uint8_t> p(static_cast<std::size_t>(w * h * 3), static_cast<std::uint8_t>(40 * label + 20));
  return png ? encode_png(p, w, h, 3) : encode_jpeg(p, w, h, 3);
}
}  // namespace

TEST_CASE("PNG decodes exactly and JPEG closely, in every channel layout", "[unit][image]") {
  for (int c : {1, 3, 4}) {
    INFO("channels " << c);
    const auto pixels = gradient(13, 7, c);
    Tensor png = decode_image(encode_png(pixels, 13, 7, c), "mem.png");
    CHECK(png.shape() == Shape{7, 13, c});
    CHECK(max_diff(png, pixels) == 0);
    if (c == 4) continue;
    Tensor jpg = decode_image(encode_jpeg(pixels, 13, 7, c), "mem.jpg");
    CHECK(jpg.shape() == Shape{7, 13, c});
    CHECK(max_diff(jpg, pixels) <= 12);  // lossy at quality 95
  }
  // Channel conversions: gray to RGB repeats the value; RGBA to RGB drops alpha; RGB JPEG to RGBA
  // adds an opaque alpha.
  Tensor rgb = decode_image(encode_png(std::vector<std::uint8_t>(6, 77), 3, 2, 1), "g.png", {.channels = 3});
  CHECK(rgb.shape() == Shape{2, 3, 3});
  CHECK(rgb.data<std::uint8_t>()[4] == 77);
  std::vector<std::uint8_t> rgba{10, 20, 30, 0, 40, 50, 60, 128};
  Tensor dropped = decode_image(encode_png(rgba, 2, 1, 4), "a.png", {.channels = 3});
  CHECK(max_diff(dropped, {10, 20, 30, 40, 50, 60}) == 0);
  Tensor opaque = decode_image(encode_jpeg(gradient(8, 8, 3), 8, 8, 3), "x.jpg", {.channels = 4});
  CHECK(opaque.data<std::uint8_t>()[3] == 255);
  CHECK(sniff_image(bytes_of("GIF89a")) == ImageFormat::Unknown);
}

TEST_CASE("damaged images are DataErrors naming the image", "[errors][image]") {
  const Bytes jpg = encode_jpeg(gradient(64, 48, 3), 64, 48, 3);
  const Bytes png = encode_png(gradient(64, 48, 3), 64, 48, 3);
  Bytes jpg_cut(jpg.begin(), jpg.begin() + static_cast<std::ptrdiff_t>(jpg.size() / 2));
  Bytes png_cut(png.begin(), png.begin() + static_cast<std::ptrdiff_t>(png.size() / 2));
  Bytes jpg_header_only(jpg.begin(), jpg.begin() + 20);
  Bytes png_bad_crc = png;
  png_bad_crc[png.size() / 2] ^= std::byte{0xff};
  Bytes jpg_garbage = jpg;
  for (std::size_t i = jpg.size() / 3; i < jpg.size() / 3 + 64; ++i) jpg_garbage[i] = std::byte{0xff};
  struct Case {
    const char* name;
    Bytes bytes;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{{"cut.jpg", jpg_cut, "corrupt JPEG"},
                                         {"header.jpg", jpg_header_only, "corrupt JPEG"},
                                         {"garbage.jpg", jpg_garbage, "corrupt JPEG"},
                                         {"cut.png", png_cut, "corrupt PNG"},
                                         {"crc.png", png_bad_crc, "corrupt PNG"},
                                         {"text.jpg", bytes_of("hello, world"), "not a JPEG or PNG"},
                                         {"empty.png", Bytes(), "is empty"}}) {
    INFO(c.name);
    CHECK_THROWS_MATCHES(decode_image(c.bytes, c.name), DataError, Catch::Matchers::Predicate<DataError>([&](const DataError& e) {
      return e.file() == c.name && std::string(e.what()).find(c.message) != std::string::npos;
    }, c.message));
  }
  // The thread's decoder still works after all those errors.
  CHECK(decode_image(jpg, "good.jpg").shape() == Shape{48, 64, 3});
  CHECK_THROWS_WITH(decode_image(jpg, "big.jpg", {.channels = 3, .max_pixels = 100}), Catch::Contains("more than the limit of 100 pixels"));
  CHECK_THROWS_WITH(decode_image(jpg, "x.jpg", {.channels = 2}), Catch::Contains("channels must be 0, 1, 3 or 4"));
}

TEST_CASE("ImageFolder sorts classes and files and reads nested folders", "[unit][image]") {
  TempDir dir;
  write_file(dir / "root/dog/b.jpg", class_image(1, 8, 8, false));
  write_file(dir / "root/dog/a.PNG", class_image(1, 8, 8, true));
  write_file(dir / "root/dog/notes.txt", bytes_of("not an image"));
  write_file(dir / "root/cat/nested/z.jpeg", class_image(0, 8, 8, false));
  write_file(dir / "root/cat/y.png", class_image(0, 8, 8, true));
  write_file(dir / "root/README", bytes_of("ignored: not a folder"));
  ImageFolder ds(dir / "root");
  CHECK(ds.classes() == std::vector<std::string>{"cat", "dog"});
  REQUIRE(ds.size() == 4);
  CHECK(ds.path(0) == dir / "root/cat/y.png");  // os.walk order: the folder's own files first
  CHECK(ds.path(1) == dir / "root/cat/nested/z.jpeg");
  CHECK(ds.path(2) == dir / "root/dog/a.PNG");
  CHECK(ds.label(3) == 1);
}

TEST_CASE("ImageFolder errors name the folder", "[errors][image]") {
  TempDir dir;
  CHECK_THROWS_AS(ImageFolder(dir / "nope"), DataError);
  CHECK_THROWS_WITH(ImageFolder(dir / "nope"), Catch::Contains("does not exist"));
  write_file(dir / "file", bytes_of("x"));
  CHECK_THROWS_WITH(ImageFolder(dir / "file"), Catch::Contains("is not a directory"));
  std::filesystem::create_directories(dir / "flat");
  CHECK_THROWS_WITH(ImageFolder(dir / "flat"), Catch::Contains("holds no class folders"));
  write_file(dir / "one/a/x.jpg", class_image(0, 4, 4, false));
  std::filesystem::create_directories(dir / "one/b");
  CHECK_THROWS_WITH(ImageFolder(dir / "one"), Catch::Contains("class folder 'b' holds no image files") && Catch::Contains(dir / "one/b"));
  CHECK_THROWS_WITH(ImageFolder(dir / "one", ImageFolderOptions{.channels = 2, .transform = {}}), Catch::Contains("channels must be 1, 3 or 4"));
  if (::geteuid() != 0) {  // root reads any folder
    write_file(dir / "locked/a/x.jpg", class_image(0, 4, 4, false));
    ::chmod((dir / "locked/a").c_str(), 0);
    CHECK_THROWS_WITH(ImageFolder(dir / "locked"), Catch::Contains("cannot list the class folder"));
    ::chmod((dir / "locked/a").c_str(), 0755);
  }
}

TEST_CASE("ImageFolder batches keep images with their labels; a bad file is a DataError and the loader goes on",
          "[loader][image]") {
  TempDir dir;
  const int per_class = 12;
  for (int label = 0; label < 3; ++label)
    for (int k = 0; k < per_class; ++k)
      write_file(dir / ("root/c" + std::to_string(label) + "/" + std::to_string(k) + (k % 2 ? ".png" : ".jpg")),
                 class_image(label, 20 + k, 16 + label, k % 2 == 1));
  write_file(dir / "root/c1/99-bad.jpg", bytes_of("\xff\xd8\xff this is not really a JPEG"));
  ImageFolderOptions o;
  o.transform.random_resized_crop(8, 8).horizontal_flip().to_float();
  ImageFolder ds(dir / "root", o);
  REQUIRE(ds.size() == 3 * per_class + 1);
  for (int workers : {0, 2}) {
    DataLoaderOptions lo;
    lo.batch_size = 5;
    lo.num_workers = workers;
    lo.shuffle = true;
    DataLoader loader(ds, lo);
    std::size_t good = 0;
    auto errors = iterate_skipping_errors<DataError>(loader, [&](LabeledBatch& b) {
      REQUIRE(b.image.shape() == Shape{b.label.size(0), 3, 8, 8});
      for (std::int64_t r = 0; r < b.label.size(0); ++r) {
        // The flat colour survives crop and resize (within JPEG's error) and names the class.
        const float v = b.image.data<float>()[r * 192 + 100] * 255.f;
        CHECK(std::lround((v - 20.f) / 40.f) == b.label.data<std::int64_t>()[r]);
        ++good;
      }
    }, [&](const DataError& e) {
      CHECK(e.file() == dir / "root/c1/99-bad.jpg");
      return std::string();
    });
    const std::size_t bad = errors.size();
    if (bad == 1) CHECK_THAT(errors[0], Catch::Contains("corrupt JPEG") && Catch::Contains("batch"));
    CHECK(bad == 1);
    CHECK(good + 5 >= ds.size() - 1);  // everything but the failed batch arrived
    CHECK(good <= ds.size() - 1);
  }
  // Without a fixed-size transform the loader cannot batch: a clear error, not a crash.
  ImageFolder raw(dir / "root");
  CHECK_THROWS_WITH(*DataLoader(raw, DataLoaderOptions{}).begin(), Catch::Contains("ends in a fixed size"));
}
