// The on-disk cache of object-store reads: see cache.h.
#include "cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

#include "ferry/detail/engine.h"
#include "ferry/detail/io_counters.h"
#include "io.h"

namespace ferry::loaders::cache {
namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'F', 'E', 'R', 'R', 'Y', 'C', '1', '\n'};
constexpr std::uint64_t kDefaultLimit = std::uint64_t{16} << 30;
std::atomic<std::uint64_t> g_hits{0}, g_hit_bytes{0};

std::string dir() {
  const char* d = std::getenv("FERRY_S3_CACHE_DIR");
  return d ? std::string(d) : std::string();
}

// FERRY_S3_CACHE_LIMIT: bytes, with an optional K, M, G or T (powers of 1024; "GiB" and "GB" read
// the same).
std::uint64_t limit() {
  const char* v = std::getenv("FERRY_S3_CACHE_LIMIT");
  if (!v || !*v) return kDefaultLimit;
  char* end = nullptr;
  errno = 0;
  const double n = std::strtod(v, &end);
  std::string_view unit(end);
  std::uint64_t scale = 1;
  if (!unit.empty()) {
    switch (unit.front()) {
      case 'K':
      case 'k': scale = std::uint64_t{1} << 10; break;
      case 'M':
      case 'm': scale = std::uint64_t{1} << 20; break;
      case 'G':
      case 'g': scale = std::uint64_t{1} << 30; break;
      case 'T':
      case 't': scale = std::uint64_t{1} << 40; break;
      default: scale = 0;
    }
    unit.remove_prefix(1);
    if (unit != "" && unit != "B" && unit != "iB") scale = 0;
  }
  if (errno || end == v || !(n >= 0) || scale == 0) {
    detail::warn_once("s3-cache-limit", std::string("FERRY_S3_CACHE_LIMIT='") + v +
                                            "' is not a size (bytes, or a number with K, M, G or T); the cache keeps 16 GiB");
    return kDefaultLimit;
  }
  return static_cast<std::uint64_t>(n * static_cast<double>(scale));
}

std::string file_name(const std::string& key) {
  std::uint64_t a = 1469598103934665603ull, b = 0x9e3779b97f4a7c15ull;  // two FNV-1a variants
  for (unsigned char c : key) {
    a = (a ^ c) * 1099511628211ull;
    b = (b ^ c) * 0x100000001b3ull;
    b ^= b >> 31;
  }
  char out[40];
  std::snprintf(out, sizeof out, "%016llx%016llx.fc", static_cast<unsigned long long>(a), static_cast<unsigned long long>(b));
  return out;
}

bool read_all(int fd, void* dst, std::size_t n) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool write_all(int fd, const void* src, std::size_t n) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

// Opens the entry of `key` and checks its header; the payload's size in `size`. -1: a miss (an
// entry whose header does not match is removed).
int open_entry(const std::string& key, std::uint64_t& size) {
  const std::string d = dir();
  if (d.empty()) return -1;
  const std::string path = d + "/" + file_name(key);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char magic[8];
  std::uint32_t key_size = 0;
  std::string stored;
  bool ok = read_all(fd, magic, 8) && std::memcmp(magic, kMagic, 8) == 0 && read_all(fd, &key_size, 4) && key_size == key.size();
  if (ok) {
    stored.resize(key_size);
    ok = read_all(fd, stored.data(), key_size) && stored == key && read_all(fd, &size, 8);
  }
  struct stat st {};
  if (ok) ok = ::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_size) == 8 + 4 + key.size() + 8 + size;
  if (!ok) {
    ::close(fd);
    if (!stored.empty() && stored != key) return -1;  // another key's entry (a hash collision): leave it
    ::unlink(path.c_str());                           // cut short or damaged
    return -1;
  }
  ::futimens(fd, nullptr);  // recently used: evicted last
  return fd;
}

// What one process knows of a cache folder: its bytes, counted once at first use.
struct Folder {
  std::mutex mu;
  bool counted = false;
  std::uint64_t bytes = 0;  // guarded by mu
};

Folder& folder(const std::string& d) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Folder>> folders;
  std::lock_guard lock(mu);
  auto& f = folders[d];
  if (!f) f = std::make_unique<Folder>();
  return *f;
}

