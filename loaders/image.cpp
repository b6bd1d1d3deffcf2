#include "ferry/loaders/image.h"

#include <png.h>
#include <turbojpeg.h>
#include <zlib.h>
// libjpeg's own API (libjpeg-turbo's, as TurboJPEG's) for what TurboJPEG 2.1 lacks: skipping
// scanlines and cropping columns. jpeglib.h needs <cstdio> first.
#include <cstdio>
#include <jpeglib.h>

#include <algorithm>
#include <csetjmp>
#include <cstring>
#include <filesystem>
#include <map>
#include <system_error>
#include <unordered_map>

#include "ferry/detail/pass_math.h"
#include "image_rows.h"
#include "io.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

struct Decoder {  // one TurboJPEG handle per thread
  tjhandle h = tjInitDecompress();
  ~Decoder() {
    if (h) tjDestroy(h);
  }
};

Decoder& thread_decoder_slot() {
  thread_local Decoder d;
  return d;
}

tjhandle thread_decoder() {
  Decoder& d = thread_decoder_slot();
  if (!d.h) d.h = tjInitDecompress();
  if (!d.h) throw Error(std::string("TurboJPEG: cannot create a decompressor: ") + tjGetErrorStr2(nullptr));
  return d.h;
}

// A handle that reported an error can keep failing on later, valid images (libjpeg-turbo 2.1
// leaves the decompressor mid-stream), so a failed handle is replaced.
void discard_thread_decoder() {
  Decoder& d = thread_decoder_slot();
  if (d.h) tjDestroy(d.h);
  d.h = nullptr;
}

struct Size {
  std::int64_t h, w, c;
};

void check_pixels(const std::string& name, std::int64_t w, std::int64_t h, const DecodeOptions& o) {
  if (w <= 0 || h <= 0)
    throw DataError(name, DataError::kNoOffset, "image has no pixels (" + std::to_string(w) + "x" + std::to_string(h) + ")");
  if (w * h > o.max_pixels)
    throw DataError(name, DataError::kNoOffset,
                    "image is " + std::to_string(w) + "x" + std::to_string(h) + ", more than the limit of " +
                        std::to_string(o.max_pixels) + " pixels");
}

void check_channels(int c) {
  if (c != 0 && c != 1 && c != 3 && c != 4) throw Error("decode_image: channels must be 0, 1, 3 or 4, got " + std::to_string(c));
}

// Reads the header and returns the decoded size; `decode` then fills `dst` (h * w * c bytes).
class JpegDecode {
 public:
  JpegDecode(std::span<const std::byte> bytes, const std::string& name, const DecodeOptions& o) : bytes_(bytes), name_(name) {
    tj_ = thread_decoder();
    int w = 0, h = 0, subsamp = 0, cs = 0;
    if (tjDecompressHeader3(tj_, data(), size(), &w, &h, &subsamp, &cs) != 0) fail("corrupt JPEG header");
    if (w <= 0 || h <= 0) throw DataError(name, DataError::kNoOffset, "corrupt JPEG header: no image size");
    if (cs == TJCS_CMYK || cs == TJCS_YCCK) {
      if (o.channels != 0 && o.channels != 4)
        throw DataError(name, DataError::kNoOffset, "CMYK JPEGs cannot be decoded to RGB or grayscale");
    }
    const int c = o.channels ? o.channels : (cs == TJCS_GRAY ? 1 : (cs == TJCS_CMYK || cs == TJCS_YCCK) ? 4 : 3);
    pf_ = c == 1 ? TJPF_GRAY : c == 3 ? TJPF_RGB : (cs == TJCS_CMYK || cs == TJCS_YCCK) ? TJPF_CMYK : TJPF_RGBA;
    check_pixels(name, w, h, o);
    size_ = {h, w, c};
  }
  Size size_info() const { return size_; }
  void decode(std::uint8_t* dst) {
    // STOPONWARNING: truncated or corrupt entropy data is an error, not a grey-filled image.
    if (tjDecompress2(tj_, data(), size(), dst, static_cast<int>(size_.w), 0, static_cast<int>(size_.h), pf_,
                      TJFLAG_STOPONWARNING) != 0)
      fail("corrupt JPEG data");
  }

 private:
  const unsigned char* data() const { return reinterpret_cast<const unsigned char*>(bytes_.data()); }
  unsigned long size() const { return static_cast<unsigned long>(bytes_.size()); }
  [[noreturn]] void fail(const char* what) const {
    const std::string message = std::string(what) + ": " + tjGetErrorStr2(tj_);
    discard_thread_decoder();
    throw DataError(name_, DataError::kNoOffset, message);
  }
  std::span<const std::byte> bytes_;
  const std::string& name_;
  tjhandle tj_;
  int pf_ = TJPF_RGB;
  Size size_{};
};

