// loaders/s3.h — private: objects in S3-compatible storage (s3://bucket/key), read over HTTP with
// libcurl, requests signed with AWS Signature V4. The only file that includes curl is s3.cpp.
//
// Where it connects and as whom comes from the conventions AWS's own tools read; the public
// header ferry/loaders/storage.h lists them (Note [S3 settings] in s3.cpp).
//
// Every read is retried with jittered backoff on a 5xx, a 429, a reset, a refused connection or a
// stall, and hedged (a second request for the same bytes, the first answer wins) when its first
// byte is late. What still fails is an IoError with errno EIO (transient: the loader's io_retries
// apply) after the last attempt, or a DataError naming the URL for a 403, a 404, a missing bucket.
// No credential ever appears in an error.
//
// Thread safety: every function may be called from any number of threads; each thread keeps its
// own connections.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "s3_xml.h"

namespace ferry::loaders::s3 {

/// True for "s3://...".
bool is_url(std::string_view path) noexcept;

/// "s3://bucket/key" split; ferry::Error naming the URL when it has no bucket.
struct Url {
  std::string bucket;
  std::string key;  ///< may be empty (a bucket's root) or end in '/' (a prefix)
  std::string text() const { return "s3://" + bucket + "/" + key; }
};
Url parse(const std::string& url);

/// The object's size in bytes (one ranged GET of its first byte).
std::uint64_t size(const Url& url);

/// The object's first min(n, size) bytes into `out` and its size, in one ranged GET (its
/// Content-Range tells the size): opening a stream costs one request, not two. 0 (and `out`
/// empty) for an empty object.
std::uint64_t first_piece(const Url& url, std::size_t n, std::vector<std::byte>& out);

/// Reads exactly `n` bytes at `offset` into `dst` (one ranged GET); DataError when the object
/// ends before them.
void read(const Url& url, std::uint64_t offset, std::size_t n, std::byte* dst);

/// Reads the whole object into `out` (resized to fit).
void get(const Url& url, std::vector<std::byte>& out);

/// A batch's reads, in flight together on this thread's connections while the thread works on
/// what has arrived: start() sends them (at most `in_flight` at a time, the rest as those finish),
/// take() waits for one and hands over its bytes. Each `Want` is a range (size > 0) or a whole
/// object (size 0). A read that failed is not retried here (one try, no hedge): take() says false
/// and the caller reads it the usual way, which retries and names the error; so does a read whose
/// first byte has not come when take() has waited FERRY_S3_HEDGE_AFTER for it. A new start()
/// cancels what the last one left. Never throws for a failed request.
struct Want {
  Url url;
  std::uint64_t offset = 0;
  std::size_t size = 0;
  bool first = false;  ///< first_piece's read: at most `size` bytes from 0, the object's size unknown
};
void start(std::vector<Want> wants, std::size_t in_flight = 32);
/// Want k of the last start(): its bytes into `out` (true), or false when it failed or was taken.
bool take(std::size_t k, std::vector<std::byte>& out);

/// One read sent ahead, on connections of its own (they end with the reader): a tar stream asks
/// for its next pieces while it parses this one (start, take; one ReadAhead a piece), and for its next shard's first piece
/// and size, first_piece() sent ahead, while it parses this shard (start_first, take_first). A
/// take hands over the bytes of the read started for exactly those bytes; anything else (another
/// range or object, a failed read, one late past the hedge deadline) is false, and the caller
/// reads them itself, with retries and hedges. Not thread-safe: one reader at a time.
class ReadAhead {
 public:
  ReadAhead();
  ~ReadAhead();
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;
  /// Sends the read of `n` bytes at `offset` (cancelling one still in flight).
  void start(const Url& url, std::uint64_t offset, std::size_t n);
  /// Waits for the read started for (offset, n) and copies its bytes to `dst`; the reads in
  /// `meanwhile` (the same reader's others, on this thread) are moved along while it waits.
  bool take(std::uint64_t offset, std::size_t n, std::byte* dst, std::span<ReadAhead* const> meanwhile = {});
  /// Sends the read of the first `n` bytes of `url`, its size unknown (cancelling one in flight).
  void start_first(const Url& url, std::size_t n);
  /// Waits for the read start_first() sent for (url, n): its bytes into `out`, the object's size
  /// into `size`.
  bool take_first(const Url& url, std::size_t n, std::vector<std::byte>& out, std::uint64_t& size);
  /// Moves the read in flight along without waiting: what has arrived is taken off the socket
  /// (which would otherwise fill and stall the transfer while the reader works). True while it is
  /// still on its way.
  bool progress();
  /// Stops a read in flight (its connection closes).
  void cancel();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Every object under `prefix` in `bucket` (ListObjectsV2, every page), in key order.
std::vector<Object> list(const std::string& bucket, const std::string& prefix);

}  // namespace ferry::loaders::s3
