// loaders/io.h — private: reading files for the loaders, with every failure a ferry::DataError
// naming the file. Every path may also be an object in S3-compatible storage, "s3://bucket/key"
// (loaders/s3.h): these functions are the seam between the formats and where bytes live.
//
//   Blob         one file or object: its size and ranged reads (tar streams read through it)
//   OpenAhead    a reader's opening read of the next object, sent while it reads this one
//   list_prefix  the objects under an s3:// prefix (image folders, shard folders; local folders
//                are listed by their loaders, with std::filesystem)
//   MappedFile   a read-only memory map of a whole file (shared, so Tensors can point into it);
//                an object is read whole into memory instead
//   read_file    a whole file into a buffer (reused by the caller, so decoding allocates nothing)
//   RangeReader  ranges of one file (pread; an object: one ranged GET each)
//   ByteSource   sequential reads over memory or a gzip stream, for parsers that must not trust
//                header fields: read_exact() throws DataError with the offset when data runs out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ferry/core/error.h"

namespace ferry::loaders {

/// A file descriptor closed when it goes (-1: none); moving it hands it over.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) noexcept : fd(f) {}
  Fd(Fd&& other) noexcept : fd(std::exchange(other.fd, -1)) {}
  Fd& operator=(Fd&&) = delete;
  ~Fd();
};

/// True for a path that names an object in S3-compatible storage ("s3://bucket/key").
bool is_remote(std::string_view path) noexcept;

class OpenAhead;
namespace s3 {
class ReadAhead;
}

/// One file or object, read by ranges.
class Blob {
 public:
  /// Opens `path` (a local file or an s3:// URL) and learns its size: DataError (IoError for the
  /// system's or the network's failures) for one that is missing, unreadable, not a regular file,
  /// or empty.
  static std::unique_ptr<Blob> open(const std::string& path);
  /// The same; an object's first `first_piece` bytes come with its size, in one request (or from
  /// `ahead`'s read, when it was sent for this object), for a reader that will read it from the
  /// start in pieces of that size. With `ahead`, the blob moves its read along while it waits for
  /// its own, and sends one asked for with send_later() once every piece to its end is asked for;
  /// `ahead` must outlive the blob.
  static std::unique_ptr<Blob> open(const std::string& path, std::size_t first_piece, OpenAhead* ahead = nullptr);
  virtual ~Blob() = default;
  std::uint64_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }
  /// True when each read is a request over the network (fewer, larger reads pay).
  virtual bool remote() const noexcept = 0;
  /// Reads up to `n` bytes at `offset` into `dst`; fewer only where the blob ends.
  virtual std::size_t read_at(std::uint64_t offset, std::byte* dst, std::size_t n) const = 0;
  /// Moves reads sent ahead (this object's next pieces, and the OpenAhead it was opened with)
  /// along without waiting (a reader calls it between its reads, often, and its worker while it
  /// waits); true while some are still on their way.
  virtual bool progress() const { return false; }

 protected:
  Blob(std::string name, std::uint64_t size) : name_(std::move(name)), size_(size) {}
  std::string name_;
  std::uint64_t size_;
};

/// The opening read of the object a reader opens next, sent ahead so that its first byte is here
/// when Blob::open(path, n, &ahead) opens it (n <= the read's first piece): a stream sends its
/// next shard's as it opens one. A reader's own, used by one thread at a time (it may be handed to
/// another thread: the next epoch's worker); one read at a time, a second replacing the first.
/// A read not taken closes its connection when it is replaced or the OpenAhead is dropped. A
/// first piece larger than the open's is kept whole: the blob's reads take their bytes from it.
class OpenAhead {
 public:
  OpenAhead();
  ~OpenAhead();
  OpenAhead(OpenAhead&&) noexcept;
  OpenAhead& operator=(OpenAhead&&) noexcept;
  /// Sends the opening read of `path` now. Nothing for a local path, or one whose size the disk
  /// cache holds (its open reads the disk).
  void send(const std::string& path, std::size_t first_piece);
  /// The same, sent at the first read of the object this was opened with (Blob::open) that finds
  /// every piece to its end asked for, or at send_now(): a stream asks for its next epoch's first
  /// shard as it opens its last, and the read goes when that shard's reads have.
  void send_later(const std::string& path, std::size_t first_piece);
  /// Sends a read asked for with send_later() now (before it is handed to another reader).
  void send_now();
  /// Moves the read along without waiting; true while it is on its way.
  bool progress();
  /// The object the read is for; empty when there is none.
  const std::string& path() const noexcept;