// A PNG's header (its signature's 8 bytes, then the IHDR chunk: length, type, width, height, bit
// depth, color type, compression, filter, interlace, CRC) checked field by field, so that a
// damaged header is an error naming the byte where it is wrong (libpng's messages name none).
void check_png_header(std::span<const std::byte> b, const std::string& name) {
  const auto u8 = [&](std::size_t at) { return static_cast<std::uint32_t>(b[at]); };
  const auto u32 = [&](std::size_t at) { return (u8(at) << 24) | (u8(at + 1) << 16) | (u8(at + 2) << 8) | u8(at + 3); };
  if (b.size() < 33)
    throw DataError(name, b.size(), "truncated PNG: its header needs 33 bytes, the file has " + std::to_string(b.size()));
  if (u32(8) != 13) throw DataError(name, 8, "corrupt PNG: the IHDR chunk's length is " + std::to_string(u32(8)) + ", not 13");
  if (std::memcmp(b.data() + 12, "IHDR", 4) != 0) throw DataError(name, 12, "corrupt PNG: the first chunk is not IHDR");
  for (std::size_t at : {std::size_t{16}, std::size_t{20}})
    if (u32(at) == 0 || u32(at) > 0x7fffffffu)
      throw DataError(name, at,
                      std::string("corrupt PNG: its ") + (at == 16 ? "width" : "height") + " is " + std::to_string(u32(at)));
  const std::uint32_t depth = u8(24), type = u8(25);
  const bool depth_ok = (type == 0 && (depth == 1 || depth == 2 || depth == 4 || depth == 8 || depth == 16)) ||
                        (type == 3 && (depth == 1 || depth == 2 || depth == 4 || depth == 8)) ||
                        ((type == 2 || type == 4 || type == 6) && (depth == 8 || depth == 16));
  if (type != 0 && type != 2 && type != 3 && type != 4 && type != 6)
    throw DataError(name, 25, "corrupt PNG: color type " + std::to_string(type) + " is not one PNG defines");
  if (!depth_ok)
    throw DataError(
        name, 24, "corrupt PNG: bit depth " + std::to_string(depth) + " is not allowed with color type " + std::to_string(type));
  if (u8(26) != 0 || u8(27) != 0 || u8(28) > 1)
    throw DataError(name, 26, "corrupt PNG: unknown compression, filter or interlace method in IHDR");
  const auto crc = static_cast<std::uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(b.data() + 12), 17));
  if (crc != u32(29)) throw DataError(name, 29, "corrupt PNG: the IHDR chunk's CRC does not match its bytes");
}

class PngDecode {
 public:
  PngDecode(std::span<const std::byte> bytes, const std::string& name, const DecodeOptions& o) : name_(name) {
    check_png_header(bytes, name);
    std::memset(&img_, 0, sizeof img_);
    img_.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_memory(&img_, bytes.data(), bytes.size())) fail();
    const bool color = img_.format & PNG_FORMAT_FLAG_COLOR, alpha = img_.format & PNG_FORMAT_FLAG_ALPHA;
    const int c = o.channels ? o.channels : (alpha ? 4 : color ? 3 : 1);
    // RGB from a file with alpha drops the alpha (as PIL's convert("RGB")) instead of compositing.
    drop_alpha_ = c == 3 && alpha;
    img_.format = c == 1 ? PNG_FORMAT_GRAY : (c == 3 && !drop_alpha_) ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
    try {
      check_pixels(name, img_.width, img_.height, o);
    } catch (...) {
      png_image_free(&img_);
      throw;
    }
    size_ = {static_cast<std::int64_t>(img_.height), static_cast<std::int64_t>(img_.width), c};
  }
  ~PngDecode() { png_image_free(&img_); }
  Size size_info() const { return size_; }
  void decode(std::uint8_t* dst) {
    if (!drop_alpha_) {
      if (!png_image_finish_read(&img_, nullptr, dst, 0, nullptr)) fail();
      return;
    }
    std::vector<std::uint8_t> rgba(static_cast<std::size_t>(size_.h * size_.w * 4));
    if (!png_image_finish_read(&img_, nullptr, rgba.data(), 0, nullptr)) fail();
    for (std::size_t p = 0, n = static_cast<std::size_t>(size_.h * size_.w); p < n; ++p)
      std::memcpy(dst + 3 * p, rgba.data() + 4 * p, 3);
  }

 private:
  [[noreturn]] void fail() { throw DataError(name_, DataError::kNoOffset, std::string("corrupt PNG: ") + img_.message); }
  png_image img_;
  const std::string& name_;
  bool drop_alpha_ = false;
  Size size_{};
};

