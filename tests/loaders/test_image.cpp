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
    CHECK_THROWS_MATCHES(
        decode_image(c.bytes, c.name), DataError,
        Catch::Matchers::Predicate<DataError>(
            [&](const DataError& e) { return e.file() == c.name && std::string(e.what()).find(c.message) != std::string::npos; },
            c.message));
  }
  // A damaged PNG header names the byte where it is wrong.
  struct HeaderCase {
    std::size_t at;
    std::vector<std::uint8_t> bytes;
    std::uint64_t offset;
    const char* message;
  };
  for (const HeaderCase& h : std::vector<HeaderCase>{{11, {14}, 8, "length is 14, not 13"},
                                                     {12, {'X'}, 12, "first chunk is not IHDR"},
                                                     {16, {0, 0, 0, 0}, 16, "its width is 0"},
                                                     {20, {0x80, 0, 0, 0}, 20, "its height is 2147483648"},
                                                     {25, {5}, 25, "color type 5"},
                                                     {24, {3}, 24, "bit depth 3 is not allowed with color type 2"},
                                                     {28, {2}, 26, "interlace method"},
                                                     {30, {}, 29, "CRC does not match"}}) {
    Bytes bad = png;
    for (std::size_t k = 0; k < h.bytes.size(); ++k) bad[h.at + k] = std::byte{h.bytes[k]};
    if (h.at == 30) bad[30] ^= std::byte{0xff};
    INFO("PNG header byte " << h.at);
    try {
      decode_image(bad, "bad.png");
      FAIL("no error");
    } catch (const DataError& e) {
      CHECK(e.offset() == h.offset);
      CHECK_THAT(e.what(), Catch::Contains(h.message) && Catch::Contains("bad.png"));
    }
  }
  CHECK_THROWS_WITH(decode_image(Bytes(png.begin(), png.begin() + 20), "short.png"),
                    Catch::Contains("its header needs 33 bytes, the file has 20"));
  // The thread's decoder still works after all those errors.
  CHECK(decode_image(jpg, "good.jpg").shape() == Shape{48, 64, 3});
  CHECK_THROWS_WITH(decode_image(jpg, "big.jpg", {.channels = 3, .max_pixels = 100}),
                    Catch::Contains("more than the limit of 100 pixels"));
  CHECK_THROWS_WITH(decode_image(jpg, "x.jpg", {.channels = 2}), Catch::Contains("channels must be 0, 1, 3 or 4"));
}

namespace {
// transform(decode_image(bytes)) and decode_transformed_into(bytes) from generators of one seed;
// returns the largest difference (0 = bit for bit) and checks both used the generator alike; the
// mean difference goes to *mean.
double region_vs_full(const Bytes& jpg, const ImageTransform& t, std::uint64_t seed, int channels, bool scaled = false,
                      double* mean = nullptr) {
  Generator g_full(seed, 3, 7), g_region(seed, 3, 7);
  const Tensor full = t(decode_image(jpg, "x.jpg", {.channels = channels}), g_full);
  Tensor region = Tensor::empty(full.dtype(), full.shape());
  decode_transformed_into(jpg, "x.jpg", t, g_region, region, {.channels = channels, .dct_scaling = scaled});
  CHECK(g_full() == g_region());  // the same draws, so the next sample's are the same too
  double worst = 0, sum = 0;
  for (std::int64_t i = 0; i < full.numel(); ++i) {
    const double a = full.dtype() == DType::Float32 ? full.data<float>()[i] : full.data<std::uint8_t>()[i];
    const double b = full.dtype() == DType::Float32 ? region.data<float>()[i] : region.data<std::uint8_t>()[i];
    worst = std::max(worst, std::abs(a - b));
    sum += std::abs(a - b);
  }
  if (mean) *mean = sum / static_cast<double>(full.numel());
  return worst;
}
}  // namespace

