#include "ferry/loaders/tar.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <atomic>
#include <limits>
#include <mutex>
#include <numeric>
#include <utility>
#include <variant>

#include "ferry/core/distributed.h"
#include "ferry/loaders/image.h"
#include "image_rows.h"
#include "io.h"

namespace ferry {

namespace {
// An object is read in pieces of this size (each read is a request); local files in 1 MiB reads.
constexpr std::size_t kObjectPiece = std::size_t{8} << 20;
// An opening read sent ahead (the next shard's, the next epoch's first): the open's piece and the
// one after, so that a shard's reads start with two pieces in hand and the next asked for (over a
// store's first-byte latency, one piece in hand left the reader waiting at each shard's start),
// and an epoch's first batches are here when it starts (a batch of 64 ImageNet JPEGs is 7-11 MB).
constexpr std::size_t kAheadPiece = 2 * kObjectPiece;
// A local file's member of at least this size is read into its destination without the buffer.
constexpr std::size_t kDirectRead = std::size_t{64} << 10;
}  // namespace

// --- TarReader ----------------------------------------------------------------------------------

struct TarReader::Impl {
  std::string name;
  std::string last_path;
  std::unique_ptr<loaders::Blob> blob;  // a file or an object; null for an archive in memory
  std::uint64_t size = 0;               // archive size in bytes
  std::span<const std::byte> mem;
  std::vector<std::byte> buf;  // read buffer
  std::size_t buf_pos = 0, buf_len = 0;
  std::uint64_t offset = 0;  // bytes consumed
  std::uint64_t next = 0;    // where the blob's next read starts (offset + what the buffer holds)
  bool done = false;

  std::uint64_t remaining() const { return size - offset; }
  [[noreturn]] void fail(std::uint64_t at, const std::string& what) const { throw DataError(name, at, what); }

  // Reads what the blob holds at `next` into dst (at most n); fails when it ends early.
  std::size_t fetch(std::byte* dst, std::size_t n) {
    const std::size_t r = blob->read_at(next, dst, n);
    if (r == 0) fail(offset, "file shrank while being read");
    next += r;
    return r;
  }

  // Refills the read buffer from the blob (the caller has used it up).
  void refill() {
    buf_pos = 0;
    buf_len = fetch(buf.data(), static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), size - next)));
  }

  // Reads up to n bytes; fewer only at the end of the archive.
  std::size_t read(std::byte* dst, std::size_t n) {
    n = static_cast<std::size_t>(std::min<std::uint64_t>(n, remaining()));
    if (!blob) {
      if (n) std::memcpy(dst, mem.data() + offset, n);
      offset += n;
      return n;
    }
    std::size_t got = 0;
    while (got < n) {
      if (buf_pos == buf_len) {
        // A large member (one buffer, or 64 KiB of a local file: an image) is read straight into
        // its destination, not through the buffer.
        if (n - got >= (blob->remote() ? buf.size() : kDirectRead)) {
          const std::size_t r = fetch(dst + got, n - got);
          got += r;
          offset += r;
          continue;
        }
        refill();
      }
      const std::size_t k = std::min(n - got, buf_len - buf_pos);
      std::memcpy(dst + got, buf.data() + buf_pos, k);
      buf_pos += k;
      got += k;
      offset += k;
    }
    return got;
  }
  // Skips n bytes (fewer at the end: lenient about missing padding there). A blob skips through
  // its buffer, and past what would take a whole buffer or more without reading it.
  void skip(std::uint64_t n) {
    n = std::min(n, remaining());
    if (!blob) {
      offset += n;
      return;
    }
    while (n > 0) {
      const std::uint64_t k = std::min<std::uint64_t>(n, buf_len - buf_pos);
      buf_pos += static_cast<std::size_t>(k);
      offset += k;
      n -= k;
      if (n == 0) return;
      if (n >= buf.size()) {
        buf_pos = buf_len = 0;
        offset += n;
        next = offset;
        return;
      }
      refill();
    }
  }
};

namespace {

constexpr std::uint64_t kMaxMeta = 1 << 20;  // long names and pax headers

std::optional<std::uint64_t> parse_number(const std::byte* f, std::size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(f);
  if (p[0] & 0x80) {  // base-256 (GNU), for sizes of 8 GiB and more
    std::uint64_t v = p[0] & 0x3f;
    for (std::size_t i = 1; i < n; ++i) {
      if (v >> 55) return std::nullopt;
      v = (v << 8) | p[i];
    }
    return v;
  }
  std::size_t i = 0;
  while (i < n && (p[i] == ' ' || p[i] == 0)) ++i;
  std::uint64_t v = 0;
  bool any = false;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i, any = true) {
    if (v >> 60) return std::nullopt;
    v = v * 8 + (p[i] - '0');
  }
  for (; i < n; ++i)
    if (p[i] != ' ' && p[i] != 0) return std::nullopt;
  return any ? std::optional<std::uint64_t>(v) : std::optional<std::uint64_t>(0);
}

std::string field_str(const std::byte* f, std::size_t n) {
  const char* c = reinterpret_cast<const char*>(f);
  return std::string(c, strnlen(c, n));
}

// "key" and "field" of a member path, as WebDataset: key = path up to the first dot of the file
// name, field = the rest, lower case. nullopt for names without one (skipped).
std::optional<std::pair<std::string, std::string>> split_key(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  const std::size_t base = slash == std::string::npos ? 0 : slash + 1;
  const std::size_t dot = path.find('.', base);
  if (dot == std::string::npos || dot == base) return std::nullopt;
  std::string field = path.substr(dot + 1);
  std::transform(field.begin(), field.end(), field.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return std::pair{path.substr(0, dot), std::move(field)};
}

// A pax extended header: records "<length> <key>=<value>\n"; keeps path and size.
void parse_pax(const std::string& text, const std::string& name, std::uint64_t at, std::string& path,
               std::optional<std::uint64_t>& size) {
  auto fail = [&](const std::string& what) { throw DataError(name, at, what); };
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t sp = text.find(' ', pos);
    if (sp == std::string::npos) fail("malformed pax header");
    std::size_t len = 0;
    for (std::size_t i = pos; i < sp; ++i) {
      if (text[i] < '0' || text[i] > '9' || len > kMaxMeta) fail("malformed pax header length");
      len = len * 10 + static_cast<std::size_t>(text[i] - '0');
    }
    if (len == 0 || pos + len > text.size() || len <= sp - pos + 1 || text[pos + len - 1] != '\n') fail("malformed pax record");
    const std::string rec = text.substr(sp + 1, pos + len - 1 - (sp + 1));
    const std::size_t eq = rec.find('=');
    if (eq == std::string::npos) fail("malformed pax record (no '=')");
    const std::string key = rec.substr(0, eq), value = rec.substr(eq + 1);
    if (key == "path") path = value;
    if (key == "size") {
      if (value.empty() || value.size() > 19 || value.find_first_not_of("0123456789") != std::string::npos)
        fail("malformed pax size '" + value + "'");
      size = std::stoull(value);
    }
    pos += len;
  }
}

}  // namespace