// Decodes into `buf` (resized) and returns the size; the scratch path for datasets.
template <class Buffer>
Size decode_into(std::span<const std::byte> bytes, const std::string& name, const DecodeOptions& o, Buffer&& alloc) {
  check_channels(o.channels);
  switch (sniff_image(bytes)) {
    case ImageFormat::Jpeg: {
      JpegDecode d(bytes, name, o);
      d.decode(alloc(d.size_info()));
      return d.size_info();
    }
    case ImageFormat::Png: {
      PngDecode d(bytes, name, o);
      d.decode(alloc(d.size_info()));
      return d.size_info();
    }
    case ImageFormat::Unknown: break;
  }
  if (bytes.empty()) throw DataError(name, DataError::kNoOffset, "is empty (0 bytes)");
  throw DataError(name, 0, "not a JPEG or PNG image (unrecognized magic bytes)");
}

// Note [Region decode]
// decode_transformed_into() decodes a JPEG only as far as its transform reads it. The transform's
// single-pass plan (ImageTransform::plan) names the source rows and columns the bilinear pass
// touches; libjpeg-turbo then
//   * stops after the last row needed (nothing below it is entropy-decoded),
//   * skips the rows above the first one needed (jpeg_skip_scanlines: entropy-decoded, but no
//     IDCT, upsampling or colour conversion), and
//   * runs IDCT, upsampling and colour conversion only for the columns needed
//     (jpeg_crop_scanline, which widens the window to a whole iMCU column).
// Chroma upsampling reads a neighbour sample, and at the edge of a cropped window libjpeg
// replicates the edge instead, so the window asked for is widened by 16 pixels (one iMCU at most)
// on every side where the image goes on: the pixels the pass reads are then the full decode's,
// bit for bit, and so is the output (tests/loaders/test_image.cpp checks it on photographs and on
// edge cases). A file damaged only below the rows read decodes without an error.
//
// With DecodeOptions::dct_scaling, an image whose crop box is at least 2x (4x, 8x) the output on
// both axes is decoded at 1/2 (1/4, 1/8) scale by the IDCT itself, and the pass resamples the
// smaller image: the box is scaled with it (its origin and size rounded to the scaled grid).
// Values then differ from a full decode (the IDCT's scaling averages where bilinear resampling
// without antialiasing picks), which is why it is an option.

// libjpeg reports errors through a callback that must not return: it jumps back to the setjmp
// in the JpegRegion method that called libjpeg. Those methods hold no object with a destructor.
struct JpegErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void on_jpeg_error(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegErrorManager*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}

// Warnings (level -1: corrupt or truncated entropy data) are errors, as TJFLAG_STOPONWARNING.
void on_jpeg_message(j_common_ptr c, int level) {
  if (level < 0) on_jpeg_error(c);
}

class JpegRegion {
 public:
  JpegRegion() {
    cinfo_.err = jpeg_std_error(&err_.pub);
    err_.pub.error_exit = on_jpeg_error;
    err_.pub.emit_message = on_jpeg_message;
    err_.message[0] = '\0';
    ok_ = create();
  }
  ~JpegRegion() {
    if (ok_) jpeg_destroy_decompress(&cinfo_);
  }
  JpegRegion(const JpegRegion&) = delete;
  JpegRegion& operator=(const JpegRegion&) = delete;

  bool usable() const noexcept { return ok_; }
  const char* message() const noexcept { return err_.message; }
  const jpeg_decompress_struct& info() const noexcept { return cinfo_; }

  bool header(const unsigned char* data, unsigned long size) {
    if (setjmp(err_.jump)) return false;
    jpeg_abort_decompress(&cinfo_);
    jpeg_mem_src(&cinfo_, data, size);
    jpeg_read_header(&cinfo_, TRUE);
    return true;
  }
  // Output colour space and scale 1/denom; then the scaled size is in info().output_*.
  bool start(J_COLOR_SPACE out, unsigned denom) {
    if (setjmp(err_.jump)) return false;
    cinfo_.out_color_space = out;
    cinfo_.scale_num = 1;
    cinfo_.scale_denom = denom;
    jpeg_start_decompress(&cinfo_);
    return true;
  }
  // Columns [*x, *x + *width), widened by libjpeg to whole iMCUs.
  bool crop(JDIMENSION* x, JDIMENSION* width) {
    if (setjmp(err_.jump)) return false;
    if (*x != 0 || *width != cinfo_.output_width) jpeg_crop_scanline(&cinfo_, x, width);
    return true;
  }
  // Skips `skip` rows, then reads `rows` into dst (one row each `pitch` bytes).
  bool read(JDIMENSION skip, JDIMENSION rows, unsigned char* dst, std::size_t pitch) {
    if (setjmp(err_.jump)) return false;
    if (skip && jpeg_skip_scanlines(&cinfo_, skip) != skip) return truncated();
    for (JDIMENSION done = 0; done < rows;) {
      JSAMPROW r[16];
      const JDIMENSION n = std::min<JDIMENSION>(rows - done, 16);
      for (JDIMENSION k = 0; k < n; ++k) r[k] = dst + (done + k) * pitch;
      const JDIMENSION got = jpeg_read_scanlines(&cinfo_, r, n);
      if (got == 0) return truncated();
      done += got;
    }
    return true;
  }
  // Back to the idle state, ready for the next file (the rest of this one is never read).
  void reset() noexcept {
    if (setjmp(err_.jump)) return;
    jpeg_abort_decompress(&cinfo_);
  }

