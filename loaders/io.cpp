#include "io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "cache.h"
#include "s3.h"

namespace ferry::loaders {

Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

namespace {

[[noreturn]] void throw_errno(const std::string& path, const char* what) {
  const int e = errno;
  throw IoError(path, DataError::kNoOffset, std::string(what) + ": " + std::strerror(e), e);
}

// Opens `path` for reading and returns its size; DataError for anything but a non-empty regular file.
std::size_t open_regular(const std::string& path, Fd& f) {
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw_errno(path, "cannot open");
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw_errno(path, "cannot stat");
  if (S_ISDIR(st.st_mode)) throw DataError(path, DataError::kNoOffset, "is a directory, expected a file");
  if (!S_ISREG(st.st_mode)) throw DataError(path, DataError::kNoOffset, "is not a regular file");
  if (st.st_size == 0) throw DataError(path, DataError::kNoOffset, "is empty (0 bytes)");
  return static_cast<std::size_t>(st.st_size);
}

}  // namespace

bool is_remote(std::string_view path) noexcept { return s3::is_url(path); }

namespace {

class LocalBlob final : public Blob {
 public:
  LocalBlob(const std::string& path, Fd fd, std::uint64_t size) : Blob(path, size), fd_(std::move(fd)) {}
  bool remote() const noexcept override { return false; }
  std::size_t read_at(std::uint64_t offset, std::byte* dst, std::size_t n) const override;

 private:
  Fd fd_;
};

}  // namespace

// OpenAhead's read, and the object it is for. One asked for with send_later() waits (`later`)
// until the object being read with it has asked for its last piece.
struct OpenAhead::Sent {
  std::string path;  // empty: none in flight
  std::size_t first_piece = 0;
  s3::ReadAhead read;
  bool later = false;  // not sent yet

