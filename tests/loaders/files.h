// Test helpers that write the files the loader tests read: temporary folders, IDX, .npy, tar,
// gzip, JPEG and PNG bytes. Everything is generated, so the tests need no data files.
#pragma once

#include <png.h>
#include <turbojpeg.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ferry::test {

using Bytes = std::vector<std::byte>;

/// A fresh folder under $TMPDIR, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry-test-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline Bytes bytes_of(const std::string& s) {
  Bytes b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

inline void write_file(const std::string& path, const Bytes& data) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

inline Bytes read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return bytes_of(text);
}

inline Bytes gzip(const Bytes& in) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  Bytes out(deflateBound(&z, in.size()) + 32);
  z.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

/// IDX bytes: type code, dimensions, and the element bytes already in big-endian order.
inline Bytes idx_bytes(std::uint8_t type, const std::vector<std::uint32_t>& dims, const Bytes& data) {
  Bytes b{std::byte{0}, std::byte{0}, std::byte{type}, std::byte(dims.size())};
  for (std::uint32_t d : dims)
    for (int s = 24; s >= 0; s -= 8) b.push_back(std::byte((d >> s) & 0xff));
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

/// A .npy v1.0 file with the given header dict and raw data.
inline Bytes npy_bytes(const std::string& dict, const Bytes& data, int major = 1) {
  std::string header = dict;
  const std::size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::string head = std::string("\x93NUMPY", 6) + char(major) + char(0);
  const std::size_t n = header.size();
  head += char(n & 0xff);
  head += char((n >> 8) & 0xff);
  if (major != 1) {
    head += char((n >> 16) & 0xff);
    head += char((n >> 24) & 0xff);
  }
  Bytes b = bytes_of(head + header);
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

/// Builds a ustar archive in memory.
class TarBuilder {
 public:
  TarBuilder& file(const std::string& path, const Bytes& data, char type = '0') {
    header(path, data.size(), type);
    out_.insert(out_.end(), data.begin(), data.end());
    out_.resize((out_.size() + 511) / 512 * 512);
    return *this;
  }
  TarBuilder& file(const std::string& path, const std::string& text) { return file(path, bytes_of(text)); }
  TarBuilder& dir(const std::string& path) {
    header(path, 0, '5');
    return *this;
  }
  /// A GNU long-name entry followed by the file.
  TarBuilder& long_file(const std::string& path, const Bytes& data) {
    file("././@LongLink", bytes_of(path + '\0'), 'L');
    return file("placeholder", data);
  }
  /// A pax header giving the path, followed by the file.
  TarBuilder& pax_file(const std::string& path, const Bytes& data) {
    std::string rec = " path=" + path + "\n";
    std::size_t len = rec.size() + 2;
    if (std::to_string(len).size() + rec.size() != len) ++len;
    file("PaxHeaders/x", bytes_of(std::to_string(len) + rec), 'x');
    return file("truncated-name", data);
  }
  Bytes finish() const {
    Bytes b = out_;
    b.resize(b.size() + 1024);
    return b;
  }
  Bytes raw() const { return out_; }

 private:
  void header(const std::string& path, std::size_t size, char type) {
    char h[512] = {};
    std::snprintf(h, 100, "%s", path.c_str());
    std::snprintf(h + 100, 8, "%07o", 0644);
    std::snprintf(h + 108, 8, "%07o", 0);
    std::snprintf(h + 116, 8, "%07o", 0);
    std::snprintf(h + 124, 12, "%011lo", static_cast<unsigned long>(size));
    std::snprintf(h + 136, 12, "%011o", 0);
    h[156] = type;
    std::memcpy(h + 257,
                "ustar\0"
                "00",
                8);
    std::memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (unsigned char c : h) sum += c;
    std::snprintf(h + 148, 8, "%06o", sum);
    h[155] = ' ';
    const auto* p = reinterpret_cast<const std::byte*>(h);
    out_.insert(out_.end(), p, p + 512);
  }
  Bytes out_;
};

/// The bytes of a vector's elements, as a file stores them.
template <class T>
Bytes raw_bytes(const std::vector<T>& v) {
  Bytes b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

/// A Megatron-LM index (prefix.idx) in the published MMIDIDX layout: version 1, the dtype code (8:
/// uint16, 4: int32, ...), then the sequence lengths, their byte pointers into prefix.bin and the
/// document indices.
inline Bytes megatron_idx_bytes(std::uint8_t code, const std::vector<std::int32_t>& lengths,
                                const std::vector<std::int64_t>& pointers, const std::vector<std::int64_t>& docs) {
  Bytes b;
  auto put = [&](const void* p, std::size_t n) {
    const auto* c = static_cast<const std::byte*>(p);
    b.insert(b.end(), c, c + n);
  };
  put("MMIDIDX\0\0", 9);
  const std::uint64_t version = 1, s = lengths.size(), d = docs.size();
  put(&version, 8);
  put(&code, 1);
  put(&s, 8);
  put(&d, 8);
  put(lengths.data(), lengths.size() * 4);
  put(pointers.data(), pointers.size() * 8);
  put(docs.data(), docs.size() * 8);
  return b;
}

/// JPEG bytes of an RGB or gray image (quality q; chroma subsampling `ss` as TurboJPEG's TJSAMP_*,
/// 4:4:4 unless given; TJFLAG_* flags such as TJFLAG_PROGRESSIVE).
inline Bytes encode_jpeg(const std::vector<std::uint8_t>& pixels, int w, int h, int channels, int q = 95, int ss = TJSAMP_444,
                         int flags = 0) {
  tjhandle t = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const int pf = channels == 1 ? TJPF_GRAY : TJPF_RGB;
  if (channels == 1) ss = TJSAMP_GRAY;
  if (tjCompress2(t, pixels.data(), w, 0, h, pf, &buf, &size, ss, q, flags) != 0) throw std::runtime_error(tjGetErrorStr2(t));
  Bytes out(size);
  std::memcpy(out.data(), buf, size);
  tjFree(buf);
  tjDestroy(t);
  return out;
}

/// PNG bytes (1, 3 or 4 channels).
inline Bytes encode_png(const std::vector<std::uint8_t>& pixels, int w, int h, int channels) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(w);
  img.height = static_cast<png_uint_32>(h);
  img.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, pixels.data(), 0, nullptr)) throw std::runtime_error(img.message);
  Bytes out(size);
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, pixels.data(), 0, nullptr)) throw std::runtime_error(img.message);
  out.resize(size);
  return out;
}