 private:
  bool create() {
    if (setjmp(err_.jump)) return false;
    jpeg_create_decompress(&cinfo_);
    return true;
  }
  bool truncated() {
    std::snprintf(err_.message, sizeof err_.message, "the data ends before the image does");
    return false;
  }
  jpeg_decompress_struct cinfo_{};
  JpegErrorManager err_{};
  bool ok_ = false;
};

JpegRegion& thread_region() {
  thread_local JpegRegion r;
  return r;
}

// The plan's axis on an image decoded at 1/denom scale: the crop box moves to the scaled grid.
void scale_axis(ImagePassPlan::Axis& a, unsigned denom, std::int64_t scaled) {
  const double f = 1.0 / denom;
  const std::int64_t len = std::clamp<std::int64_t>(std::llround(static_cast<double>(a.L0) * f), 1, scaled);
  a.c0 = std::clamp<std::int64_t>(std::llround(static_cast<double>(a.c0) * f), 0, scaled - len);
  a.L0 = len;
}

// Note [Region decode]. Returns false, leaving `rng` as it was, when this path does not apply (a
// CMYK file, a transform that needs more than one pass); the caller then decodes the whole image.
template <class BeforePass>
bool decode_region(std::span<const std::byte> bytes, const std::string& name, const ImageTransform& transform, Generator& rng,
                   const Tensor& out, const DecodeOptions& o, Storage& pixels, BeforePass&& before_pass) {
  JpegRegion& j = thread_region();
  if (!j.usable()) return false;
  struct Reset {  // whatever happens, the thread's decompressor is idle afterwards
    JpegRegion& j;
    ~Reset() { j.reset(); }
  } reset{j};
  auto fail = [&](const char* what) { throw DataError(name, DataError::kNoOffset, std::string(what) + ": " + j.message()); };
  if (!j.header(reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size())))
    fail("corrupt JPEG header");
  const jpeg_decompress_struct& info = j.info();
  if (info.jpeg_color_space == JCS_CMYK || info.jpeg_color_space == JCS_YCCK) return false;
  if (info.image_width == 0 || info.image_height == 0)
    throw DataError(name, DataError::kNoOffset, "corrupt JPEG header: no image size");
  check_pixels(name, info.image_width, info.image_height, o);
  const int C = o.channels ? o.channels : (info.jpeg_color_space == JCS_GRAYSCALE ? 1 : 3);
  if (C != 1 && C != 3) return false;
  const Generator before = rng;
  std::optional<ImagePassPlan> plan = transform.plan(info.image_height, info.image_width, C, rng);
  if (!plan) {
    rng = before;
    return false;
  }
  unsigned denom = 1;
  if (o.dct_scaling && plan->y.resized && plan->x.resized)
    while (denom < 8 && plan->y.L0 >= 2 * denom * plan->y.R && plan->x.L0 >= 2 * denom * plan->x.R) denom *= 2;
  if (!j.start(C == 1 ? JCS_GRAYSCALE : JCS_RGB, denom)) fail("corrupt JPEG data");
  const auto H = static_cast<std::int64_t>(info.output_height), W = static_cast<std::int64_t>(info.output_width);
  if (denom > 1) {
    scale_axis(plan->y, denom, H);
    scale_axis(plan->x, denom, W);
  }
  auto [y0, y1] = plan->y.source();
  auto [x0, x1] = plan->x.source();
  if (y0 >= y1 || x0 >= x1) y0 = 0, y1 = 1, x0 = 0, x1 = 1;  // all padding: the pass reads nothing
  constexpr std::int64_t kMargin = 16;                       // one iMCU at most: see the Note
  auto x = static_cast<JDIMENSION>(std::max<std::int64_t>(x0 - kMargin, 0));
  auto width = static_cast<JDIMENSION>(std::min(x1 + kMargin, W) - x);
  if (!j.crop(&x, &width)) fail("corrupt JPEG data");
  const std::int64_t top = std::max<std::int64_t>(y0 - kMargin, 0), rows = std::min(y1 + kMargin, H) - top;
  const auto need = static_cast<std::size_t>(rows * width * C);
  if (pixels.nbytes() < need) pixels = Storage::allocate(need);
  if (!j.read(static_cast<JDIMENSION>(top), static_cast<JDIMENSION>(rows), reinterpret_cast<unsigned char*>(pixels.data()),
              static_cast<std::size_t>(width) * C))
    fail("corrupt JPEG data");
  plan->y.c0 -= top;
  plan->x.c0 -= static_cast<std::int64_t>(x);
  before_pass();
  apply_plan(*plan, Tensor(pixels, DType::UInt8, {rows, static_cast<std::int64_t>(width), C}), out);
  return true;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return s;
}