TarReader::TarReader(const std::string& path) : TarReader(path, nullptr) {}

TarReader::TarReader(const std::string& path, loaders::OpenAhead* ahead) : impl_(std::make_unique<Impl>()) {
  impl_->name = path;
  // DataError: missing, a directory, empty, unreadable. An object is read in larger pieces (each
  // read is a request), the first with the open.
  impl_->blob = loaders::Blob::open(path, kObjectPiece, ahead);
  impl_->size = impl_->blob->size();
  impl_->buf.resize(impl_->blob->remote() ? kObjectPiece : std::size_t{1} << 20);
}

TarReader::TarReader(std::span<const std::byte> bytes, std::string name) : impl_(std::make_unique<Impl>()) {
  impl_->name = std::move(name);
  impl_->mem = bytes;
  impl_->size = bytes.size();
  if (bytes.empty()) throw DataError(impl_->name, DataError::kNoOffset, "is empty (0 bytes)");
}

TarReader::~TarReader() = default;
TarReader::TarReader(TarReader&&) noexcept = default;
TarReader& TarReader::operator=(TarReader&&) noexcept = default;
const std::string& TarReader::name() const noexcept { return impl_->name; }
const std::string& TarReader::last_path() const noexcept { return impl_->last_path; }

std::optional<TarMember> TarReader::next() { return next(true); }

bool TarReader::progress() {
  Impl& r = *impl_;
  if (!r.blob || !r.blob->remote()) return false;
  return r.blob->progress();  // this object's next pieces and the next object's open, on their way
}

std::optional<TarMember> TarReader::next(bool read_data) {
  Impl& r = *impl_;
  progress();
  std::string long_name, pax_path;
  std::optional<std::uint64_t> pax_size;
  while (!r.done) {
    const std::uint64_t at = r.offset;
    r.last_path.clear();
    std::byte h[512];
    const std::size_t n = r.read(h, 512);
    if (n == 0) break;  // no end-of-archive blocks: accepted
    if (n < 512) r.fail(at, "truncated tar header (" + std::to_string(n) + " of 512 bytes)");
    if (std::all_of(h, h + 512, [](std::byte b) { return b == std::byte{0}; })) break;
    // The checksum covers the header with its own field read as spaces.
    const auto stored = parse_number(h + 148, 8);
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < 512; ++i) sum += (i >= 148 && i < 156) ? ' ' : std::to_integer<unsigned>(h[i]);
    if (!stored || *stored != sum)
      r.fail(at, "bad tar header checksum (stored " + (stored ? std::to_string(*stored) : std::string("unreadable")) +
                     ", computed " + std::to_string(sum) + "): not a tar archive, or a damaged one");
    const auto header_size = parse_number(h + 124, 12);
    if (!header_size) r.fail(at, "bad size field in tar header");
    const char type = static_cast<char>(h[156]);
    const bool meta = type == 'L' || type == 'x' || type == 'g';
    const std::uint64_t size = (!meta && pax_size) ? *pax_size : *header_size;
    std::string path = field_str(h, 100);
    if (std::memcmp(h + 257, "ustar", 5) == 0) {
      const std::string prefix = field_str(h + 345, 155);
      if (!prefix.empty()) path = prefix + "/" + path;
    }
    if (!pax_path.empty())
      path = pax_path;
    else if (!long_name.empty())
      path = long_name;
    r.last_path = path;
    if (size > r.remaining())
      r.fail(at, "truncated member '" + path + "': it needs " + std::to_string(size) + " bytes, the archive has " +
                     std::to_string(r.remaining()) + " left");
    const std::uint64_t padding = (512 - size % 512) % 512;
    if (meta) {
      if (size > kMaxMeta) r.fail(at, "tar extended header of " + std::to_string(size) + " bytes is too large");
      std::string text(static_cast<std::size_t>(size), '\0');
      r.read(reinterpret_cast<std::byte*>(text.data()), text.size());
      r.skip(padding);
      if (type == 'L') {
        long_name = text.substr(0, strnlen(text.c_str(), text.size()));
      } else if (type == 'x') {
        parse_pax(text, r.name, at, pax_path, pax_size);
      }
      continue;
    }
    long_name.clear();
    pax_path.clear();
    pax_size.reset();
    if (type == '0' || type == '\0' || type == '7') {
      const std::uint64_t data_at = r.offset;
      if (!read_data) {
        r.skip(size + padding);
        return TarMember{path, {}, at, data_at, size};
      }
      TarMember m{path, std::vector<std::byte>(static_cast<std::size_t>(size)), at, data_at, size};
      r.read(m.data.data(), m.data.size());
      r.skip(padding);
      return m;
    }
    r.skip(size + padding);  // directory, link, device, ...
  }
  r.done = true;
  return std::nullopt;
}

// --- records and shards -------------------------------------------------------------------------

const std::vector<std::byte>& TarRecord::field(const std::string& name) const {
  auto it = fields.find(name);
  if (it != fields.end()) return it->second;
  std::string have;
  for (auto& [k, v] : fields) have += (have.empty() ? "" : ", ") + k;
  throw DataError(shard, offset, "record '" + key + "' has no '" + name + "' field (it has: " + have + ")");
}

// Note [Learned offsets]
// ~~~~~~~~~~~~~~~~~~~~~~
// A loader's stream reads each shard once an epoch on its reader threads and deals the records to
// the workers (Note [One batcher across workers]). On local disk that reading is the epoch's one
// serial part: a worker whose first batch is a few shards on waits for the readers to get there,
// each epoch starts with the workers waiting in turn, and the readers compete with the decoding
// workers for the CPUs. So the first reading of a local shard learns where its records are: for
// each record its key, its first header's offset and each member's field, data offset and size
// (LearnedShard). When the shard has been read to its end without an error and its file stamp
// (device, inode, size, modification and change times) is what it was before the reading, the
// dataset keeps that (TarShards::Held::learned, shared by its copies). A later reading of the
// shard checks the stamp again and, when it holds, deals the records as Dealt boxes that carry no
// bytes: the reader thread does no I/O, the workers have their records at once, and each worker
// reads its own records' members with pread (RangeReader), as the indexed TarImages reads its
// samples. The records, their order, their positions and so the batches are the stream's. A shard
// with an error (a damaged member, a duplicate field) is not learned: it is read as a stream
// again, and fails as it did. Objects in s3:// are always streamed (one ranged GET a record is what
// the stream is there to avoid).

