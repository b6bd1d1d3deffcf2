// ferry/core/stats.h — where a loader's time goes (DataLoader::stats()).
//
// Every loader thread charges its time to the stage it is in (StageMeter), so the numbers are
// measured, not sampled: thread-seconds in fetch, transform and collate summed over the workers,
// the pin thread's copying, the GPU time of the host-to-device copies (CUDA timing events on the
// copy stream), and the time the consumer spent blocked in the loader waiting for its next batch.
// Dividing each by the capacity of its stage (workers x wall time for the workers, wall time for
// the pin thread, the copy engine and the consumer) gives how busy it was; the busiest one is the
// bottleneck. When the consumer almost never waits, the loader keeps up and the consumer's own
// work (the training step) is what limits throughput.
//
//   ferry::LoaderStats s = loader.stats();
//   std::cout << s.report();   // batches/s, per-stage seconds and busy fractions, bottleneck
//
// With intra_batch_threads > 1 a transform runs on the intra-batch pool and its time is counted
// in fetch (the worker waits for the pool in that stage).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

struct LoaderStats {
  double wall_seconds = 0;       ///< since the first begin() (or reset_stats())
  std::uint64_t batches = 0;     ///< delivered to the consumer
  int workers = 0;               ///< threads producing batches (num_workers, or 1 inline)
  double fetch_seconds = 0;      ///< summed over worker threads
  double transform_seconds = 0;  ///< summed over worker threads (MappedDataset transforms)
  double collate_seconds = 0;    ///< summed over worker threads
  double pin_seconds = 0;        ///< the pin thread copying batches into pinned memory
  double copy_seconds = 0;       ///< GPU time of the host-to-device copies
  /// GPU decode: the decode threads' time decoding (nvJPEG holds its thread throughout), summed over them
  double decode_seconds = 0;
  int decode_threads = 0;            ///< GPU decode: threads decoding (DataLoaderOptions::gpu_decode_threads)
  std::uint64_t images_decoded = 0;  ///< GPU decode: JPEGs decoded on the device
  double gather_seconds = 0;         ///< device gather: GPU time of the gather kernels
  std::uint64_t rows_gathered = 0;   ///< device gather: rows the GPU read from registered host memory
  bool device_gather = false;        ///< whether the device gather makes the batches (Note [Device gather])
  double wait_seconds = 0;           ///< the consumer blocked in the loader for its next batch
  bool pinning = false;              ///< whether a pin thread ran
  bool device = false;               ///< whether a device stage ran
  int numa_node = -1;                ///< the NUMA node the loader's threads and pinned pool sit on; -1: not placed
  // Faults (ferry/core/faults.h), since the loader started (or reset_stats()).
  std::uint64_t samples_skipped = 0;      ///< on_error = Skip
  std::uint64_t samples_replaced = 0;     ///< on_error = Replace
  std::uint64_t data_errors = 0;          ///< skipped/replaced samples whose dataset threw
  std::uint64_t io_errors = 0;            ///< ... an I/O error still failing after io_retries
  std::uint64_t stuck_samples = 0;        ///< ... stuck past timeout
  std::uint64_t io_retries = 0;           ///< transient I/O errors retried (not counted above)
  std::uint64_t timeouts = 0;             ///< TimeoutErrors raised
  std::uint64_t abandoned_workers = 0;    ///< workers abandoned in a stuck call (and replaced)
  std::vector<std::string> first_errors;  ///< the loader's first skipped/replaced samples, named
  // Object storage (s3:// paths), what this loader's workers read (ferry/loaders/storage.h):
  std::uint64_t store_requests = 0;  ///< HTTP requests sent, retries and hedges included
  std::uint64_t store_bytes = 0;     ///< bytes received
  std::uint64_t store_retries = 0;   ///< requests sent again after a transient failure
  std::uint64_t store_hedges = 0;    ///< second requests sent for a late first byte
  std::uint64_t cache_hits = 0;      ///< reads served by the on-disk cache (FERRY_S3_CACHE_DIR)

  double batches_per_second() const noexcept { return wall_seconds > 0 ? batches / wall_seconds : 0; }
  /// Busy fractions (0..1) of each stage's capacity.
  double workers_busy() const noexcept;
  double pin_busy() const noexcept;
  double copy_busy() const noexcept;
  double decode_busy() const noexcept;
  double gather_busy() const noexcept;
  double consumer_busy() const noexcept;
  /// "consumer" when the consumer waited under 5% of the time (the loader keeps up), else the
  /// busiest of "workers", "pin", "copy" and "decode" (GPU decode).
  std::string bottleneck() const;
  /// A human-readable table of the above (with a faults section when there were any).
  std::string report() const;

  /// Calls fn(name, value) for every field above, then the derived values (batches_per_second,
  /// the *_busy fractions, bottleneck): the one list the Python module's stats() dict and the
  /// `ferry` tool's JSON are made from (a test checks that every field is here). Values are
  /// double, int, std::uint64_t, bool, std::string or std::vector<std::string>.
  template <class Fn>
  void for_each(Fn&& fn) const {
    fn("wall_seconds", wall_seconds);
    fn("batches", batches);
    fn("workers", workers);
    fn("fetch_seconds", fetch_seconds);
    fn("transform_seconds", transform_seconds);
    fn("collate_seconds", collate_seconds);
    fn("pin_seconds", pin_seconds);
    fn("copy_seconds", copy_seconds);
    fn("decode_seconds", decode_seconds);
    fn("decode_threads", decode_threads);
    fn("images_decoded", images_decoded);
    fn("gather_seconds", gather_seconds);
    fn("rows_gathered", rows_gathered);
    fn("device_gather", device_gather);
    fn("wait_seconds", wait_seconds);
    fn("pinning", pinning);
    fn("device", device);
    fn("numa_node", numa_node);
    fn("samples_skipped", samples_skipped);
    fn("samples_replaced", samples_replaced);
    fn("data_errors", data_errors);
    fn("io_errors", io_errors);
    fn("stuck_samples", stuck_samples);
    fn("io_retries", io_retries);
    fn("timeouts", timeouts);
    fn("abandoned_workers", abandoned_workers);
    fn("first_errors", first_errors);
    fn("store_requests", store_requests);
    fn("store_bytes", store_bytes);
    fn("store_retries", store_retries);
    fn("store_hedges", store_hedges);
    fn("cache_hits", cache_hits);
    fn("batches_per_second", batches_per_second());
    fn("workers_busy", workers_busy());
    fn("pin_busy", pin_busy());
    fn("copy_busy", copy_busy());
    fn("decode_busy", decode_busy());
    fn("gather_busy", gather_busy());
    fn("consumer_busy", consumer_busy());
    fn("bottleneck", bottleneck());
  }
};

}  // namespace ferry
