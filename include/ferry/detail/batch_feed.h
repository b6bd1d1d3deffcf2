// ferry/detail/batch_feed.h — one stream's records dealt to a loader's workers by batch.
//
// Note [One batcher across workers]
// A stream read by one reader per worker leaves workers idle when there are fewer units (shards)
// than workers, and each worker's batches end with a remainder: an epoch of N records loses up to
// W * (B - 1) of them to per-worker remainders, and the batches change with the worker count. A
// BatchFeed reads the epoch's units on its own threads (lanes: lane l reads units l, l + L, ...,
// each front to back, each once) and puts the records in one order, unit 0's, then unit 1's, and
// so on, whatever the lanes' timing. Record p of that order belongs to batch p / B: batch b is
// exactly the records [bB, (b+1)B) of the epoch, and only the last batch can be short. The
// batches are the same for any W; so are the records' generators when keyed by p (next() reports
// it). Batch b is the loader's job b, made by whichever worker is free (the engine's one queue, as
// for a map-style dataset): a worker that a slower core holds back holds back one batch, not every
// W-th (bench/RESULTS.md, "Tar streams filled across the workers", measures what that cost).
//
// A worker takes batch b's records with next(b). When none is there it deals records from the
// lane of the unit being read into their batches' queues until one of batch b arrives (under one
// mutex: dealing moves a record, it does not copy or decode it); the lane of the unit being dealt
// reads ahead up to 4 * `lane_records` records (so that a reader thread that waits for a core does
// not stop every worker), the others `lane_records` each, ready when their unit's turn comes. What
// waits in the batches' queues is bounded by the engine's window (a worker deals only up to its
// batch, and it is given batch b only within prefetch_factor * W batches of the oldest one not yet
// delivered).
//
// Resume: skip(n) drops the epoch's first n records (whole batches) as they are dealt; the lanes still
// read them (a stream's records cannot be found without reading what comes before them).
//
// A failed record (a damaged shard, a unit that does not open) takes its place in the order as an
// error: next() of its batch throws it, so the error policy sees it at its position; the batch
// still spends its B positions (DataLoader's produce_stream).
//
// The lanes read under the feed's own cancellation (detail::ScopedIo): once the loader gives up
// on the feed's epoch (`given_up`: its StreamShare cancelled, at the epoch's end or the loader's
// destruction) or the feed is destroyed, a lane's object-store read in progress ends within
// storage.h's bound and no lane starts another, even while an abandoned worker still holds the
// feed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace ferry::detail {

class BatchFeed {
 public:
  using Box = std::shared_ptr<void>;  // one record (type-erased; the typed stream unboxes it)

  /// What a lane's reader hands its records to.
  class Sink {
   public:
    /// Adds a record of the unit being read; waits while the lane holds `lane_records`, calling
    /// the reader's on_wait() every few milliseconds meanwhile. False when the feed is stopping
    /// (the reader should return).
    bool push(Box record);
    /// A record that failed, at this position of the order.
    bool fail(std::exception_ptr error);
    /// Called while push() waits (a reader's reads sent ahead moved along); true while they move.
    std::function<bool()> on_wait;

   private:
    friend class BatchFeed;
    Sink(BatchFeed& feed, std::size_t lane) : feed_(feed), lane_(lane) {}
    BatchFeed& feed_;
    std::size_t lane_;
  };

  struct Shape {
    std::size_t units = 1;          ///< units of the epoch (shards), read in order 0, 1, ...
    std::size_t lanes = 1;          ///< reader threads (at most units)
    std::size_t lane_records = 64;  ///< records a lane reads ahead (4x that for the unit being dealt)
    std::size_t batch_size = 1;
    /// Records of the epoch before the feed's first (a multiple of batch_size): a feed that starts
    /// mid-epoch (a resumed stream that knows where its next record is). Its records' positions,
    /// and so their batches, count from there.
    std::uint64_t first_position = 0;
  };
  /// read(unit, sink) reads one unit front to back into the sink (it may throw: the error takes
  /// the next position). Lanes start at once.
  using ReadUnit = std::function<void(std::size_t unit, Sink& sink)>;
  /// `given_up`: the loader's cancellation of the feed's epoch (null: none), read by the lanes.
  BatchFeed(Shape shape, ReadUnit read, std::shared_ptr<const std::atomic<bool>> given_up = nullptr);
  /// Stops the lanes and joins them (a lane in a read finishes that read first).
  ~BatchFeed();
  BatchFeed(const BatchFeed&) = delete;
  BatchFeed& operator=(const BatchFeed&) = delete;

  /// The lanes stop also once `given_up` reads true (the epoch that takes a feed made ahead);
  /// the first call holds.
  void stop_with(std::shared_ptr<const std::atomic<bool>> given_up);
  /// Batch `batch`'s next record and its position in the epoch's order, or a null box when the
  /// batch has none left (its records all taken, or the epoch's records ended before them);
  /// rethrows a failed record's error. One caller a batch at a time.
  Box next(std::uint64_t batch, std::uint64_t& position);
  /// The epoch's first `records` records (whole batches) are dropped (a resumed epoch); the
  /// latest call holds.
  void skip(std::size_t records);

 private:
  struct Item {
    Box record;
    std::exception_ptr error;
    bool end_of_unit = false;
    std::uint64_t position = 0;
  };
  struct Lane {
    std::deque<Item> items;
    std::condition_variable space;
    std::size_t unit = 0;  // the unit it reads
  };
  std::size_t room(const Lane& lane) const;
  // Whether the lanes should stop reading: the feed stopping, or the loader gave up on its epoch.
  bool stopped() const noexcept {
    if (stop_.load(std::memory_order_relaxed) || (given_up_ && given_up_->load(std::memory_order_relaxed))) return true;
    const std::atomic<bool>* also = also_given_up_.load(std::memory_order_acquire);
    return also && also->load(std::memory_order_relaxed);
  }
  void lane_main(std::size_t lane);
  bool put(std::size_t lane, Item item, const std::function<bool()>& on_wait);

  const Shape shape_;
  const ReadUnit read_;
  const std::shared_ptr<const std::atomic<bool>> given_up_;
  std::atomic<bool> stop_{false};                        // stopping_, read without the mutex (the lanes' reads)
  std::shared_ptr<const std::atomic<bool>> also_owned_;  // stop_with's, guarded by mu_ (kept for its pointer)
  std::atomic<const std::atomic<bool>*> also_given_up_{nullptr};
  std::mutex mu_;
  std::condition_variable dealt_;  // a batch's queue or the unit being read got a record
  std::vector<Lane> lanes_;
  std::map<std::uint64_t, std::deque<Item>> batches_;  // records dealt and not yet taken, by batch
  std::uint64_t first_batch_ = 0;                      // batches before it are dropped (resume)
  std::size_t unit_ = 0;                               // the unit being dealt
  std::uint64_t position_ = 0;                         // the next record's position
  bool ended_ = false, stopping_ = false;
  int waiting_ = 0;
  struct Threads;
  std::unique_ptr<Threads> threads_;  // last: joined first
};

}  // namespace ferry::detail