 private:
  friend class Blob;
  friend class ObjectBlob;
  struct Sent;
  // The read on its way (sent, not yet taken), or null.
  s3::ReadAhead* in_flight() const noexcept;
  std::unique_ptr<Sent> sent_;
};

/// An object found by list_prefix: its URL and size.
struct ListedFile {
  std::string path;
  std::uint64_t size = 0;
};

/// Every object under the s3:// prefix `dir` (ListObjectsV2, every page; "s3://b/train" and
/// "s3://b/train/" both list train/), "folder/" markers left out, sorted by URL. DataError when
/// the prefix holds nothing or cannot be listed.
std::vector<ListedFile> list_prefix(const std::string& dir);

/// One read a batch will need: a whole file (size 0) or a range.
struct Wanted {
  std::string path;
  std::uint64_t offset = 0;
  std::size_t size = 0;
};

/// Reads a batch's objects at once into this thread's prefetch buffer (loaders over s3:// call
/// it from their prefetch()); local paths are skipped (a local read is not worth a thread's
/// wait). A failed read is left out: the sample's own read then retries it and names the error.
void prefetch(const std::vector<Wanted>& wanted);

/// Takes the bytes prefetch() read for (path, offset, size) on this thread into `out`; false when
/// there are none.
bool take_prefetched(const std::string& path, std::uint64_t offset, std::size_t size, std::vector<std::byte>& out);

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
  explicit MappedFile(std::string path) : path_(std::move(path)), data_(nullptr), size_(0) {}
  std::string path_;
  const std::byte* data_;
  std::size_t size_;
  std::vector<std::byte> owned_;  // an object read whole (data_ points into it; nothing mapped)
};

/// Reads all of `path` into `out` (resized to fit). Throws DataError when it cannot be read or is
/// empty.
void read_file(const std::string& path, std::vector<std::byte>& out);

/// Reads ranges of one file with pread (the file stays open while the object lives), or of one
/// object with a ranged GET each.
class RangeReader {
 public:
  /// Opens `path`; DataError (IoError) when it cannot be opened or is not a regular file.
  explicit RangeReader(const std::string& path);
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;
  /// Reads `size` bytes at `offset` into `out` (resized to fit); DataError naming the file and the
  /// offset when the file ends before them.
  void read(std::uint64_t offset, std::size_t size, std::vector<std::byte>& out) const;

 private:
  std::string path_;
  Fd fd_;  // -1 for an object
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

/// A .npy file's header (its dict), as written: the dtype's descr ("<u2"), the shape, where the
/// data start; DataError for a header that does not parse. The caller checks the data's size.
struct NpyLayout {
  std::string descr;
  std::vector<std::int64_t> shape;
  std::uint64_t data_offset = 0;
  std::uint64_t header_offset = 0;  // of the dict's text, for errors
};
NpyLayout npy_layout(std::span<const std::byte> bytes, const std::string& name);

/// Checked a * b for sizes taken from file headers: on overflow a DataError naming `file`, `what`
/// overflowed and the byte `at` where the factor that overflowed it lies (DataError::kNoOffset: none).
std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const std::string& file, const char* what,
                          std::uint64_t at = DataError::kNoOffset);

}  // namespace ferry::loaders
