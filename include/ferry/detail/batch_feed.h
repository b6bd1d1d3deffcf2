// ferry/detail/batch_feed.h — one stream's records dealt to a loader's workers by batch.
//
// Note [One batcher across workers]
// A stream read by one reader per worker leaves workers idle when there are fewer units (shards)
// than workers, and each worker's batches end with a remainder: an epoch of N records loses up to
// W * (B - 1) of them to per-worker remainders, and the batches change with the worker count. A
// BatchFeed reads the epoch's units on its own threads (lanes: lane l reads units l, l + L, ...,
// each front to back, each once) and puts the records in one order, unit 0's, then unit 1's, and
// so on, whatever the lanes' timing. Record p of that order belongs to batch p / B, and batch b to
// worker b mod W: that is the engine's stream key b (the j-th batch of worker w is key j * W + w),
// so the loader delivers batches 0, 1, 2, ... in order, each exactly the records [bB, (b+1)B) of
// the epoch, and only the last batch can be short. The batches are the same for any W; so are the
// records' generators when keyed by p (BatchFeed::next reports it).
//
// Workers take records with next(w). A worker that finds none of its own deals records from the
// lane of the unit being read into their owners' queues until one of its own arrives (under one
// mutex: dealing moves a record, it does not copy or decode it); the lane of the unit being dealt
// reads ahead up to 4 * `lane_records` records (so that a reader thread that waits for a core does
// not stop every worker), the others `lane_records` each, ready when their unit's turn comes. What waits in the workers' queues is
// bounded by the engine's window (a worker deals only up to its next batch, and it is given that
// batch only within prefetch_factor * W batches of the oldest one not yet delivered).
//
// Resume: a worker told to skip its first n records (skip(w, n), n a whole number of its batches)
// drops records dealt to it before its first batch; the lanes still read them (a stream's records
// cannot be found without reading what comes before them).
//
// A failed record (a damaged shard, a unit that does not open) takes its place in the order as an
// error: its owner's next() throws it, so the error policy sees it at its position.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
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
    int workers = 1;                ///< the loader's workers (1 with none)
    std::size_t batch_size = 1;
  };
  /// read(unit, sink) reads one unit front to back into the sink (it may throw: the error takes
  /// the next position). Lanes start at once.
  using ReadUnit = std::function<void(std::size_t unit, Sink& sink)>;
  BatchFeed(Shape shape, ReadUnit read);
  /// Stops the lanes and joins them (a lane in a read finishes that read first).
  ~BatchFeed();
  BatchFeed(const BatchFeed&) = delete;
  BatchFeed& operator=(const BatchFeed&) = delete;

  /// Worker w's next record and its position in the epoch's order, or a null box at the end;
  /// rethrows a failed record's error.
  Box next(int worker, std::uint64_t& position);
  /// Worker w's first `records` records (whole batches of its own) are skipped (a resumed epoch).
  void skip(int worker, std::size_t records);

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
  void lane_main(std::size_t lane);
  bool put(std::size_t lane, Item item, const std::function<bool()>& on_wait);

  const Shape shape_;
  const ReadUnit read_;
  std::mutex mu_;
  std::condition_variable dealt_;  // a worker's queue or the unit being read got a record
  std::vector<Lane> lanes_;
  std::vector<std::deque<Item>> queues_;    // by worker
  std::vector<std::uint64_t> first_batch_;  // by worker: batches before it are not its (resume)
  std::size_t unit_ = 0;                    // the unit being dealt
  std::uint64_t position_ = 0;              // the next record's position
  bool ended_ = false, stopping_ = false;
  int waiting_ = 0;
  struct Threads;
  std::unique_ptr<Threads> threads_;  // last: joined first
};

}  // namespace ferry::detail