namespace {
// A file's identity and version, as stat() gives them.
struct FileStamp {
  std::uint64_t dev = 0, ino = 0, size = 0;
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};

std::optional<FileStamp> stamp_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  FileStamp f;
  f.dev = static_cast<std::uint64_t>(st.st_dev);
  f.ino = static_cast<std::uint64_t>(st.st_ino);
  f.size = static_cast<std::uint64_t>(st.st_size);
  f.mtime_ns = std::int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  f.ctime_ns = std::int64_t{st.st_ctim.tv_sec} * 1000000000 + st.st_ctim.tv_nsec;
  return f;
}

// Where a local shard's records are (Note [Learned offsets]).
struct LearnedShard {
  struct Member {
    std::uint64_t data_offset = 0, size = 0;
    std::uint32_t field = 0;  // into fields
  };
  struct Record {
    std::uint64_t offset = 0;  // its first member's header
    std::uint64_t key_begin = 0;
    std::uint32_t key_size = 0;
    std::uint32_t members = 0;
    std::uint64_t first_member = 0;
  };
  std::string path;
  FileStamp stamp;
  std::vector<std::string> fields;  // the shard's field names, each once
  std::string keys;                 // the records' keys, one after another
  std::vector<Record> records;
  std::vector<Member> members;

  std::uint32_t field_id(const std::string& name) {
    for (std::size_t i = 0; i < fields.size(); ++i)
      if (fields[i] == name) return static_cast<std::uint32_t>(i);
    fields.push_back(name);
    return static_cast<std::uint32_t>(fields.size() - 1);
  }
};

// What a loader's reader threads deal a worker: a record read, or where a learned one is.
struct Dealt {
  TarRecord record;
  std::shared_ptr<const LearnedShard> learned;  // set: the worker reads record `index` of it
  std::size_t index = 0;
};
}  // namespace

// A lane's record being learned, or a worker's reads of learned records (one file open at a time).
struct TarShards::Stream::Direct {
  TarRecord reused;  // next_reused()'s record, its buffers kept from one record to the next
  bool learning = false;
  std::vector<std::pair<std::string, TarMember>> members;  // the record in hand's (field, offsets; no data)
  std::string path;
  std::unique_ptr<loaders::RangeReader> file;
};

// Opening reads sent for the next epoch, one a worker: sent as a stream's last shard has asked for
// all its pieces, put here by the stream as it ends, moved along by the workers whose streams have
// ended while they wait (Stream::progress), taken by the next epoch's stream of that worker (on
// whichever thread).
struct TarShards::Held {
  std::mutex mu;
  std::map<int, loaders::OpenAhead> by_worker;

  // Local shards' learned record offsets (Note [Learned offsets]), by path.
  std::mutex learned_mu;
  std::map<std::string, std::shared_ptr<const LearnedShard>> learned;
  // The shard's learned offsets when its file is still as they were learned (a changed file's are
  // dropped).
  std::shared_ptr<const LearnedShard> learned_for(const std::string& path) {
    std::shared_ptr<const LearnedShard> known;
    {
      std::lock_guard l(learned_mu);
      auto it = learned.find(path);
      if (it == learned.end()) return nullptr;
      known = it->second;
    }
    if (stamp_of(path) == known->stamp) return known;
    std::lock_guard l(learned_mu);
    auto it = learned.find(path);
    if (it != learned.end() && it->second == known) learned.erase(it);
    return nullptr;
  }
  void learn(std::shared_ptr<const LearnedShard> shard) {
    std::lock_guard l(learned_mu);
    learned[shard->path] = std::move(shard);
  }

  // True while some are on their way (false also when another thread is moving them now).
  bool progress() {
    std::unique_lock l(mu, std::try_to_lock);
    if (!l) return false;
    bool moving = false;
    for (auto& [w, read] : by_worker)
      if (read.progress()) moving = true;
    return moving;
  }
  void put(int worker, loaders::OpenAhead read) {
    std::lock_guard l(mu);
    by_worker[worker] = std::move(read);  // one not taken is dropped (its connection closes)
  }
  loaders::OpenAhead take(int worker) {
    std::lock_guard l(mu);
    auto it = by_worker.find(worker);
    if (it == by_worker.end()) return {};
    loaders::OpenAhead read = std::move(it->second);
    by_worker.erase(it);
    return read;
  }

  // A loader's reading of one epoch (Note [One batcher across workers]), and, for local shards
  // with next_epoch_ahead, the next epoch's: made as the epoch's last shard has been read, its
  // readers' first records in hand when the next epoch opens (each epoch would otherwise start
  // with its workers waiting in turn for the reader to reach their first batch). The loader keeps
  // a Slot (WorkerInfo::loader_share) with the function that makes a reading and the one made ahead.
  struct FeedKey {
    std::uint64_t seed = 0, epoch = 0;
    int workers = 0;
    std::size_t batch = 0;
    bool ahead = false;  // next_epoch_ahead
    bool operator==(const FeedKey&) const = default;
  };
  struct Feed {
    std::unique_ptr<detail::BatchFeed> feed;
    std::shared_ptr<std::atomic<bool>> used;  // a loader reads it: it may make the next one
  };
  struct Slot {
    std::mutex mu;
    std::function<Feed(const FeedKey&)> make;  // set by the loader's first open
    // The loader's cancellation (its StreamShare's, at its destruction): a reading made ahead
    // stops with it; one taken by an epoch also with the epoch's (BatchFeed::stop_with).
    std::shared_ptr<const std::atomic<bool>> loader_cancelled;
    std::optional<FeedKey> ahead_key;
    Feed ahead;
    Feed take(const FeedKey& key) {
      Feed out, stale;
      {
        std::lock_guard l(mu);
        if (ahead.feed && ahead_key == key)
          out = std::move(ahead);
        else
          stale = std::move(ahead);  // another epoch's: dropped outside the lock (its readers joined)
        ahead = {};
        ahead_key.reset();
      }
      return out;
    }
    void put(const FeedKey& key, Feed feed) {
      Feed old;
      {
        std::lock_guard l(mu);
        old = std::move(ahead);
        ahead = std::move(feed);
        ahead_key = key;
      }
    }
  };
};

