// loaders/io.h — private: reading files for the loaders, with every failure a ferry::DataError
// naming the file.
//
//   MappedFile   a read-only memory map of a whole file (shared, so Tensors can point into it)
//   read_file    a whole file into a buffer (reused by the caller, so decoding allocates nothing)
//   ByteSource   sequential reads over memory or a gzip stream, for parsers that must not trust
//                header fields: read_exact() throws DataError with the offset when data runs out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/error.h"

namespace ferry::loaders {

/// A read-only mapping of a whole file. Throws DataError for a missing, unreadable, non-regular
/// or empty file.
class MappedFile {
 public:
  static std::shared_ptr<const MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }
  /// The mapping, writable copy-on-write (writes never reach the file).
  std::byte* data() const noexcept { return const_cast<std::byte*>(data_); }
  const std::string& path() const noexcept { return path_; }

 private:
  MappedFile(std::string path, const std::byte* data, std::size_t size) : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const std::byte* data_;
  std::size_t size_;
};

/// Reads all of `path` into `out` (resized to fit). Throws DataError when it cannot be read or is
/// empty.
void read_file(const std::string& path, std::vector<std::byte>& out);

/// Reads ranges of one file with pread (the file stays open while the object lives).
class RangeReader {
 public:
  /// Opens `path`; DataError (IoError) when it cannot be opened or is not a regular file.
  explicit RangeReader(const std::string& path);
  ~RangeReader();
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;
  /// Reads `size` bytes at `offset` into `out` (resized to fit); DataError naming the file and the
  /// offset when the file ends before them.
  void read(std::uint64_t offset, std::size_t size, std::vector<std::byte>& out) const;

 private:
  std::string path_;
  int fd_ = -1;
};

/// True when `bytes` start with the gzip magic number.
bool is_gzip(std::span<const std::byte> bytes) noexcept;

/// Sequential reads from memory, or from a gzip stream inflated on the fly.
class ByteSource {
 public:
  /// Reads `bytes` (inflating when they are gzip). `name` is used in errors.
  ByteSource(std::span<const std::byte> bytes, std::string name);
  ~ByteSource();
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;
  /// Reads exactly `n` bytes into `dst`; DataError ("truncated: needed N bytes, found M") otherwise.
  void read_exact(void* dst, std::size_t n, const char* what);
  /// True when no data is left (for a gzip stream: the stream ended cleanly).
  bool at_end();
  /// Bytes delivered so far (the offset in the decompressed data).
  std::uint64_t offset() const noexcept { return offset_; }
  bool compressed() const noexcept { return zstream_ != nullptr; }
  /// For uncompressed input: the remaining bytes, in place (no copy).
  std::span<const std::byte> rest() const noexcept { return bytes_.subspan(pos_); }
  const std::string& name() const noexcept { return name_; }
  [[noreturn]] void fail(const std::string& what) const;

 private:
  std::size_t read_some(std::byte* dst, std::size_t n);
  std::span<const std::byte> bytes_;
  std::string name_;
  std::size_t pos_ = 0;
  std::uint64_t offset_ = 0;
  struct ZStream;
  std::unique_ptr<ZStream> zstream_;
};

/// Checked a * b for sizes taken from file headers; DataError on overflow.
std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const std::string& file, const char* what);

}  // namespace ferry::loaders