TEST_CASE("decoding only the crop gives the full decode's values bit for bit", "[unit][image][region]") {
  const std::vector<std::pair<const char*, ImageTransform>> transforms = {
      {"random_resized_crop + flip + normalize",
       ImageTransform().random_resized_crop(56, 48).horizontal_flip().to_float().normalize({0.45f}, {0.226f})},
      {"crops smaller than one 8x8 block", ImageTransform().random_resized_crop(6, 5, {0.0005, 0.002}).horizontal_flip()},
      {"resize_shorter + center_crop", ImageTransform().resize_shorter(40).center_crop(32, 32)},
      {"center_crop larger than the image (padding)", ImageTransform().center_crop(64, 300)},
      {"plain resize", ImageTransform().resize(31, 17)},
      {"crop at the borders", ImageTransform().random_resized_crop(24, 24, {0.9, 1.0}, {0.2, 5.0})},
  };
  struct Layout {
    const char* name;
    int channels, ss, flags;
  };
  const std::vector<Layout> layouts = {{"4:2:0", 3, TJSAMP_420, 0},
                                       {"4:4:4", 3, TJSAMP_444, 0},
                                       {"4:2:2", 3, TJSAMP_422, 0},
                                       {"4:4:0", 3, TJSAMP_440, 0},
                                       {"4:1:1", 3, TJSAMP_411, 0},
                                       {"grayscale", 1, TJSAMP_GRAY, 0},
                                       {"4:2:0 progressive", 3, TJSAMP_420, TJFLAG_PROGRESSIVE}};
  const std::vector<std::pair<int, int>> sizes = {{250, 187}, {37, 29}, {7, 5}, {301, 16}, {16, 97}};
  for (const Layout& l : layouts)
    for (auto [w, h] : sizes) {
      const Bytes jpg =
          encode_jpeg(textured(w, h, l.channels, static_cast<std::uint32_t>(w * h)), w, h, l.channels, 90, l.ss, l.flags);
      for (const auto& [what, t] : transforms)
        for (std::uint64_t seed = 0; seed < 6; ++seed) {
          INFO(l.name << ", " << w << "x" << h << ", " << what << ", seed " << seed);
          CHECK(region_vs_full(jpg, t, seed, l.channels) == 0);
        }
    }
  // A gray file decoded to RGB, and an RGB file to gray, take the region path too.
  const Bytes gray = encode_jpeg(textured(90, 70, 1), 90, 70, 1);
  const Bytes rgb = encode_jpeg(textured(90, 70, 3), 90, 70, 3, 90, TJSAMP_420);
  for (std::uint64_t seed = 0; seed < 6; ++seed) {
    CHECK(region_vs_full(gray, transforms[0].second, seed, 3) == 0);
    CHECK(region_vs_full(rgb, transforms[1].second, seed, 1) == 0);
  }
}

TEST_CASE("decode_transformed_into: other formats and channel counts fall back to a full decode; errors name the file",
          "[unit][image][region][errors]") {
  const ImageTransform t = ImageTransform().random_resized_crop(16, 16).horizontal_flip();
  // PNG, and RGBA output (not a region-decode layout), give transform(decode_image(...)).
  const Bytes png = encode_png(textured(40, 30, 3), 40, 30, 3);
  const Bytes jpg = encode_jpeg(textured(40, 30, 3), 40, 30, 3, 90, TJSAMP_420);
  for (std::uint64_t seed = 0; seed < 4; ++seed) {
    for (const Bytes* b : {&png, &jpg}) {
      Generator g1(seed), g2(seed);
      const Tensor ref = t(decode_image(*b, "x", {.channels = 4}), g1);
      Tensor out = Tensor::empty(DType::UInt8, {16, 16, 4});
      decode_transformed_into(*b, "x", t, g2, out, {.channels = 4});
      CHECK(std::memcmp(ref.raw(), out.raw(), static_cast<std::size_t>(ref.nbytes())) == 0);
    }
  }
  // Damage in the rows the crop reads is a DataError naming the file; the decoder goes on working.
  const Bytes big = encode_jpeg(textured(200, 150, 3), 200, 150, 3, 90, TJSAMP_420);
  Bytes cut(big.begin(), big.begin() + static_cast<std::ptrdiff_t>(big.size() / 2));
  Tensor whole = Tensor::empty(DType::UInt8, {150, 200, 3});
  Generator g(0);
  CHECK_THROWS_MATCHES(decode_transformed_into(cut, "cut.jpg", ImageTransform().resize(150, 200), g, whole, {.channels = 3}),
                       DataError,
                       Catch::Matchers::Predicate<DataError>(
                           [](const DataError& e) {
                             return e.file() == "cut.jpg" && std::string(e.what()).find("corrupt JPEG data") != std::string::npos;
                           },
                           "a corrupt JPEG data error naming cut.jpg"));
  Bytes header(jpg.begin(), jpg.begin() + 20);
  CHECK_THROWS_WITH(decode_transformed_into(header, "h.jpg", t, g, Tensor::empty(DType::UInt8, {16, 16, 3}), {.channels = 3}),
                    Catch::Contains("h.jpg") && Catch::Contains("corrupt JPEG header"));
  CHECK_THROWS_WITH(
      decode_transformed_into(jpg, "big.jpg", t, g, Tensor::empty(DType::UInt8, {16, 16, 3}), {.channels = 3, .max_pixels = 100}),
      Catch::Contains("more than the limit of 100 pixels"));
  CHECK_THROWS_WITH(decode_transformed_into(jpg, "x.jpg", t, g, Tensor::empty(DType::UInt8, {8, 8, 3}), {.channels = 3}),
                    Catch::Contains("does not match"));
  CHECK(region_vs_full(jpg, t, 1, 3) == 0);
}