TarShards::TarShards(std::vector<std::string> shards, TarShardsOptions options)
    : shards_(std::move(shards)), options_(options), held_(std::make_shared<Held>()) {
  if (shards_.empty()) throw Error("TarShards: the shard list is empty");
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size)
    throw Error("TarShards: rank " + std::to_string(options_.rank) + " is not valid for world_size " +
                std::to_string(options_.world_size));
}

std::vector<std::size_t> TarShards::epoch_order(std::uint64_t seed, std::uint64_t epoch) const {
  std::vector<std::size_t> order(shards_.size());
  std::iota(order.begin(), order.end(), 0);
  if (options_.shuffle) {
    Generator g(mix_seed(seed, 0x7a75ULL), epoch);
    for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[g.randint(i)]);
  }
  return order;
}

std::vector<std::size_t> TarShards::assignment(int worker, int num_workers, std::uint64_t seed, std::uint64_t epoch) const {
  if (num_workers < 1 || worker < 0 || worker >= num_workers)
    throw Error("TarShards: worker " + std::to_string(worker) + " of " + std::to_string(num_workers) + " is not valid");
  const std::vector<std::size_t> order = epoch_order(seed, epoch);
  const std::size_t slots = static_cast<std::size_t>(options_.world_size) * static_cast<std::size_t>(num_workers);
  const std::size_t slot =
      static_cast<std::size_t>(options_.rank) * static_cast<std::size_t>(num_workers) + static_cast<std::size_t>(worker);
  std::vector<std::size_t> mine;
  for (std::size_t k = slot; k < order.size(); k += slots) mine.push_back(order[k]);
  return mine;
}

std::vector<std::size_t> TarShards::rank_shards(std::uint64_t seed, std::uint64_t epoch) const {
  const std::vector<std::size_t> order = epoch_order(seed, epoch);
  std::vector<std::size_t> mine;
  for (std::size_t k = static_cast<std::size_t>(options_.rank); k < order.size();
       k += static_cast<std::size_t>(options_.world_size))
    mine.push_back(order[k]);
  return mine;
}

TarShardsOptions TarShardsOptions::for_rank(const DistributedEnv& env) {
  TarShardsOptions o;
  o.rank = static_cast<int>(env.rank);
  o.world_size = static_cast<int>(env.world_size);
  return o;
}

namespace {
// Reader threads of a loader's tar stream (shards read at once), and records each reads ahead at
// most (at least kLaneRecordsMin, else a batch): over s3://, four shards' reads on their way keep
// a 16-worker loader fed at a store's first-byte latency, and a batch ahead is what a worker asks
// for at once.
constexpr std::size_t kLanes = 4;
constexpr std::size_t kLaneRecordsMin = 16;
// Where a loader's stream keeps the next epoch's opening read in Held (a worker's own streams use
// their worker ids).
constexpr int kFeedHeld = -1;
}  // namespace