  // Sends a read asked for later; false when it cannot be (a bad URL: its own open names it).
  bool send() {
    later = false;
    try {
      read.start_first(s3::parse(path), first_piece);
      return true;
    } catch (const Error&) {
      read.cancel();
      path.clear();
      return false;
    }
  }
  // Drops the read in flight, if any.
  void clear() {
    if (!path.empty() && !later) read.cancel();
    path.clear();
    later = false;
  }
};

OpenAhead::OpenAhead() = default;
OpenAhead::~OpenAhead() = default;
OpenAhead::OpenAhead(OpenAhead&&) noexcept = default;
OpenAhead& OpenAhead::operator=(OpenAhead&&) noexcept = default;

const std::string& OpenAhead::path() const noexcept {
  static const std::string none;
  return sent_ ? sent_->path : none;
}

s3::ReadAhead* OpenAhead::in_flight() const noexcept {
  return sent_ && !sent_->path.empty() && !sent_->later ? &sent_->read : nullptr;
}

bool OpenAhead::progress() {
  s3::ReadAhead* read = in_flight();
  return read && read->progress();
}

void OpenAhead::send_later(const std::string& path, std::size_t first_piece) {
  if (sent_) sent_->clear();
  if (!is_remote(path) || first_piece == 0) return;
  if (cache::enabled() && cache::contains(cache::size_key(path))) return;  // its open reads the disk
  if (!sent_) sent_ = std::make_unique<Sent>();                            // (its connection is made at the first send)
  sent_->path = path;
  sent_->first_piece = first_piece;
  sent_->later = true;
}

void OpenAhead::send(const std::string& path, std::size_t first_piece) {
  send_later(path, first_piece);
  send_now();
}

void OpenAhead::send_now() {
  if (sent_ && sent_->later && !sent_->path.empty()) sent_->send();
}

// Not in the anonymous namespace: OpenAhead names it a friend.
class ObjectBlob final : public Blob {
 public:
  ObjectBlob(const std::string& url, s3::Url where, std::uint64_t size, std::vector<std::byte> first, OpenAhead* ahead)
      : Blob(url, size), url_(std::move(where)), first_(std::move(first)), next_open_(ahead) {}
  bool remote() const noexcept override { return true; }
  // Reads are sequential more often than not (a tar stream, an index of headers): the two pieces
  // after this one are requested before this one is returned, and arrive while it is parsed (two,
  // so that one request's first-byte wait and transfer overlap the other's: a reader that parses
  // faster than one connection delivers still finds its next piece here).
  // With the on-disk cache (cache.h), each piece is looked up there first and stored after.
  std::size_t read_at(std::uint64_t offset, std::byte* dst, std::size_t n) const override {
    if (offset >= size_) return 0;
    n = static_cast<std::size_t>(std::min<std::uint64_t>(n, size_ - offset));
    const bool caching = cache::enabled();
    if (offset + n <= first_.size()) {  // the piece that came with the open
      std::memcpy(dst, first_.data() + offset, n);
      if (offset + n == first_.size()) std::vector<std::byte>().swap(first_);  // read through: its memory goes
    } else if (!caching || !cache::load(cache::range_key(name_, offset, n), dst, n)) {
      bool taken = false;
      if (Ahead* a = find(offset, n)) {
        a->sent = false;
        // While it waits, this object's other pieces and the next object's open keep moving.
        std::array<s3::ReadAhead*, kAhead + 1> others{};
        std::size_t k = 0;
        for (Ahead& o : ahead_)
          if (&o != a && o.sent) others[k++] = &o.read;
        if (s3::ReadAhead* open = next_open_ ? next_open_->in_flight() : nullptr) others[k++] = open;
        taken = a->read.take(offset, n, dst, std::span<s3::ReadAhead* const>(others.data(), k));
      }
      if (!taken) s3::read(url_, offset, n, dst);
      if (caching) cache::store(cache::range_key(name_, offset, n), dst, n);
    }
    // The next kAhead pieces of this size: those not on their way go to slots whose read is not
    // one of them (an idle slot, or a read for bytes no longer wanted, which start() cancels).
    // Pieces inside the first piece (an opening read larger than the reader's pieces) are here.
    std::array<std::pair<std::uint64_t, std::size_t>, kAhead> wanted{};
    std::size_t count = 0;
    std::uint64_t next = offset + n;
    for (; count < kAhead && next < size_;) {
      const auto m = static_cast<std::size_t>(std::min<std::uint64_t>(n, size_ - next));
      if (next + m > first_.size()) wanted[count++] = {next, m};
      next += m;
    }
    const auto wants = [&](const Ahead& a) {
      return std::find(wanted.begin(), wanted.begin() + static_cast<std::ptrdiff_t>(count), std::pair(a.offset, a.n)) !=
             wanted.begin() + static_cast<std::ptrdiff_t>(count);
    };
    for (Ahead& a : ahead_)
      if (a.sent && !wants(a)) {
        a.read.cancel();  // the reader went elsewhere
        a.sent = false;
      }
    for (std::size_t k = 0; k < count; ++k) {
      const auto [at, m] = wanted[k];
      if (find(at, m) || (caching && cache::contains(cache::range_key(name_, at, m)))) continue;
      for (Ahead& a : ahead_)
        if (!a.sent) {
          a.read.start(url_, at, m);
          a.sent = true, a.offset = at, a.n = m;
          break;
        }
    }
    // Every piece to this object's end asked for: an opening read asked for later goes now.
    if (next >= size_ && next_open_) next_open_->send_now();
    return n;
  }
  bool progress() const override {
    bool moving = false;
    for (Ahead& a : ahead_)
      if (a.sent && a.read.progress()) moving = true;
    if (next_open_ && next_open_->progress()) moving = true;
    return moving;
  }