[[noreturn]] void fs_fail(const fs::path& p, const char* what, const std::error_code& ec) {
  throw DataError(p.string(), DataError::kNoOffset, std::string(what) + ": " + ec.message());
}

// Thread-local buffers for the dataset path: file bytes and decoded pixels (grown, never shrunk;
// freed at thread exit).
struct Scratch {
  std::vector<std::byte> file;
  Storage pixels;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

ImageFormat sniff_image(std::span<const std::byte> b) noexcept {
  auto at = [&](std::size_t i) { return std::to_integer<unsigned>(b[i]); };
  if (b.size() >= 3 && at(0) == 0xFF && at(1) == 0xD8 && at(2) == 0xFF) return ImageFormat::Jpeg;
  static constexpr unsigned kPng[8] = {0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A};
  if (b.size() >= 8 &&
      std::equal(kPng, kPng + 8, b.begin(), [](unsigned x, std::byte y) { return x == std::to_integer<unsigned>(y); }))
    return ImageFormat::Png;
  return ImageFormat::Unknown;
}

Tensor decode_image(std::span<const std::byte> bytes, const std::string& name, const DecodeOptions& options) {
  Tensor out;
  decode_into(bytes, name, options, [&](Size s) {
    out = Tensor::empty(DType::UInt8, {s.h, s.w, s.c});
    return out.data<std::uint8_t>();
  });
  return out;
}

namespace {
// decode_transformed_into, calling before_pass() between the decode and the transform's pass.
template <class BeforePass>
void decode_transformed(std::span<const std::byte> bytes, const std::string& name, const ImageTransform& transform,
                        Generator& rng, const Tensor& out, const DecodeOptions& options, BeforePass&& before_pass) {
  check_channels(options.channels);
  Scratch& s = scratch();
  if (sniff_image(bytes) == ImageFormat::Jpeg && decode_region(bytes, name, transform, rng, out, options, s.pixels, before_pass))
    return;
  const Size sz = decode_into(bytes, name, options, [&](Size z) {
    const auto need = static_cast<std::size_t>(z.h * z.w * z.c);
    if (s.pixels.nbytes() < need) s.pixels = Storage::allocate(need);
    return reinterpret_cast<std::uint8_t*>(s.pixels.data());
  });
  before_pass();
  transform.apply_into(Tensor(s.pixels, DType::UInt8, {sz.h, sz.w, sz.c}), out, rng);  // a view of the scratch, no copy
}

// The dataset path: decode time counts as Fetch, the pass as Transform (stats, traces).
void decode_transformed(std::span<const std::byte> bytes, const std::string& name, const ImageTransform& transform,
                        SampleContext& ctx, const Tensor& out, const DecodeOptions& options) {
  bool entered = false;
  Stage prev = Stage::Idle;
  decode_transformed(bytes, name, transform, ctx.rng(), out, options, [&] {
    prev = ctx.enter(Stage::Transform);
    entered = true;
  });
  if (entered) ctx.enter(prev);
}
}  // namespace

void decode_transformed_into(std::span<const std::byte> bytes, const std::string& name, const ImageTransform& transform,
                             Generator& rng, const Tensor& out, const DecodeOptions& options) {
  decode_transformed(bytes, name, transform, rng, out, options, [] {});
}

Tensor read_image(const std::string& path, const DecodeOptions& options) {
  std::vector<std::byte> bytes;
  loaders::read_file(path, bytes);
  return decode_image(bytes, path, options);
}

ImageFolder::ImageFolder(const std::string& root, ImageFolderOptions options) : options_(std::move(options)) {
  if (options_.channels != 1 && options_.channels != 3 && options_.channels != 4)
    throw Error("ImageFolder: channels must be 1, 3 or 4, got " + std::to_string(options_.channels));
  for (std::string& e : options_.extensions) e = lower(e);
  const auto wanted = [&](const std::string& name) {
    const std::size_t dot = name.rfind('.');
    const std::string ext = dot == std::string::npos ? std::string() : lower(name.substr(dot));
    return std::find(options_.extensions.begin(), options_.extensions.end(), ext) != options_.extensions.end();
  };
  remote_ = loaders::is_remote(root);
  if (remote_) {
    // A prefix in object storage: one listing, whose keys <root>/<class>/.../<file> give the
    // classes and files in the order a local folder would (classes sorted; files by folder, then name).
    std::unordered_map<std::string, std::uint64_t> sizes;
    const std::string base = root.back() == '/' ? root : root + "/";
    std::map<std::string, std::vector<std::pair<std::string, std::string>>> by_class;
    for (const loaders::ListedFile& f : loaders::list_prefix(root)) {
      const std::string rel = f.path.substr(base.size());
      const std::size_t slash = rel.find('/');
      if (slash == std::string::npos) continue;  // a file beside the class folders
      const std::string cls = rel.substr(0, slash);
      auto& found = by_class[cls];
      const std::size_t last = f.path.rfind('/');
      const std::string name = f.path.substr(last + 1);
      if (wanted(name)) {
        found.emplace_back(f.path.substr(0, last), name);
        sizes[f.path] = f.size;
      }
    }
    if (by_class.empty()) throw DataError(root, DataError::kNoOffset, "holds no class folders (expected root/<class>/<image>)");
    for (auto& [cls, found] : by_class) {
      if (found.empty())
        throw DataError(base + cls + "/", DataError::kNoOffset, "class folder '" + cls + "' holds no image files");
      const auto label = static_cast<std::int64_t>(classes_.size());
      classes_.push_back(cls);
      std::sort(found.begin(), found.end());
      for (auto& [folder, name] : found) files_.push_back({folder + "/" + name, label});
    }
    if (decodes_on_device()) {
      loaders::check_gpu_decode("ImageFolder", options_.channels, options_.transform);
      std::size_t largest = 0;
      for (const File& f : files_) largest = std::max<std::size_t>(largest, static_cast<std::size_t>(sizes[f.path]));
      slot_ = loaders::encoded_slot(largest);
    }
    return;
  }
  std::error_code ec;
  const fs::path base(root);
  const fs::file_status st = fs::status(base, ec);
  if (st.type() == fs::file_type::not_found) throw DataError(root, DataError::kNoOffset, "does not exist");
  if (ec) fs_fail(base, "cannot read the dataset root", ec);
  if (st.type() != fs::file_type::directory) throw DataError(root, DataError::kNoOffset, "is not a directory");
  fs::directory_iterator it(base, ec);
  if (ec) fs_fail(base, "cannot list the dataset root", ec);
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) fs_fail(base, "cannot list the dataset root", ec);
    if (it->is_directory(ec)) classes_.push_back(it->path().filename().string());
  }
  if (ec) fs_fail(base, "cannot list the dataset root", ec);
  std::sort(classes_.begin(), classes_.end());
  if (classes_.empty()) throw DataError(root, DataError::kNoOffset, "holds no class folders (expected root/<class>/<image>)");
  for (std::size_t label = 0; label < classes_.size(); ++label) {
    const fs::path dir = base / classes_[label];
    std::vector<std::pair<std::string, std::string>> found;  // (folder, file name), sorted as os.walk
    fs::recursive_directory_iterator rit(dir, fs::directory_options::follow_directory_symlink, ec);
    if (ec) fs_fail(dir, "cannot list the class folder", ec);
    for (; rit != fs::recursive_directory_iterator(); rit.increment(ec)) {
      if (ec) fs_fail(rit->path(), "cannot list", ec);
      if (!rit->is_regular_file(ec)) continue;
      const fs::path& p = rit->path();
      const std::string ext = lower(p.extension().string());
      if (std::find(options_.extensions.begin(), options_.extensions.end(), ext) != options_.extensions.end())
        found.emplace_back(p.parent_path().string(), p.filename().string());
    }
    if (ec) fs_fail(dir, "cannot list the class folder", ec);
    if (found.empty())
      throw DataError(dir.string(), DataError::kNoOffset, "class folder '" + classes_[label] + "' holds no image files");
    std::sort(found.begin(), found.end());
    for (auto& [folder, name] : found) files_.push_back({(fs::path(folder) / name).string(), static_cast<std::int64_t>(label)});
  }
  if (decodes_on_device()) {
    loaders::check_gpu_decode("ImageFolder", options_.channels, options_.transform);
    std::size_t largest = 0;
    for (const File& f : files_) {
      std::error_code fec;
      const auto n = fs::file_size(f.path, fec);
      if (fec) fs_fail(f.path, "cannot read the size of", fec);
      largest = std::max<std::size_t>(largest, static_cast<std::size_t>(n));
    }
    slot_ = loaders::encoded_slot(largest);
  }
}