TarShards::Stream TarShards::open(const WorkerInfo& worker) const {
  Stream s;
  if (worker.share && worker.batch_size > 0) {
    if (worker.num_workers < 1 || worker.id < 0 || worker.id >= worker.num_workers)
      throw Error("TarShards: worker " + std::to_string(worker.id) + " of " + std::to_string(worker.num_workers) +
                  " is not valid");
    const Held::FeedKey key{worker.seed, worker.epoch, worker.num_workers, worker.batch_size, worker.next_epoch_ahead};
    // The loader's slot (one a loader; a stream opened with no loader_share makes its own).
    const std::shared_ptr<Held::Slot> slot =
        worker.loader_share ? worker.loader_share->get<Held::Slot>(this,
                                                                   [&] {
                                                                     auto made = std::make_unique<Held::Slot>();
                                                                     made->loader_cancelled = worker.loader_share->cancelled();
                                                                     return made;
                                                                   })
                            : std::make_shared<Held::Slot>();
    s.feed_ = worker.share->get<detail::BatchFeed>(this, [&] {
      {
        std::lock_guard l(slot->mu);
        // What makes a loader's reading of an epoch: a function of the epoch's key, over a copy of
        // the shard list (no reference to this dataset, nor to the slot that keeps a reading made
        // ahead: no cycle).
        if (!slot->make) {
          const auto plain = std::make_shared<const TarShards>(shards_, options_);  // rank_shards() of these shards
          const std::weak_ptr<Held::Slot> weak_slot = slot;
          const std::shared_ptr<Held> held_open = held_;  // the next epoch's opening read over s3://
          slot->make = [plain, weak_slot, held_open](const Held::FeedKey& key) -> Held::Feed {
            auto paths = std::make_shared<std::vector<std::string>>();
            for (std::size_t k : plain->rank_shards(key.seed, key.epoch)) paths->push_back(plain->shards()[k]);
            detail::BatchFeed::Shape shape;
            shape.units = paths->size();
            shape.lanes = kLanes;
            shape.lane_records = std::max(key.batch, kLaneRecordsMin);
            shape.batch_size = key.batch;
            const std::size_t lanes = std::min(kLanes, std::max<std::size_t>(paths->size(), 1));
            const bool remote = !paths->empty() && loaders::is_remote(paths->front());
            // Over s3://, with next_epoch_ahead: the last shard's reader sends the next epoch's first
            // shard's opening read once it has asked for all its pieces and keeps it in Held, where the
            // next epoch's reader of its first shard takes it (Stream::advance, as a worker's stream).
            // Local shards: the next epoch's reading itself starts as this one's last shard is read.
            std::string next_first;
            if (key.ahead && remote) {
              const std::vector<std::size_t> next = plain->rank_shards(key.seed, key.epoch + 1);
              if (!next.empty()) next_first = plain->shards()[next.front()];
            }
            std::shared_ptr<Held> held = key.ahead && remote ? held_open : nullptr;
            auto used = std::make_shared<std::atomic<bool>>(false);
            std::weak_ptr<Held::Slot> ahead_to = key.ahead && !remote ? weak_slot : std::weak_ptr<Held::Slot>();
            // Local shards: learned as they are read, then dealt from what was learned (Note [Learned offsets]).
            std::shared_ptr<Held> learn = remote ? nullptr : held_open;
            // Each lane's opening read of its next shard (lane l reads units l, l + lanes, ...,
            // on its own thread).
            auto lane_ahead = std::make_shared<std::vector<std::shared_ptr<loaders::OpenAhead>>>();
            for (std::size_t l = 0; l < lanes; ++l) lane_ahead->push_back(std::make_shared<loaders::OpenAhead>());
            std::shared_ptr<const std::atomic<bool>> loader_cancelled;
            if (const std::shared_ptr<Held::Slot> owner = weak_slot.lock()) loader_cancelled = owner->loader_cancelled;
            auto feed = std::make_unique<detail::BatchFeed>(
                shape,
                [paths, lanes, next_first, held, used, ahead_to, key, learn, lane_ahead](std::size_t unit,
                                                                                         detail::BatchFeed::Sink& sink) {
                  const std::string& path = (*paths)[unit];
                  if (std::shared_ptr<const LearnedShard> known = learn ? learn->learned_for(path) : nullptr) {
                    for (std::size_t i = 0; i < known->records.size(); ++i) {
                      auto d = std::make_shared<Dealt>();
                      d->learned = known;
                      d->index = i;
                      if (!sink.push(std::move(d))) return;
                    }
                  } else {
                    // One shard a Stream; the lane's next shard's opening read goes out once this one is open.
                    Stream one;
                    one.shards_.push_back(path);
                    one.ahead_ = (*lane_ahead)[unit % lanes];
                    if (held && (unit == 0 || unit + 1 == paths->size())) {
                      one.held_ = held;
                      one.worker_ = kFeedHeld;
                      if (unit + 1 == paths->size()) one.next_first_ = next_first;
                    }
                    std::shared_ptr<LearnedShard> learning;
                    if (learn)
                      if (std::optional<FileStamp> stamp = stamp_of(path)) {
                        learning = std::make_shared<LearnedShard>();
                        learning->path = path;
                        learning->stamp = *stamp;
                        one.direct_ = std::make_shared<Stream::Direct>();
                        one.direct_->learning = true;
                      }
                    sink.on_wait = [&one] { return one.progress(); };
                    bool opened = false;
                    for (;;) {
                      std::optional<TarRecord> r;
                      std::exception_ptr failed;
                      if (learning) one.direct_->members.clear();
                      try {
                        r = one.next();
                      } catch (...) {
                        failed = std::current_exception();
                      }
                      // Handed over outside the handler: the worker that takes it holds its only
                      // reference (the exception's last owner is the thread that reads it).
                      if (failed) {
                        learning.reset();  // a shard with an error is read as a stream again
                        if (!sink.fail(std::move(failed))) return;
                        continue;
                      }
                      if (!opened && unit + lanes < paths->size()) one.ahead_->send((*paths)[unit + lanes], kAheadPiece);
                      opened = true;
                      if (!r) break;
                      if (learning) {
                        LearnedShard::Record rec;
                        rec.offset = r->offset;
                        rec.key_begin = learning->keys.size();
                        rec.key_size = static_cast<std::uint32_t>(r->key.size());
                        rec.first_member = learning->members.size();
                        rec.members = static_cast<std::uint32_t>(one.direct_->members.size());
                        learning->keys += r->key;
                        for (auto& [field, m] : one.direct_->members)
                          learning->members.push_back({m.data_offset, m.size, learning->field_id(field)});
                        learning->records.push_back(rec);
                      }
                      auto d = std::make_shared<Dealt>();
                      d->record = std::move(*r);
                      if (!sink.push(std::move(d))) return;
                    }
                    if (learning && stamp_of(path) == learning->stamp) {
                      learning->keys.shrink_to_fit();
                      learning->records.shrink_to_fit();
                      learning->members.shrink_to_fit();
                      learn->learn(std::move(learning));
                    }
                  }
                  // The epoch's last shard read (local shards, next_epoch_ahead): the next epoch's reading
                  // starts, for the loader's next open to take. Only from a reading a loader uses (one
                  // made ahead and never taken makes no other).
                  if (unit + 1 == paths->size() && used->load())
                    if (std::shared_ptr<Held::Slot> to = ahead_to.lock()) {
                      std::function<Held::Feed(const Held::FeedKey&)> make_next;
                      {
                        std::lock_guard l(to->mu);
                        make_next = to->make;
                      }
                      if (make_next) {
                        Held::FeedKey next = key;
                        ++next.epoch;
                        to->put(next, make_next(next));
                      }
                    }
                },
                loader_cancelled);
            return Held::Feed{std::move(feed), std::move(used)};
          };
        }
      }
      Held::Feed f = slot->take(key);
      if (!f.feed) f = slot->make(key);
      f.feed->stop_with(worker.share->cancelled());  // the epoch's end stops its readers
      f.used->store(true);
      return std::move(f.feed);
    });
    s.worker_ = worker.id;
    if (worker.next_epoch_ahead) s.held_ = held_;  // moved along by the idle workers between epochs
    return s;
  }
  for (std::size_t k : assignment(worker.id, worker.num_workers, worker.seed, worker.epoch)) s.shards_.push_back(shards_[k]);
  s.ahead_ = std::make_shared<loaders::OpenAhead>();
  if (worker.next_epoch_ahead && !s.shards_.empty() && loaders::is_remote(s.shards_.front())) {
    s.held_ = held_;
    s.worker_ = worker.id;
    const std::vector<std::size_t> next = assignment(worker.id, worker.num_workers, worker.seed, worker.epoch + 1);
    if (!next.empty()) s.next_first_ = shards_[next.front()];
  }
  return s;
}

std::optional<TarRecord> TarShards::Stream::next() {
  if (!feed_) return advance(true);
  std::shared_ptr<void> box = feed_->next(batch_, position_);
  if (!box) return std::nullopt;
  Dealt& dealt = *static_cast<Dealt*>(box.get());
  if (!dealt.learned) return std::optional<TarRecord>(std::move(dealt.record));
  TarRecord rec;
  read_learned(box.get(), rec);
  return rec;
}

const TarRecord* TarShards::Stream::next_reused() {
  if (!direct_) direct_ = std::make_shared<Direct>();
  TarRecord& out = direct_->reused;
  if (!feed_) {
    std::optional<TarRecord> r = advance(true);
    if (!r) return nullptr;
    out = std::move(*r);
    return &out;
  }
  std::shared_ptr<void> box = feed_->next(batch_, position_);
  if (!box) return nullptr;
  Dealt& dealt = *static_cast<Dealt*>(box.get());
  if (!dealt.learned) {
    out = std::move(dealt.record);
    return &out;
  }
  read_learned(box.get(), out);
  return &out;
}