 private:
  static constexpr std::size_t kAhead = 2;  // pieces requested ahead of the reader (4 measured no better)
  struct Ahead {
    s3::ReadAhead read;
    bool sent = false;  // a read of (offset, n) is on its way or arrived, not yet taken
    std::uint64_t offset = 0;
    std::size_t n = 0;
  };
  Ahead* find(std::uint64_t offset, std::size_t n) const {
    for (Ahead& a : ahead_)
      if (a.sent && a.offset == offset && a.n == n) return &a;
    return nullptr;
  }
  s3::Url url_;
  mutable std::vector<std::byte> first_;  // bytes [0, first_.size()) read with the open
  mutable std::array<Ahead, kAhead> ahead_;
  OpenAhead* next_open_;  // the reader's, for the object it opens next (or null): moved along while this one's reads wait
};

// The whole object at `url`, from the on-disk cache when it holds it.
static void get_object(const std::string& url, std::vector<std::byte>& out) {
  const bool caching = cache::enabled();
  if (caching && cache::load(cache::whole_key(url), out)) return;
  s3::get(s3::parse(url), out);
  if (caching && !out.empty()) cache::store(cache::whole_key(url), out.data(), out.size());
}

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path) {
  if (is_remote(path)) {
    std::shared_ptr<MappedFile> m(new MappedFile(path));
    get_object(path, m->owned_);
    if (m->owned_.empty()) throw DataError(path, DataError::kNoOffset, "is empty (0 bytes)");
    m->data_ = m->owned_.data();
    m->size_ = m->owned_.size();
    return m;
  }
  Fd f;
  const std::size_t size = open_regular(path, f);
  // Private and writable: a Tensor over the mapping may be written (copy on write) without
  // touching the file or faulting. No reserve: a private writable mapping is otherwise charged
  // in full against the machine's commit limit, and Linux's default heuristic refuses one larger
  // than memory and swap (a 2 TB token file on any machine); only a page written is ever copied.
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, f.fd, 0);
  if (p == MAP_FAILED) throw_errno(path, "cannot map");
  return std::shared_ptr<const MappedFile>(new MappedFile(path, static_cast<const std::byte*>(p), size));
}