void ImageFolder::prefetch(std::span<const std::size_t> indices) const {
  if (!remote_) return;
  std::vector<loaders::Wanted> wanted;
  wanted.reserve(indices.size());
  for (const std::size_t i : indices)
    if (i < files_.size()) wanted.push_back({files_[i].path, 0, 0});
  loaders::prefetch(wanted);
}

namespace loaders {

std::vector<std::byte>& file_scratch() { return scratch().file; }

void check_gpu_decode(const std::string& who, int channels, const ImageTransform& transform) {
  if (channels != 3) throw Error(who + ": decode=gpu produces RGB: channels must be 3, got " + std::to_string(channels));
  Generator probe(0);
  if (!transform.fixed_output_shape(3) || !transform.plan(256, 256, 3, probe))
    throw Error(who +
                ": decode=gpu needs a transform that runs as one pass and ends in a fixed size (crops, "
                "flips, one resize, to_float, normalize), got " +
                transform.str());
}

LabeledSample image_sample(const ImageRows& rows, std::span<const std::byte> bytes, const std::string& name, std::int64_t label,
                           SampleContext& ctx) {
  const DecodeOptions decode{rows.channels, rows.max_pixels, rows.dct_scaling};
  if (std::optional<Shape> shape = rows.transform.fixed_output_shape(rows.channels)) {
    Tensor out = Tensor::empty(rows.transform.output_dtype(DType::UInt8), std::move(*shape));
    decode_transformed(bytes, name, rows.transform, ctx, out, decode);
    return {std::move(out), label};
  }
  Tensor img = decode_image(bytes, name, decode);
  if (rows.transform.empty()) return {std::move(img), label};
  Stage prev = ctx.enter(Stage::Transform);
  Tensor out = rows.transform(img, ctx.rng());
  ctx.enter(prev);
  return {std::move(out), label};
}

LabeledBatch image_batch(const ImageRows& rows, std::size_t n, BatchAllocator& allocator, const std::string& who) {
  if (rows.gpu) {
    LabeledBatch b;
    b.label = empty(DType::Int64, {static_cast<std::int64_t>(n)}, allocator);
    b.encoded = empty(DType::UInt8, {static_cast<std::int64_t>(std::max<std::size_t>(n * rows.slot, 1))}, allocator);
    b.encoded_index = empty(DType::Int64, {static_cast<std::int64_t>(n), detail::kEncodedIndexWords}, allocator);
    return b;
  }
  std::optional<Shape> shape = rows.transform.fixed_output_shape(rows.channels);
  if (!shape)
    throw Error(who +
                ": batching needs a transform that ends in a fixed size (resize(h, w), center_crop or "
                "random_resized_crop), so every image fits one batch shape; the transform is " +
                rows.transform.str());
  shape->insert(shape->begin(), static_cast<std::int64_t>(n));
  return {empty(rows.transform.output_dtype(DType::UInt8), std::move(*shape), allocator),
          empty(DType::Int64, {static_cast<std::int64_t>(n)}, allocator)};
}

}  // namespace loaders