/// A w x h image with a photograph's mix of smooth areas, edges and fine texture (seeded noise),
/// for checks that must see every decoder path (chroma upsampling, IDCT of busy blocks).
inline std::vector<std::uint8_t> textured(int w, int h, int channels, std::uint32_t seed = 1) {
  std::vector<std::uint8_t> p(static_cast<std::size_t>(w) * h * channels);
  std::uint32_t r = seed * 2654435761u + 12345u;
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < channels; ++c) {
        r = r * 1664525u + 1013904223u;
        const int smooth = (x * 3 + y * 2 + c * 70) % 256, edge = ((x / 11 + y / 7) % 2) * 90, noise = static_cast<int>(r >> 27);
        p[(static_cast<std::size_t>(y) * w + x) * channels + c] = static_cast<std::uint8_t>((smooth + edge + noise) % 256);
      }
  return p;
}

/// A smooth w x h image (JPEG-friendly), with an optional per-image offset.
inline std::vector<std::uint8_t> gradient(int w, int h, int channels, int offset = 0) {
  std::vector<std::uint8_t> p(static_cast<std::size_t>(w * h * channels));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < channels; ++c)
        p[static_cast<std::size_t>((y * w + x) * channels + c)] =
            static_cast<std::uint8_t>((offset + x * 2 + y * 3 + c * 40) % 200);
  return p;
}

}  // namespace ferry::test
