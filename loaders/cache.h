// loaders/cache.h — private: the on-disk cache of object-store reads (FERRY_S3_CACHE_DIR).
//
// Data read again every epoch (an image folder, indexed tar records, a stream's 8 MiB pieces) is
// kept in a folder on local disk, so the second epoch reads the disk instead of the network. An
// entry is one read: the object's URL and the exact byte range (or the whole object, or its
// size), stored in a file named by a hash of that key; the file begins with the key itself, which
// a lookup checks, so a hash collision or a file cut short is a miss, never wrong bytes. Entries
// are written to a temporary name and renamed, so processes and threads may share one folder.
// Past FERRY_S3_CACHE_LIMIT bytes (default 16 GiB) the least recently used entries go.
//
// The cache assumes an object does not change while cached (as dataset shards do not): remove
// the folder after rewriting objects in place. It never fails a read: an entry that cannot be
// written is skipped with one warning.
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::loaders::cache {

/// The key of `n` bytes at `offset` of `url`.
std::string range_key(const std::string& url, std::uint64_t offset, std::size_t n);
/// The key of the whole object at `url`, and of its size.
std::string whole_key(const std::string& url);
std::string size_key(const std::string& url);

/// Whether a cache folder is set (FERRY_S3_CACHE_DIR).
bool enabled();
/// Exactly `n` bytes stored under `key` into `dst`; false (dst untouched or partly written) on a miss.
bool load(const std::string& key, std::byte* dst, std::size_t n);
/// The bytes stored under `key`, any size; false on a miss.
bool load(const std::string& key, std::vector<std::byte>& out);
/// Whether `key` is stored (no bytes read).
bool contains(const std::string& key);
/// Stores `n` bytes under `key` (best effort; evicts past the limit).
void store(const std::string& key, const std::byte* data, std::size_t n);

/// Counters for ObjectStoreStats.
std::uint64_t hits() noexcept;
std::uint64_t hit_bytes() noexcept;

}  // namespace ferry::loaders::cache