// A learned record's members read into `rec` on the worker's thread (Note [Learned offsets]);
// rec's buffers are reused (next_reused) and fields this record lacks are dropped.
void TarShards::Stream::read_learned(const void* dealt_box, TarRecord& rec) {
  const Dealt& dealt = *static_cast<const Dealt*>(dealt_box);
  const LearnedShard& shard = *dealt.learned;
  const LearnedShard::Record& at = shard.records[dealt.index];
  if (!direct_) direct_ = std::make_shared<Direct>();
  if (!direct_->file || direct_->path != shard.path) {
    direct_->file.reset();
    direct_->path.clear();
    // The stamp was checked as the epoch's records were dealt; a reading made ahead for the next
    // epoch deals them early, so a file changed since then is an error here, not stale bytes (the
    // next epoch, finding the new stamp, reads the shard as a stream).
    if (stamp_of(shard.path) != shard.stamp)
      throw DataError(shard.path, at.offset,
                      "the shard changed after its records were dealt from the offsets learned when it was first read "
                      "(a shard rewritten while the loader reads it, or just before an epoch made ahead); the next "
                      "epoch reads it anew");
    direct_->file = std::make_unique<loaders::RangeReader>(shard.path);
    direct_->path = shard.path;
  }
  rec.key.assign(shard.keys, static_cast<std::size_t>(at.key_begin), at.key_size);
  if (rec.shard != shard.path) rec.shard = shard.path;
  rec.offset = at.offset;
  const auto members = std::span(shard.members).subspan(static_cast<std::size_t>(at.first_member), at.members);
  std::erase_if(rec.fields, [&](const auto& field) {
    return std::none_of(members.begin(), members.end(),
                        [&](const LearnedShard::Member& m) { return shard.fields[m.field] == field.first; });
  });
  for (const LearnedShard::Member& m : members)
    direct_->file->read(m.data_offset, static_cast<std::size_t>(m.size), rec.fields[shard.fields[m.field]]);
}

std::size_t TarShards::learned_shards() const {
  std::lock_guard l(held_->learned_mu);
  return held_->learned.size();
}

std::optional<std::uint64_t> TarShards::Stream::position() const {
  if (!feed_) return std::nullopt;
  return position_;
}

bool TarShards::Stream::progress() {
  if (feed_) return held_ && held_->progress();  // the reader threads move their own reads along
  bool moving = reader_ && reader_->progress();
  if (held_ && held_->progress()) moving = true;
  return moving;
}

std::size_t TarShards::Stream::skip(std::size_t n) {
  if (feed_) {
    feed_->skip(n);
    return n;
  }
  // Headers only (the members' data seeked past), except the last record: reading it finds the
  // next record's first member, which must keep its data.
  std::size_t k = 0;
  while (k < n && advance(k + 1 == n)) ++k;
  return k;
}

std::optional<TarRecord> TarShards::Stream::advance(bool read_data) {
  if (deferred_) std::rethrow_exception(std::exchange(deferred_, nullptr));
  if (!started_) {
    started_ = true;
    // The opening read the last epoch's stream of this worker sent for this one, made this
    // thread's for the first shard's open (dropped when it is for another shard).
    if (held_ && !shards_.empty()) {
      loaders::OpenAhead read = held_->take(worker_);
      if (read.path() == shards_.front()) *ahead_ = std::move(read);
    }
  }
  while (current_ < shards_.size()) {
    try {
      if (!reader_) {
        reader_.emplace(TarReader(shards_[current_], ahead_.get()));
        // The next shard's opening read goes out now, and arrives while this one is parsed; from
        // the last shard, the next epoch's first shard's, once this one's pieces are all asked for.
        if (current_ + 1 < shards_.size())
          ahead_->send(shards_[current_ + 1], kAheadPiece);
        else if (!next_first_.empty())
          ahead_->send_later(next_first_, kAheadPiece);
      }
      std::optional<TarMember> first = pending_ ? std::move(pending_) : reader_->next(read_data);
      pending_.reset();
      std::optional<std::pair<std::string, std::string>> kf;
      while (first && !(kf = split_key(first->path))) first = reader_->next(read_data);  // skip members without a field
      if (!first) {
        reader_.reset();
        ++current_;
        continue;
      }
      TarRecord rec{kf->first, shards_[current_], first->offset, {}};
      if (direct_ && direct_->learning)
        direct_->members.emplace_back(kf->second, TarMember{{}, {}, 0, first->data_offset, first->size});
      rec.fields.emplace(kf->second, std::move(first->data));
      while (true) {
        std::optional<TarMember> m;
        try {
          m = reader_->next(read_data);
        } catch (...) {
          // A damaged member of another record: the record in hand is complete, so deliver it and
          // raise the error on the next call (a damaged member costs its own record, and the rest
          // of a shard that cannot be parsed). A damaged header names no member: the record in
          // hand may be incomplete, so it fails with the error.
          const auto damaged = split_key(reader_->last_path());
          if (!damaged || damaged->first == rec.key) throw;
          deferred_ = std::current_exception();
          reader_.reset();
          ++current_;
          return rec;
        }
        if (!m) {
          reader_.reset();
          ++current_;
          return rec;
        }
        auto mk = split_key(m->path);
        if (!mk) continue;
        if (mk->first != rec.key) {
          pending_ = std::move(m);
          return rec;
        }
        if (direct_ && direct_->learning)
          direct_->members.emplace_back(mk->second, TarMember{{}, {}, 0, m->data_offset, m->size});
        if (!rec.fields.emplace(mk->second, std::move(m->data)).second)
          throw DataError(rec.shard, m->offset, "record '" + rec.key + "' has two '" + mk->second + "' members");
      }
    } catch (...) {
      // A damaged shard ends here; the next call goes on with the next shard.
      reader_.reset();
      pending_.reset();
      ++current_;
      throw;
    }
  }
  // The stream's end: the next epoch's first opening read, held for the next epoch's stream.
  if (!next_first_.empty()) {
    loaders::OpenAhead read;  // none when the read was not sent (one held before is dropped)
    if (ahead_->path() == next_first_) {
      ahead_->send_now();
      read = std::move(*ahead_);
    }
    held_->put(worker_, std::move(read));
    next_first_.clear();
  }
  return std::nullopt;
}

namespace {
// A label field's text as a class index, or what is wrong with it (the message of the DataError
// that names the shard and the record).
std::variant<std::int64_t, std::string> class_index(std::span<const std::byte> bytes, const std::string& key,
                                                    const std::string& field) {
  std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.erase(0, 1);
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos)
    return "record '" + key + "': the '" + field + "' field is not a non-negative integer: '" + text.substr(0, 40) + "'";
  return std::stoll(text);
}

std::int64_t parse_label(std::span<const std::byte> bytes, const std::string& shard, std::uint64_t offset, const std::string& key,
                         const std::string& field) {
  auto label = class_index(bytes, key, field);
  if (const std::string* why = std::get_if<std::string>(&label)) throw DataError(shard, offset, *why);
  return std::get<std::int64_t>(label);
}
}  // namespace