struct ImageFolder::Rows : loaders::ImageRows {};
ImageFolder::Rows ImageFolder::rows() const {
  return {{options_.transform, options_.channels, options_.max_pixels, options_.dct_scaling, decodes_on_device(), slot_}};
}

LabeledSample ImageFolder::get(std::size_t i, SampleContext& ctx) const {
  const File& f = files_.at(i);
  std::vector<std::byte>& bytes = loaders::file_scratch();
  if (!remote_ || !loaders::take_prefetched(f.path, 0, 0, bytes)) loaders::read_file(f.path, bytes);
  return loaders::image_sample(rows(), bytes, f.path, f.label, ctx);
}

LabeledBatch ImageFolder::make_batch(std::size_t n, BatchAllocator& allocator) const {
  return loaders::image_batch(rows(), n, allocator, "ImageFolder");
}

JpegPlan plan_jpeg(std::span<const std::byte> bytes, const std::string& name, const ImageTransform& transform, Generator& rng,
                   std::int64_t max_pixels) {
  const ImageFormat format = sniff_image(bytes);
  if (format != ImageFormat::Jpeg)
    throw DataError(
        name, DataError::kNoOffset,
        std::string("decode=gpu takes JPEG files only; this is ") + (format == ImageFormat::Png ? "a PNG" : "not a JPEG"));
  int w = 0, h = 0, subsampling = 0, colorspace = 0;
  tjhandle tj = thread_decoder();
  if (tjDecompressHeader3(tj, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()), &w,
                          &h, &subsampling, &colorspace) != 0) {
    const std::string why = tjGetErrorStr2(tj);
    discard_thread_decoder();
    throw DataError(name, DataError::kNoOffset, "corrupt JPEG header: " + why);
  }
  if (w <= 0 || h <= 0 || static_cast<std::int64_t>(w) * h > max_pixels)
    throw DataError(name, DataError::kNoOffset,
                    "image of " + std::to_string(w) + "x" + std::to_string(h) + " pixels is refused (max_pixels)");
  std::optional<ImagePassPlan> plan = transform.plan(h, w, 3, rng);
  if (!plan) throw Error("decode=gpu: the transform " + transform.str() + " needs more than one pass");
  return {h, w, *plan};
}

