#include "ferry/loaders/npy.h"

#include <algorithm>
#include <cstring>

#include "io.h"

namespace ferry {
namespace {

// The header is a Python dict literal, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (60000, 784), }
// parsed here with a small scanner that accepts exactly what numpy writes (and spacing variants).
struct HeaderParser {
  std::string_view s;
  std::size_t pos = 0;
  const std::string& name;
  std::uint64_t base;  // file offset of the header text

  [[noreturn]] void fail(const std::string& what) const { throw DataError(name, base + pos, "bad .npy header: " + what); }
  void skip_ws() {
    while (pos < s.size() && (s[pos] == ' ' || s[pos] == '\t' || s[pos] == '\n' || s[pos] == '\r')) ++pos;
  }
  bool eat(char c) {
    skip_ws();
    if (pos < s.size() && s[pos] == c) return ++pos, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  std::string str() {
    skip_ws();
    if (pos >= s.size() || (s[pos] != '\'' && s[pos] != '"')) fail("expected a string");
    const char q = s[pos++];
    const std::size_t start = pos;
    while (pos < s.size() && s[pos] != q) ++pos;
    if (pos >= s.size()) fail("unterminated string");
    return std::string(s.substr(start, pos++ - start));
  }
  bool boolean() {
    skip_ws();
    if (s.substr(pos, 4) == "True") return pos += 4, true;
    if (s.substr(pos, 5) == "False") return pos += 5, false;
    fail("expected True or False");
  }
  std::int64_t integer() {
    skip_ws();
    std::int64_t v = 0;
    const std::size_t start = pos;
    while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
      if (v > (std::int64_t{1} << 52)) fail("dimension too large");
      v = v * 10 + (s[pos++] - '0');
    }
    if (pos == start) fail("expected a non-negative integer");
    if (pos < s.size() && s[pos] == 'L') ++pos;  // Python 2 long suffix
    return v;
  }
};

struct NpyHeader {
  DType dtype;
  Shape shape;
  std::uint64_t data_offset, nbytes;
};

NpyHeader parse_header(std::span<const std::byte> b, const std::string& name);

DType descr_dtype(const std::string& d, const HeaderParser& p) {
  if (d.size() < 2) p.fail("unsupported dtype '" + d + "'");
  const char order = d[0];
  const std::string t = d.substr(1);
  if (order == '>' && t != "i1" && t != "u1" && t != "b1")
    p.fail("big-endian dtype '" + d + "' is not supported (convert with arr.astype(arr.dtype.newbyteorder('<')))");
  if (order != '<' && order != '|' && order != '=' && order != '>') p.fail("unsupported dtype '" + d + "'");
  if (t == "b1") return DType::Bool;
  if (t == "u1") return DType::UInt8;
  if (t == "i1") return DType::Int8;
  if (t == "i2") return DType::Int16;
  if (t == "i4") return DType::Int32;
  if (t == "i8") return DType::Int64;
  if (t == "f2") return DType::Float16;
  if (t == "f4") return DType::Float32;
  if (t == "f8") return DType::Float64;
  p.fail("unsupported dtype '" + d + "' (supported: bool, int8/16/32/64, uint8, float16/32/64)");
}

loaders::NpyLayout parse_layout(std::span<const std::byte> b, const std::string& name) {
  static constexpr char kMagic[] = "\x93NUMPY";
  if (b.size() < 10 || std::memcmp(b.data(), kMagic, 6) != 0) {
    if (b.size() < 10 && b.size() >= 6 && std::memcmp(b.data(), kMagic, 6) == 0)
      throw DataError(name, b.size(), "truncated .npy header");
    throw DataError(name, 0, "not a .npy file (the magic string \\x93NUMPY is missing)");
  }
  const auto major = std::to_integer<unsigned>(b[6]);
  std::uint64_t len = 0, text_at = 0;
  auto byte = [&](std::size_t i) { return static_cast<std::uint64_t>(std::to_integer<unsigned>(b[i])); };
  if (major == 1) {
    len = byte(8) | byte(9) << 8;
    text_at = 10;
  } else if (major == 2 || major == 3) {
    if (b.size() < 12) throw DataError(name, b.size(), "truncated .npy header");
    len = byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24;
    text_at = 12;
  } else {
    throw DataError(name, 6, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(byte(7)));
  }
  if (text_at + len > b.size())
    throw DataError(name, text_at,
                    "truncated .npy header: it declares " + std::to_string(len) + " bytes, the file has " +
                        std::to_string(b.size() - text_at));
  HeaderParser p{std::string_view(reinterpret_cast<const char*>(b.data()) + text_at, len), 0, name, text_at};
  loaders::NpyLayout h{{}, {}, text_at + len, text_at};
  bool have_descr = false, have_order = false, have_shape = false;
  p.expect('{');
  while (!p.eat('}')) {
    const std::string key = p.str();
    p.expect(':');
    if (key == "descr") {
      p.skip_ws();
      if (p.pos < p.s.size() && p.s[p.pos] == '[') p.fail("structured arrays are not supported");
      h.descr = p.str();
      have_descr = true;
    } else if (key == "fortran_order") {
      if (p.boolean()) p.fail("Fortran-order arrays are not supported (save with np.ascontiguousarray)");
      have_order = true;
    } else if (key == "shape") {
      p.expect('(');
      while (!p.eat(')')) {
        h.shape.push_back(p.integer());
        if (!p.eat(',')) {
          p.expect(')');
          break;
        }
      }
      have_shape = true;
    } else {
      p.fail("unexpected key '" + key + "'");
    }
    if (!p.eat(',')) {
      p.expect('}');
      break;
    }
  }
  if (!have_descr || !have_order || !have_shape) p.fail("missing one of 'descr', 'fortran_order', 'shape'");
  return h;
}

NpyHeader parse_header(std::span<const std::byte> b, const std::string& name) {
  loaders::NpyLayout l = parse_layout(b, name);
  const HeaderParser p{{}, 0, name, l.header_offset};
  NpyHeader h{descr_dtype(l.descr, p), std::move(l.shape), l.data_offset, 0};
  std::uint64_t numel = 1;
  for (std::int64_t d : h.shape) numel = loaders::checked_mul(numel, static_cast<std::uint64_t>(d), name, ".npy element count");
  h.nbytes = loaders::checked_mul(numel, itemsize(h.dtype), name, ".npy data size");
  const std::uint64_t have = b.size() - h.data_offset;
  if (have != h.nbytes)
    throw DataError(name, h.data_offset,
                    "shape " + shape_str(h.shape) + " of " + dtype_name(h.dtype) + " needs " + std::to_string(h.nbytes) +
                        " bytes of data, the file has " + std::to_string(have) +
                        (have < h.nbytes ? " (truncated)" : " (trailing bytes)"));
  return h;
}

}  // namespace

loaders::NpyLayout loaders::npy_layout(std::span<const std::byte> bytes, const std::string& name) {
  return parse_layout(bytes, name);
}

Tensor parse_npy(std::span<const std::byte> bytes, const std::string& name) {
  if (bytes.empty()) throw DataError(name, DataError::kNoOffset, "is empty (0 bytes)");
  NpyHeader h = parse_header(bytes, name);
  Tensor t = Tensor::empty(h.dtype, std::move(h.shape));
  std::memcpy(t.raw(), bytes.data() + h.data_offset, h.nbytes);
  return t;
}

Tensor read_npy(const std::string& path) {
  auto map = loaders::MappedFile::open(path);
  NpyHeader h = parse_header(map->bytes(), path);
  Storage s =
      Storage::wrap(map->data() + h.data_offset, h.nbytes, Device::host(), std::const_pointer_cast<loaders::MappedFile>(map));
  return Tensor(std::move(s), h.dtype, std::move(h.shape));
}

std::vector<HostRows> NpyDataset::host_rows(std::string& why) const {
  (void)why;
  return {{array_.raw(), array_.size(0), array_.nbytes() / static_cast<std::size_t>(std::max<std::int64_t>(array_.size(0), 1)),
           array_.dtype(), Shape(array_.shape().begin() + 1, array_.shape().end()), name_, mapped_, std::nullopt, std::nullopt}};
}

NpyDataset::NpyDataset(const std::string& path) : NpyDataset(read_npy(path)) {
  name_ = path;
  mapped_ = true;
}

NpyDataset::NpyDataset(Tensor array) : array_(std::move(array)), name_("NpyDataset") {
  if (!array_.defined() || array_.dim() == 0)
    throw Error("NpyDataset: needs an array with at least one dimension (rows), got " +
                (array_.defined() ? array_.str() : "none"));
}

Tensor NpyDataset::get(std::size_t i) const {
  if (i >= size()) throw Error(name_ + ": index " + std::to_string(i) + " out of range for " + std::to_string(size()) + " rows");
  return array_.select(static_cast<std::int64_t>(i));
}

Tensor NpyDataset::make_batch(std::size_t rows, BatchAllocator& allocator) const {
  Shape s = array_.shape();
  s[0] = static_cast<std::int64_t>(rows);
  return empty(array_.dtype(), std::move(s), allocator);
}

void NpyDataset::get_into(std::size_t i, Tensor& batch, std::size_t row, SampleContext&) const {
  const Tensor src = get(i);
  std::memcpy(batch.select(static_cast<std::int64_t>(row)).raw(), src.raw(), src.nbytes());
}

}  // namespace ferry
