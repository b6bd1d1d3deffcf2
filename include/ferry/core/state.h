// ferry/core/state.h — where a loader stands in its epochs, saved with a checkpoint and restored.
//
//   ferry::LoaderState s = loader.state();          // after the last batch the consumer received
//   save(checkpoint_dir + "/loader", s.to_string()); // beside the model's weights
//   ...
//   loader.restore(ferry::LoaderState::from_string(load(checkpoint_dir + "/loader")));
//   for (auto& batch : loader) ...                   // continues with the next batch
//
// Note [Resume]
// A map-style epoch is a function of (seed, epoch): the sampler's batch plan, and each sample's
// generator keyed by (seed, epoch, index). So the state is a handful of numbers, and a restore
// costs one epoch plan (what begin() costs anyway): nothing is replayed, no consumed sample is
// fetched, and the number of workers, prefetch depth, in_order, pinning and device may all change.
// Batches prefetched but not received are not counted.
//
// Streams (iterable datasets, tar shards) resume mid-epoch with the same batch size, in order,
// under on_error = Raise: the stream skips the records its batches before the state had used,
// through the stream's skip(n) when it has one (a mapped stream skips without running its
// transform, so tar records skipped are read, not decoded), else by reading them. A stream whose
// dataset keeps a cursor (save_cursor / restore_cursor: TableTokens) puts in the state the unit
// and offset of its next record, and a restore starts there: nothing before it is read again. A stream that
// fills across workers (kFillsAcrossWorkers: tar shards in a loader, one reading of the epoch
// dealt to the workers) resumes at any number of workers; one whose every worker reads its own
// shard of the data resumes with the same number. Anything else is a ferry::Error.
//
// Checks: restore() compares the state with the loader (seed, dataset size, and a hash of the
// epoch's batch plan, which changes with the sampler, shuffle, batch_size, drop_last or a sampler
// that is not a function of the epoch; for streams, the batch size, and the workers where each
// reads its own shard) and throws
// ferry::Error naming what differs.
//
// Elastic data parallelism: a DistributedSampler state restored at another world size continues
// the epoch from the position the whole group had reached (every rank steps together, so any
// rank's state holds it), split over the new ranks as DistributedSampler::indices_from says.
// At the same world size any rank's state restores every rank (each goes on with its own share
// from the same batch), so a checkpoint may keep rank 0's state alone.
//
// The text format (to_string), version 1: a first line "ferry.LoaderState 1", then one
// "key value" line per field below, values decimal (plan_hash: 16 hex digits). Readers of version
// 1 ignore keys they do not know (later versions of format 1 may add some); a missing or malformed
// field, or another format version, is a ferry::Error naming it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ferry {

struct LoaderState {
  static constexpr int kFormatVersion = 1;
  std::uint64_t seed = 0;               ///< DataLoaderOptions::seed
  std::uint64_t epoch = 0;              ///< the epoch the next batch belongs to
  std::uint64_t batches = 0;            ///< batches of that epoch the consumer has received (failed ones too)
  std::uint64_t batches_per_epoch = 0;  ///< of that epoch's plan
  std::uint64_t samples_per_epoch = 0;  ///< sample indices in that plan
  std::uint64_t dataset_size = 0;
  std::uint64_t plan_hash = 0;  ///< a 64-bit hash of the epoch's plan (indices and batch bounds)
  // DistributedSampler only (world_size 0 otherwise): the epoch's order is split over world_size
  // ranks from position segment_start (0 unless the epoch was resumed at another world size).
  std::uint64_t world_size = 0, rank = 0, segment_start = 0;
  std::uint64_t position = 0;  ///< where the whole group stands in the epoch's order (elastic restore)
  // Streams: `batches` counts the stream batches up to the next one (the round-robin key, dead
  // keys of exhausted workers included), over stream_workers streams of batch_size records.
  std::uint64_t batch_size = 0, stream_workers = 0;
  // Streams that know where their records come from (TableTokens): cursor 1, and the next
  // record's unit (an index into the rank's units of the epoch, in their order) and its offset
  // there, so that a restore starts reading at that unit instead of reading the epoch again.
  // Written only when cursor is 1; 0 when a text lacks them.
  std::uint64_t cursor = 0, cursor_unit = 0, cursor_offset = 0;

  /// The text format above.
  std::string to_string() const;
  /// Parses to_string()'s text; ferry::Error names what is damaged or missing.
  static LoaderState from_string(std::string_view text);
  bool operator==(const LoaderState&) const = default;
};

}  // namespace ferry