namespace {
// A record's image bytes, label and name (for errors), as decode_labeled_image reads them.
struct RecordImage {
  const std::vector<std::byte>* bytes = nullptr;
  std::int64_t label = 0;
  std::string name;
};
RecordImage record_image(const TarRecord& record, const TarRecordDecodeOptions& options) {
  RecordImage out;
  std::string field;
  for (const std::string& f : options.image_fields) {
    auto it = record.fields.find(f);
    if (it != record.fields.end()) {
      out.bytes = &it->second;
      field = f;
      break;
    }
  }
  if (!out.bytes)
    record.field(options.image_fields.empty() ? std::string("image")
                                              : options.image_fields.front());  // throws, naming the fields
  out.label = parse_label(record.field(options.label_field), record.shard, record.offset, record.key, options.label_field);
  out.name = record.shard + ": " + record.key + "." + field;
  return out;
}
// A stream's decode settings as the image rows' (CPU decode, decode_labeled_image's pixel limit).
loaders::ImageRows image_rows(const TarRecordDecodeOptions& o) {
  return {o.transform, o.channels, std::int64_t{1} << 28, o.dct_scaling, false, 0};
}
}  // namespace

TarDecodeStream::TarDecodeStream(TarShards shards, TarRecordDecodeOptions options)
    : shards_(std::move(shards)), options_(std::move(options)) {}

SampleContext TarDecodeStream::Stream::context() {
  // As a mapped stream's (MappedIterable): the record's epoch position in a loader, else this
  // worker's own count offset by its id.
  const std::optional<std::uint64_t> at = inner_.position();
  const std::size_t local = (static_cast<std::size_t>(worker_.id) << 40) + local_++;
  return SampleContext(at ? static_cast<std::size_t>(*at) : local, worker_.seed, worker_.epoch, worker_);
}

std::optional<LabeledSample> TarDecodeStream::Stream::next() {
  std::optional<TarRecord> r = inner_.next();
  if (!r) return std::nullopt;
  SampleContext ctx = context();
  return decode_labeled_image(*r, owner_->options_, ctx.rng());
}

bool TarDecodeStream::Stream::next_into(LabeledBatch& batch, std::size_t row) {
  const TarRecord* r = inner_.next_reused();  // read into this worker's buffers (decoded, then reused)
  if (!r) return false;
  SampleContext ctx = context();
  const RecordImage image = record_image(*r, owner_->options_);
  loaders::image_row_into(image_rows(owner_->options_), *image.bytes, image.name, image.label, batch, row, ctx);
  return true;
}

LabeledBatch TarDecodeStream::make_batch(std::size_t n, BatchAllocator& allocator) const {
  return loaders::image_batch(image_rows(options_), n, allocator, "TarDecodeStream");
}

LabeledSample decode_labeled_image(const TarRecord& record, const TarRecordDecodeOptions& options, Generator& rng) {
  const RecordImage r = record_image(record, options);
  const std::vector<std::byte>* image = r.bytes;
  const std::int64_t label = r.label;
  const std::string& name = r.name;
  const DecodeOptions decode{options.channels, std::int64_t{1} << 28, options.dct_scaling};
  if (std::optional<Shape> shape =
          options.transform.empty() ? std::nullopt : options.transform.fixed_output_shape(options.channels)) {
    Tensor out = Tensor::empty(options.transform.output_dtype(DType::UInt8), std::move(*shape));
    decode_transformed_into(*image, name, options.transform, rng, out, decode);  // only the crop is decoded
    return {std::move(out), label};
  }
  Tensor img = decode_image(*image, name, decode);
  if (!options.transform.empty()) img = options.transform(img, rng);
  return {std::move(img), label};
}

EncodedImage encode_labeled_image(TarRecord record, const TarRecordDecodeOptions& options, Generator& rng) {
  loaders::check_gpu_decode("encode_labeled_image", options.channels, options.transform);
  auto image = record.fields.end();
  for (const std::string& f : options.image_fields)
    if ((image = record.fields.find(f)) != record.fields.end()) break;
  if (image == record.fields.end())
    record.field(options.image_fields.empty() ? std::string("image")
                                              : options.image_fields.front());  // throws, naming the fields
  EncodedImage out;
  out.label = parse_label(record.field(options.label_field), record.shard, record.offset, record.key, options.label_field);
  out.plan = plan_jpeg(image->second, record.shard + ": " + record.key + "." + image->first, options.transform, rng);
  out.bytes = std::move(image->second);
  return out;
}

// --- shard patterns -------------------------------------------------------------------------------

std::vector<std::string> expand_braces(const std::string& pattern) {
  constexpr std::size_t kMaxNames = 1'000'000;
  const auto bad = [&](const std::string& what) { return Error("shard pattern '" + pattern + "': " + what); };
  const std::size_t open = pattern.find('{');
  if (open == std::string::npos) {
    if (pattern.find('}') != std::string::npos) throw bad("a '}' without its '{'");
    return {pattern};
  }
  const std::size_t close = pattern.find('}', open);
  if (close == std::string::npos) throw bad("a '{' without its '}'");
  const std::string body = pattern.substr(open + 1, close - open - 1);
  if (body.find('{') != std::string::npos) throw bad("nested braces are not supported");
  std::vector<std::string> alternatives;
  if (const std::size_t dots = body.find(".."); dots != std::string::npos) {
    const std::string a = body.substr(0, dots), b = body.substr(dots + 2);
    const auto number = [&](const std::string& t) {
      if (t.empty() || t.size() > 18 || t.find_first_not_of("0123456789") != std::string::npos)
        throw bad("the range {" + body + "} is not {first..last} of decimal numbers");
      return std::stoll(t);
    };
    const long long x = number(a), y = number(b);
    const std::size_t width = (a.size() > 1 && a[0] == '0') || (b.size() > 1 && b[0] == '0') ? std::max(a.size(), b.size()) : 0;
    const long long step = x <= y ? 1 : -1;
    if (static_cast<unsigned long long>(std::llabs(y - x)) + 1 > kMaxNames) throw bad("more than 1000000 names");
    for (long long v = x;; v += step) {
      std::string t = std::to_string(v);
      if (t.size() < width) t.insert(0, width - t.size(), '0');
      alternatives.push_back(std::move(t));
      if (v == y) break;
    }
  } else {
    std::size_t start = 0;
    for (;;) {
      const std::size_t comma = std::min(body.find(',', start), body.size());
      alternatives.push_back(body.substr(start, comma - start));
      if (comma == body.size()) break;
      start = comma + 1;
    }
    if (body.empty()) throw bad("an empty {}");
  }
  const std::vector<std::string> tails = expand_braces(pattern.substr(close + 1));
  if (alternatives.size() * tails.size() > kMaxNames) throw bad("more than 1000000 names");
  std::vector<std::string> out;
  out.reserve(alternatives.size() * tails.size());
  const std::string head = pattern.substr(0, open);
  if (head.find('}') != std::string::npos) throw bad("a '}' without its '{'");
  for (const std::string& alt : alternatives)
    for (const std::string& tail : tails) out.push_back(head + alt + tail);
  return out;
}