MappedFile::~MappedFile() {
  if (owned_.empty() && data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

// Reads up to `size` bytes at `offset` (pread, retried on EINTR and short reads); returns how many
// it got (fewer only at the end of the file). IoError naming `path` on a failed read.
static std::size_t read_at(int fd, const std::string& path, std::uint64_t offset, std::byte* dst, std::size_t size) {
  std::size_t got = 0;
  while (got < size) {
    const ssize_t n = ::pread(fd, dst + got, size - got, static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno(path, "read failed");
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  return got;
}

std::size_t LocalBlob::read_at(std::uint64_t offset, std::byte* dst, std::size_t n) const {
  return loaders::read_at(fd_.fd, name_, offset, dst, n);
}

std::unique_ptr<Blob> Blob::open(const std::string& path) { return open(path, 0); }

std::unique_ptr<Blob> Blob::open(const std::string& path, std::size_t first_piece, OpenAhead* ahead) {
  if (is_remote(path)) {
    s3::Url url = s3::parse(path);
    std::uint64_t size = 0;
    std::vector<std::byte> first;
    const bool caching = cache::enabled();
    if (!caching || !cache::load(cache::size_key(path), reinterpret_cast<std::byte*>(&size), sizeof size)) {
      // The read sent ahead for this object is taken; one for another object is dropped.
      OpenAhead::Sent* const sent = ahead ? ahead->sent_.get() : nullptr;
      const bool mine = sent && sent->path == path && !sent->later && sent->first_piece >= first_piece && first_piece > 0;
      const bool taken = mine && sent->read.take_first(url, sent->first_piece, first, size);
      if (mine)
        sent->path.clear();  // taken: nothing left in flight
      else if (sent)
        sent->clear();
      if (!taken) {
        if (first_piece > 0)
          size = s3::first_piece(url, first_piece, first);
        else
          size = s3::size(url);
      }
      if (caching && size > 0) {
        cache::store(cache::size_key(path), reinterpret_cast<const std::byte*>(&size), sizeof size);
        // In the reader's pieces (an opening read sent ahead may hold several), as its reads look.
        const std::size_t piece = first_piece > 0 ? first_piece : first.size();
        for (std::size_t at = 0; at < first.size(); at += piece) {
          const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(piece, size - at));
          if (at + n <= first.size()) cache::store(cache::range_key(path, at, n), first.data() + at, n);
        }
      }
    }
    if (size == 0) throw DataError(path, DataError::kNoOffset, "is empty (0 bytes)");
    return std::make_unique<ObjectBlob>(path, std::move(url), size, std::move(first), ahead);
  }
  Fd f;
  const std::size_t size = open_regular(path, f);
  return std::make_unique<LocalBlob>(path, std::move(f), size);
}

std::vector<ListedFile> list_prefix(const std::string& dir) {
  s3::Url url = s3::parse(dir);
  if (!url.key.empty() && url.key.back() != '/') url.key += '/';
  const std::string base = "s3://" + url.bucket + "/";
  std::vector<ListedFile> out;
  for (s3::Object& o : s3::list(url.bucket, url.key))
    if (o.key.back() != '/') out.push_back({base + o.key, o.size});  // "folder/" markers are not files
  // Nothing under the prefix: a missing bucket has said so already; say what was looked at.
  if (out.empty()) throw DataError(url.text(), DataError::kNoOffset, "holds no objects (an empty or missing prefix)");
  return out;
}

namespace {

// A worker's prefetched reads: one batch's keys, in the order s3::start holds their transfers;
// replaced by the next batch's.
std::vector<Wanted>& prefetched() {
  thread_local std::vector<Wanted> keys;
  return keys;
}

}  // namespace

void prefetch(const std::vector<Wanted>& wanted) {
  std::vector<Wanted>& keys = prefetched();
  keys.clear();
  std::vector<s3::Want> wants;
  const bool caching = cache::enabled();
  for (const Wanted& w : wanted) {
    if (!is_remote(w.path)) continue;
    if (caching && cache::contains(w.size ? cache::range_key(w.path, w.offset, w.size) : cache::whole_key(w.path)))
      continue;  // the sample's own read takes it from the disk
    s3::Want want;
    try {
      want.url = s3::parse(w.path);
    } catch (const Error&) {
      continue;  // the sample's own read names the bad URL
    }
    want.offset = w.offset;
    want.size = w.size;
    wants.push_back(std::move(want));
    keys.push_back(w);
  }
  s3::start(std::move(wants));
}

bool take_prefetched(const std::string& path, std::uint64_t offset, std::size_t size, std::vector<std::byte>& out) {
  std::vector<Wanted>& keys = prefetched();
  for (std::size_t k = 0; k < keys.size(); ++k) {
    if (keys[k].offset != offset || keys[k].size != size || keys[k].path != path) continue;
    keys[k].path.clear();  // taken (or failed): a second read of the same bytes goes the usual way
    if (!s3::take(k, out)) return false;
    if (cache::enabled() && !out.empty())
      cache::store(size ? cache::range_key(path, offset, size) : cache::whole_key(path), out.data(), out.size());
    return true;
  }
  return false;
}

void read_file(const std::string& path, std::vector<std::byte>& out) {
  if (is_remote(path)) {
    get_object(path, out);
    if (out.empty()) throw DataError(path, DataError::kNoOffset, "is empty (0 bytes)");
    return;
  }
  Fd f;
  const std::size_t size = open_regular(path, f);
  out.resize(size);
  const std::size_t got = read_at(f.fd, path, 0, out.data(), size);
  if (got != size) throw DataError(path, got, "file shrank while being read (" + std::to_string(size) + " bytes expected)");
}

RangeReader::RangeReader(const std::string& path) : path_(path) {
  if (is_remote(path)) return;  // each read is a ranged GET; a missing object fails there
  open_regular(path, fd_);
}

void RangeReader::read(std::uint64_t offset, std::size_t size, std::vector<std::byte>& out) const {
  out.resize(size);
  if (fd_.fd < 0) {
    const bool caching = cache::enabled();
    if (caching && cache::load(cache::range_key(path_, offset, size), out.data(), size)) return;
    s3::read(s3::parse(path_), offset, size, out.data());
    if (caching) cache::store(cache::range_key(path_, offset, size), out.data(), size);
    return;
  }
  if (read_at(fd_.fd, path_, offset, out.data(), size) != size)
    throw DataError(path_, offset,
                    "file ends before the " + std::to_string(size) + " bytes indexed here (it changed after it was indexed?)");
}

bool is_gzip(std::span<const std::byte> b) noexcept {
  return b.size() >= 2 && b[0] == std::byte{0x1f} && b[1] == std::byte{0x8b};
}

struct ByteSource::ZStream {
  z_stream z{};
  bool ended = false;
  ~ZStream() { inflateEnd(&z); }
};

ByteSource::ByteSource(std::span<const std::byte> bytes, std::string name) : bytes_(bytes), name_(std::move(name)) {
  if (!is_gzip(bytes)) return;
  zstream_ = std::make_unique<ZStream>();
  // 16 + MAX_WBITS: expect a gzip header and trailer.
  if (inflateInit2(&zstream_->z, 16 + MAX_WBITS) != Z_OK) {
    zstream_.reset();
    throw Error("zlib: inflateInit2 failed");
  }
  zstream_->z.next_in = reinterpret_cast<Bytef*>(const_cast<std::byte*>(bytes.data()));
  zstream_->z.avail_in = static_cast<uInt>(std::min<std::size_t>(bytes.size(), 1u << 30));
}

ByteSource::~ByteSource() = default;

void ByteSource::fail(const std::string& what) const { throw DataError(name_, offset_, what); }

std::size_t ByteSource::read_some(std::byte* dst, std::size_t n) {
  if (!zstream_) {
    const std::size_t k = std::min(n, bytes_.size() - pos_);
    if (k) std::memcpy(dst, bytes_.data() + pos_, k);
    pos_ += k;
    return k;
  }
  ZStream& zs = *zstream_;
  std::size_t got = 0;
  while (got < n && !zs.ended) {
    // Feed the next slice of input when zlib has consumed what it was given.
    if (zs.z.avail_in == 0) {
      const std::size_t consumed = static_cast<std::size_t>(reinterpret_cast<std::byte*>(zs.z.next_in) - bytes_.data());
      if (consumed >= bytes_.size()) fail("truncated gzip stream (compressed data ends early)");
      zs.z.avail_in = static_cast<uInt>(std::min<std::size_t>(bytes_.size() - consumed, 1u << 30));
    }
    zs.z.next_out = reinterpret_cast<Bytef*>(dst + got);
    zs.z.avail_out = static_cast<uInt>(std::min<std::size_t>(n - got, 1u << 30));
    const uInt before = zs.z.avail_out;
    const int rc = inflate(&zs.z, Z_NO_FLUSH);
    got += before - zs.z.avail_out;
    if (rc == Z_STREAM_END) {
      zs.ended = true;
    } else if (rc == Z_BUF_ERROR) {
      // No progress possible: input exhausted (handled above on the next turn) or output full.
      const std::size_t consumed = static_cast<std::size_t>(reinterpret_cast<std::byte*>(zs.z.next_in) - bytes_.data());
      if (consumed >= bytes_.size()) fail("truncated gzip stream (compressed data ends early)");
    } else if (rc != Z_OK) {
      fail(std::string("corrupt gzip data: ") + (zs.z.msg ? zs.z.msg : "inflate error " + std::to_string(rc)));
    }
  }
  return got;
}

void ByteSource::read_exact(void* dst, std::size_t n, const char* what) {
  const std::uint64_t start = offset_;
  const std::size_t got = read_some(static_cast<std::byte*>(dst), n);
  offset_ += got;
  if (got != n)
    throw DataError(name_, start,
                    std::string("truncated ") + what + ": needed " + std::to_string(n) + " bytes, found " + std::to_string(got));
}

bool ByteSource::at_end() {
  if (!zstream_) return pos_ == bytes_.size();
  std::byte probe;
  if (read_some(&probe, 1) == 1) return false;
  return true;
}

std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const std::string& file, const char* what, std::uint64_t at) {
  if (a != 0 && b > ~std::uint64_t{0} / a) throw DataError(file, at, std::string(what) + " overflows 64 bits");
  return a * b;
}

}  // namespace ferry::loaders