// The entries' bytes, and the entries oldest first.
std::uint64_t scan(const std::string& d, std::vector<std::pair<fs::file_time_type, fs::path>>* entries) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() != ".fc") continue;
    std::error_code e2;
    const auto size = it->file_size(e2);
    if (e2) continue;
    total += size;
    if (entries) entries->emplace_back(it->last_write_time(e2), it->path());
  }
  if (entries) std::sort(entries->begin(), entries->end());
  return total;
}

}  // namespace

std::string range_key(const std::string& url, std::uint64_t offset, std::size_t n) {
  return url + "@" + std::to_string(offset) + "+" + std::to_string(n);
}
std::string whole_key(const std::string& url) { return url + "@all"; }
std::string size_key(const std::string& url) { return url + "@size"; }

bool enabled() { return !dir().empty(); }

bool load(const std::string& key, std::byte* dst, std::size_t n) {
  std::uint64_t size = 0;
  Fd f{open_entry(key, size)};
  if (f.fd < 0 || size != n || !read_all(f.fd, dst, n)) return false;
  g_hits.fetch_add(1, std::memory_order_relaxed);
  g_hit_bytes.fetch_add(n, std::memory_order_relaxed);
  detail::count_io(&detail::IoCounters::cache_hits, 1);
  return true;
}

bool load(const std::string& key, std::vector<std::byte>& out) {
  std::uint64_t size = 0;
  Fd f{open_entry(key, size)};
  if (f.fd < 0) return false;
  out.resize(static_cast<std::size_t>(size));
  if (!read_all(f.fd, out.data(), out.size())) return false;
  g_hits.fetch_add(1, std::memory_order_relaxed);
  g_hit_bytes.fetch_add(size, std::memory_order_relaxed);
  detail::count_io(&detail::IoCounters::cache_hits, 1);
  return true;
}

bool contains(const std::string& key) {
  std::uint64_t size = 0;
  Fd f{open_entry(key, size)};
  return f.fd >= 0;
}

void store(const std::string& key, const std::byte* data, std::size_t n) {
  const std::string d = dir();
  if (d.empty()) return;
  const std::uint64_t cap = limit();
  const std::uint64_t entry = 8 + 4 + key.size() + 8 + n;
  if (entry > cap) return;
  Folder& f = folder(d);
  const std::string name = file_name(key);
  const std::string path = d + "/" + name;
  static std::atomic<std::uint64_t> serial{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial.fetch_add(1));
  auto fail = [&](const char* what) {
    ::unlink(tmp.c_str());
    detail::warn_once("s3-cache-write", "object-store cache: cannot " + std::string(what) + " in " + d + " (" +
                                            std::strerror(errno) + "); reads go on without caching what fails");
  };
  {
    std::lock_guard lock(f.mu);
    if (!f.counted) {
      std::error_code ec;
      fs::create_directories(d, ec);
      f.bytes = scan(d, nullptr);
      f.counted = true;
    }
  }
  if (contains(key)) return;  // stored already (another thread or process); a damaged entry is replaced
  {
    Fd out{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
    if (out.fd < 0) return fail("create an entry");
    const std::uint32_t key_size = static_cast<std::uint32_t>(key.size());
    const std::uint64_t size = n;
    if (!write_all(out.fd, kMagic, 8) || !write_all(out.fd, &key_size, 4) || !write_all(out.fd, key.data(), key.size()) ||
        !write_all(out.fd, &size, 8) || !write_all(out.fd, data, n))
      return fail("write an entry");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("rename an entry");
  std::lock_guard lock(f.mu);
  f.bytes += entry;
  if (f.bytes <= cap) return;
  // Past the limit: the least recently used entries go, down to 90% of it (other processes'
  // entries counted too).
  std::vector<std::pair<fs::file_time_type, fs::path>> entries;
  f.bytes = scan(d, &entries);
  const std::uint64_t target = cap / 10 * 9;
  for (const auto& [when, p] : entries) {
    if (f.bytes <= target) break;
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec) continue;
    if (fs::remove(p, ec)) f.bytes -= std::min<std::uint64_t>(size, f.bytes);
  }
}

std::uint64_t hits() noexcept { return g_hits.load(std::memory_order_relaxed); }
std::uint64_t hit_bytes() noexcept { return g_hit_bytes.load(std::memory_order_relaxed); }

}  // namespace ferry::loaders::cache