TEST_CASE("DCT-scaled decode stays close to the full decode", "[unit][image][region]") {
  // A crop at least twice the output on both axes is decoded at 1/2, 1/4 or 1/8 scale.
  // A smooth image (a photograph's sky or skin) whose values change by up to 1.1 levels a pixel: the
  // scaled decode is within a few levels. (The crop box moves to the scaled grid, by up to half a
  // scaled pixel: 2 source pixels at 1/4 scale, which is most of the difference here.)
  std::vector<std::uint8_t> smooth(800 * 600 * 3);
  for (int y = 0; y < 600; ++y)
    for (int x = 0; x < 800; ++x)
      for (int c = 0; c < 3; ++c)
        smooth[(static_cast<std::size_t>(y) * 800 + x) * 3 + c] =
            static_cast<std::uint8_t>(128 + 100 * std::sin(x / 90.0 + c) * std::cos(y / 70.0));
  const Bytes jpg = encode_jpeg(smooth, 800, 600, 3, 90, TJSAMP_420);
  const ImageTransform t = ImageTransform().random_resized_crop(64, 64, {0.5, 1.0}).horizontal_flip().to_float();
  double worst = 0, mean = 0;
  for (std::uint64_t seed = 0; seed < 8; ++seed) {
    worst = std::max(worst, region_vs_full(jpg, t, seed, 3, true, &mean));
    CHECK(mean * 255 <= 6.0);
  }
  INFO("largest difference " << worst * 255 << " levels");
  CHECK(worst > 0);            // it did decode at a smaller scale
  CHECK(worst * 255 <= 16.0);  // and stayed close
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
  CHECK_THROWS_WITH(ImageFolder(dir / "one"),
                    Catch::Contains("class folder 'b' holds no image files") && Catch::Contains(dir / "one/b"));
  CHECK_THROWS_WITH(ImageFolder(dir / "one", ImageFolderOptions{.channels = 2, .transform = {}}),
                    Catch::Contains("channels must be 1, 3 or 4"));
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
    auto errors = iterate_skipping_errors<DataError>(
        loader,
        [&](LabeledBatch& b) {
          REQUIRE(b.image.shape() == Shape{b.label.size(0), 3, 8, 8});
          for (std::int64_t r = 0; r < b.label.size(0); ++r) {
            // The flat colour survives crop and resize (within JPEG's error) and names the class.
            const float v = b.image.data<float>()[r * 192 + 100] * 255.f;
            CHECK(std::lround((v - 20.f) / 40.f) == b.label.data<std::int64_t>()[r]);
            ++good;
          }
        },
        [&](const DataError& e) {
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
