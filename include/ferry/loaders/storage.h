// ferry/loaders/storage.h — data in S3-compatible object storage.
//
// Every loader that takes a path also takes an "s3://bucket/key" URL: ImageFolder over a prefix
// ("s3://bucket/train/", listed once), TarShards and TarImages over shard URLs
// (expand_braces("s3://bucket/train-{000..127}.tar")), NpyDataset, IdxDataset, read_npy,
// read_idx and read_image over objects; the registry's configurations, the `ferry` tool and the
// Python package pass URLs through. Batches, resume, the error policy and GPU decode are the same
// as over local files.
//
//   ferry::ImageFolder train("s3://my-bucket/imagenet/train/", {.transform = ...});
//   ferry::DataLoader loader(train, {.batch_size = 256, .shuffle = true, .num_workers = 16});
//
// How bytes are read: an image, an .npy or an IDX file is one GET; a tar stream is read front to
// back in 8 MiB ranged GETs, the next two requested while this one is parsed and moved along while
// the worker waits (a shard's first piece brings its size; the next shard's first two are requested
// in one GET while this shard is read, and with prefetch_next_epoch a worker's first shard of the
// next epoch as its last shard's reads are); an indexed tar shard's headers are read that way once,
// then each record is one ranged GET, a batch's records requested together. Each worker thread
// keeps its own connections (libcurl, reused from request to request). A request is retried with
// jittered exponential backoff on a 5xx, a 429, a refused or reset connection or a stall; when its
// first byte is late, a second request for the same bytes is sent and the first answer wins (a
// hedge). A request that fails every attempt is a transient IoError (DataLoaderOptions::io_retries
// then applies, and on_error after that); a 403, a 404 or a missing bucket is a DataError naming
// the URL. A read whose batch the loader gives up on (its worker abandoned at
// DataLoaderOptions::timeout, or the epoch ending) stops within 0.1 s and closes its connections,
// rather than at its stall limit. Credentials never appear in an error.
//
// Settings, read as AWS's own SDKs and CLI read them:
//   endpoint     AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's endpoint_url, else
//                https://s3.<region>.amazonaws.com
//   region       AWS_REGION, AWS_DEFAULT_REGION, the profile's region, else us-east-1
//   credentials  AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), else the
//                profile (AWS_PROFILE, else "default") in AWS_SHARED_CREDENTIALS_FILE
//                (~/.aws/credentials), then in AWS_CONFIG_FILE (~/.aws/config); none found, or
//                AWS_NO_SIGN_REQUEST=1, sends anonymous requests (public buckets)
//   addressing   AWS_S3_ADDRESSING_STYLE or the profile's addressing_style (path | virtual); by
//                default path-style with a custom endpoint (MinIO, SeaweedFS, Ceph) and
//                virtual-host style on AWS's own
//   attempts     AWS_MAX_ATTEMPTS: tries of one request before it fails (default 5)
//   hedging      FERRY_S3_HEDGE_AFTER: seconds without a first byte before the hedge is sent
//                (default 1; 0 sends it at once; "off" never); a read sent ahead (the next two
//                pieces or the next shard, a batch's records) waited for this long is dropped
//                and read again, hedged
//   stalls       FERRY_S3_STALL_SECONDS: a transfer that receives nothing this long is dropped and
//                retried (default 30)
//   cache        FERRY_S3_CACHE_DIR: a folder on local disk that keeps what was read (each image,
//                record, or 8 MiB piece of a stream, and each object's size), so later epochs
//                read the disk, not the network; unset, nothing is cached. Entries are checked
//                (their key is stored with them: a damaged or cut-short entry is read again from
//                the store), written atomically (processes may share the folder), and the least
//                recently used go past FERRY_S3_CACHE_LIMIT (bytes, or with K, M, G, T; default
//                16G). Objects are assumed not to change while cached: clear the folder after
//                rewriting objects in place.
// They are read when a request is made (the files once for each set of variables), so a process
// may change them between loaders.
#pragma once

#include <chrono>
#include <cstdint>

namespace ferry {

/// Bounds the object-store reads the calling thread makes while it lives, as a loader's `timeout`
/// bounds its workers': those a dataset makes when it is built (an .npy's or IDX file's header, an
/// image folder's listing, an indexed tar's headers, a token file's index). A read still going
/// `limit` after the scope began ends within 0.1 s with a TimeoutError naming the URL; without it
/// a silent server is waited for through every attempt's stall limit (AWS_MAX_ATTEMPTS times
/// FERRY_S3_STALL_SECONDS). Scopes nest (the inner one's deadline counts while it lives); a read
/// on a local file is not bounded.
///
///   { ferry::ReadDeadline bound(std::chrono::seconds(30)); ferry::NpyDataset x("s3://bucket/x.npy"); }
///
/// Python: every ``ferry.datasets`` function's ``timeout=`` (seconds).
class ReadDeadline {
 public:
  explicit ReadDeadline(std::chrono::milliseconds limit) noexcept;
  ~ReadDeadline();
  ReadDeadline(const ReadDeadline&) = delete;
  ReadDeadline& operator=(const ReadDeadline&) = delete;

 private:
  std::chrono::steady_clock::time_point previous_at_;
  long long previous_ms_;
};

/// What the object-store readers of this process have done since it started (all loaders).
struct ObjectStoreStats {
  std::uint64_t requests = 0;     ///< HTTP requests sent, retries and hedges included
  std::uint64_t bytes = 0;        ///< bytes received (bodies)
  std::uint64_t retries = 0;      ///< requests sent again after a transient failure
  std::uint64_t hedges = 0;       ///< second requests sent for a late first byte
  std::uint64_t hedges_won = 0;   ///< hedges that answered first
  std::uint64_t cache_hits = 0;   ///< reads served by the on-disk cache (FERRY_S3_CACHE_DIR)
  std::uint64_t cache_bytes = 0;  ///< bytes they served

  /// What the counters grew by since `before` (a run's share).
  ObjectStoreStats since(const ObjectStoreStats& before) const noexcept {
    return {requests - before.requests,      bytes - before.bytes,           retries - before.retries,
            hedges - before.hedges,          hedges_won - before.hedges_won, cache_hits - before.cache_hits,
            cache_bytes - before.cache_bytes};
  }
  /// Calls fn(name, value) for every counter: the Python dict and the tool's JSON are made from it.
  template <class Fn>
  void for_each(Fn&& fn) const {
    fn("requests", requests);
    fn("bytes", bytes);
    fn("retries", retries);
    fn("hedges", hedges);
    fn("hedges_won", hedges_won);
    fn("cache_hits", cache_hits);
    fn("cache_bytes", cache_bytes);
  }
};

/// The counters now. Thread-safe.
ObjectStoreStats object_store_stats() noexcept;

}  // namespace ferry