// --- indexed shards -------------------------------------------------------------------------------

TarImages::TarImages(std::vector<std::string> shards, TarImagesOptions options) : options_(std::move(options)) {
  auto index = std::make_shared<Index>();
  index->shards = std::move(shards);
  const std::vector<std::string>& paths = index->shards;
  std::vector<Record>& records = index->records;
  if (paths.empty()) throw Error("TarImages: the shard list is empty");
  if (paths.size() > std::numeric_limits<std::uint32_t>::max()) throw Error("TarImages: too many shards");
  if (options_.image_fields.empty()) throw Error("TarImages: image_fields is empty");
  if (decodes_on_device()) loaders::check_gpu_decode("TarImages", options_.channels, options_.transform);
  std::vector<std::byte> label;
  loaders::OpenAhead ahead;  // the next shard's opening read, sent while this one's headers are read
  for (std::size_t s = 0; s < paths.size(); ++s) {
    TarReader reader(paths[s], &ahead);
    if (s + 1 < paths.size()) ahead.send(paths[s + 1], kObjectPiece);
    const loaders::RangeReader file(paths[s]);  // the labels: read and parsed here, once
    Record* rec = nullptr;
    while (std::optional<TarMember> m = reader.next(false)) {  // headers only: the data is seeked past
      const auto kf = split_key(m->path);
      if (!kf) continue;
      if (!rec || rec->key != kf->first) {
        records.push_back(Record{kf->first, static_cast<std::uint32_t>(s), -1, m->offset, 0, 0, Record::kNoLabel});
        rec = &records.back();
      }
      const auto field = std::find(options_.image_fields.begin(), options_.image_fields.end(), kf->second);
      if (field != options_.image_fields.end()) {
        const auto k = static_cast<std::int32_t>(field - options_.image_fields.begin());
        if (rec->image_field < 0 || k < rec->image_field) {  // the first listed field present wins
          rec->image_field = k;
          rec->image_offset = m->data_offset;
          rec->image_size = m->size;
        }
      } else if (kf->second == options_.label_field) {
        // A bad label is the DataError of its own sample, not of the dataset: kept for then.
        const std::size_t at = records.size() - 1;
        index->label_errors.erase(at);
        rec->label = Record::kBadLabel;
        if (m->size > 64) {
          index->label_errors[at] = "record '" + rec->key + "': the '" + options_.label_field + "' field has " +
                                    std::to_string(m->size) + " bytes; a class index has at most 18 digits";
          continue;
        }
        file.read(m->data_offset, static_cast<std::size_t>(m->size), label);
        auto value = class_index(label, rec->key, options_.label_field);
        if (std::string* why = std::get_if<std::string>(&value))
          index->label_errors[at] = std::move(*why);
        else
          rec->label = std::get<std::int64_t>(value);
      }
    }
  }
  if (records.empty()) throw DataError(paths.front(), DataError::kNoOffset, "TarImages: the shards hold no records");
  std::size_t largest = 0;
  for (const Record& r : records) {
    if (r.image_size > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
      throw DataError(paths[r.shard], r.image_offset,
                      "record '" + r.key + "': an image of " + std::to_string(r.image_size) + " bytes");
    if (r.image_field >= 0) largest = std::max<std::size_t>(largest, static_cast<std::size_t>(r.image_size));
  }
  slot_ = loaders::encoded_slot(largest);
  records.shrink_to_fit();
  index_ = std::move(index);
}

struct TarImages::Rows : loaders::ImageRows {};
TarImages::Rows TarImages::rows() const {
  return {{options_.transform, options_.channels, options_.max_pixels, options_.dct_scaling, decodes_on_device(), slot_}};
}

// Sample i's image bytes (in the thread's scratch), name for errors and label.
struct TarImages::Read {
  std::span<const std::byte> bytes;
  std::string name;
  std::int64_t label = 0;
};

TarImages::Read TarImages::read(std::size_t i) const {
  const Record& r = index_->records.at(i);
  const std::string& shard = index_->shards[r.shard];
  if (r.image_field < 0) {
    std::string wanted;
    for (const std::string& f : options_.image_fields) wanted += (wanted.empty() ? "" : ", ") + f;
    throw DataError(shard, r.offset, "record '" + r.key + "' has no image field (looked for: " + wanted + ")");
  }
  if (r.label == Record::kNoLabel)
    throw DataError(shard, r.offset, "record '" + r.key + "' has no '" + options_.label_field + "' field");
  if (r.label == Record::kBadLabel) throw DataError(shard, r.offset, index_->label_errors.at(i));
  std::vector<std::byte>& bytes = loaders::file_scratch();
  if (!loaders::is_remote(shard) ||
      !loaders::take_prefetched(shard, r.image_offset, static_cast<std::size_t>(r.image_size), bytes))
    loaders::RangeReader(shard).read(r.image_offset, static_cast<std::size_t>(r.image_size), bytes);
  return {bytes, shard + ": " + r.key + "." + options_.image_fields[static_cast<std::size_t>(r.image_field)], r.label};
}

void TarImages::prefetch(std::span<const std::size_t> indices) const {
  std::vector<loaders::Wanted> wanted;
  for (const std::size_t i : indices) {
    if (i >= index_->records.size()) continue;
    const Record& r = index_->records[i];
    const std::string& shard = index_->shards[r.shard];
    if (r.image_field >= 0 && r.image_size > 0 && loaders::is_remote(shard))
      wanted.push_back({shard, r.image_offset, static_cast<std::size_t>(r.image_size)});
  }
  if (!wanted.empty()) loaders::prefetch(wanted);
}

LabeledSample TarImages::get(std::size_t i, SampleContext& ctx) const {
  const Read r = read(i);
  return loaders::image_sample(rows(), r.bytes, r.name, r.label, ctx);
}

LabeledBatch TarImages::make_batch(std::size_t n, BatchAllocator& allocator) const {
  return loaders::image_batch(rows(), n, allocator, "TarImages");
}

void TarImages::get_into(std::size_t i, LabeledBatch& batch, std::size_t row, SampleContext& ctx) const {
  const Read r = read(i);
  loaders::image_row_into(rows(), r.bytes, r.name, r.label, batch, row, ctx);
}

}  // namespace ferry