std::int64_t detail::encoded_index_words() noexcept { return kEncodedIndexWords; }

void detail::write_encoded_row(std::int64_t* r, std::size_t offset, std::size_t bytes, const JpegPlan& jp) {
  const ImagePassPlan& plan = jp.plan;
  std::fill(r, r + kEncodedIndexWords, 0);
  auto axis = [](std::int64_t* at, const ImagePassPlan::Axis& a) {
    at[0] = a.c0, at[1] = a.L0, at[2] = a.R, at[3] = a.c1, at[4] = a.N, at[5] = a.resized, at[6] = a.flip;
  };
  auto bits = [](float v) {
    std::int32_t b;
    std::memcpy(&b, &v, sizeof b);
    return static_cast<std::int64_t>(b);
  };
  r[EncodedRow::kOffset] = static_cast<std::int64_t>(offset);
  r[EncodedRow::kBytes] = static_cast<std::int64_t>(bytes);
  r[EncodedRow::kHeight] = jp.height;
  r[EncodedRow::kWidth] = jp.width;
  axis(r + EncodedRow::kAxisY, plan.y);
  axis(r + EncodedRow::kAxisX, plan.x);
  r[EncodedRow::kChannels] = plan.channels;
  r[EncodedRow::kRound] = plan.round;
  r[EncodedRow::kOutput] = pass_output_of(plan.out_dtype);  // UInt8 unless to_float
  r[EncodedRow::kChannelsLast] = plan.channels_last;
  for (int c = 0; c < 4; ++c) {
    r[EncodedRow::kScale + c] = bits(plan.a[c]);
    r[EncodedRow::kShift + c] = bits(plan.b[c]);
  }
}

namespace {
// GPU decode's row: the compressed bytes at row * slot of the encoded block, and the index row
// the device stage reads (where the bytes are, the image's size and its transform's plan).
void encoded_row_into(const loaders::ImageRows& rows, std::span<const std::byte> bytes, const std::string& name,
                      std::int64_t label, LabeledBatch& batch, std::size_t row, SampleContext& ctx) {
  const Stage prev = ctx.enter(Stage::Transform);
  const JpegPlan jp = plan_jpeg(bytes, name, rows.transform, ctx.rng(), rows.max_pixels);
  ctx.enter(prev);
  if (bytes.size() > rows.slot)
    throw DataError(name, DataError::kNoOffset,
                    "the file grew after the dataset was indexed (" + std::to_string(bytes.size()) + " bytes, at most " +
                        std::to_string(rows.slot) + " when indexed)");
  std::memcpy(batch.encoded.data<std::uint8_t>() + row * rows.slot, bytes.data(), bytes.size());
  detail::write_encoded_row(
      batch.encoded_index.data<std::int64_t>() + static_cast<std::int64_t>(row) * detail::kEncodedIndexWords, row * rows.slot,
      bytes.size(), jp);
  batch.label.data<std::int64_t>()[row] = label;
}
}  // namespace

void loaders::image_row_into(const ImageRows& rows, std::span<const std::byte> bytes, const std::string& name, std::int64_t label,
                             LabeledBatch& batch, std::size_t row, SampleContext& ctx) {
  if (rows.gpu) return encoded_row_into(rows, bytes, name, label, batch, row, ctx);
  decode_transformed(bytes, name, rows.transform, ctx, batch.image.select(static_cast<std::int64_t>(row)),
                     {rows.channels, rows.max_pixels, rows.dct_scaling});
  batch.label.data<std::int64_t>()[row] = label;
}

void ImageFolder::get_into(std::size_t i, LabeledBatch& batch, std::size_t row, SampleContext& ctx) const {
  const File& f = files_.at(i);
  std::vector<std::byte>& bytes = loaders::file_scratch();
  if (!remote_ || !loaders::take_prefetched(f.path, 0, 0, bytes)) loaders::read_file(f.path, bytes);
  loaders::image_row_into(rows(), bytes, f.path, f.label, batch, row, ctx);
}

}  // namespace ferry
