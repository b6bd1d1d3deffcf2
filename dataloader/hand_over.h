// The consumer's end of a route with a device stage (Note [Device stage]): batches whose device
// work is issued, handed over in order with the consumer's stream waiting on each one's fence.
// Consumer thread only. Private to this folder.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <vector>

#include "ferry/detail/engine.h"
#include "ferry/detail/loader_core.h"
#include "ferry/detail/pin_stage.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/pin.h"

namespace ferry::detail {

/// A batch whose device work is issued (by the pin thread: the device gather's, or GPU decode's):
/// the consumer's stream waits on `copied` at hand-over.
struct DeviceBatch {
  Payload batch;
  std::shared_ptr<const EventFence> copied;
};

class DeviceHandOver {
 public:
  /// `pin`, `device`, `typed` and `poll` (the engine's wait poll) outlive the hand-over (LoaderCore::Parts
  /// declares it after them); `timeout` is the loader's (0: unbounded). `fenced`: every issued batch
  /// carries its fence (the device gather; GPU decode's may not).
  DeviceHandOver(PinStage& pin, DeviceStage& device, TypedBatches& typed, int device_prefetch, const WaitPoll& poll,
                 std::chrono::milliseconds timeout, bool fenced) noexcept
      : pin_(pin), device_(device), typed_(typed), prefetch_(device_prefetch), poll_(poll), timeout_(timeout), fenced_(fenced) {}

  /// Route::PinnedToDevice: issues the copies of up to `device_prefetch` pinned batches ahead on
  /// the consumer's thread (batch i+1 transfers while batch i computes), then hands over the
  /// oldest; empty at the epoch's end. A batch that failed keeps its position.
  Payload next_copied();
  /// Route::DeviceIssued: the pin thread has issued the batch's gathers or GPU decode (a
  /// DeviceBatch); the consumer's stream waits on its fence here. `batch`: its position in the
  /// epoch, for a timeout's message.
  /// An interruption (the wait poll) keeps the batch for the next call; a decode that does not
  /// come back within twice the timeout is a TimeoutError, and its batch is kept, never delivered.
  Payload next_issued(std::int64_t batch);
  /// Drops what an epoch left (begin, end, stop).
  void clear() noexcept;

 private:
  void await_issued(const EventFence& copied, std::int64_t batch);

  PinStage& pin_;
  DeviceStage& device_;
  TypedBatches& typed_;
  const int prefetch_;
  const WaitPoll& poll_;
  const std::chrono::milliseconds timeout_;
  const bool fenced_;
  struct Item : DeviceBatch {  // `copied`: the batch's copy, issued here; the consumer waits at hand-over
    std::exception_ptr error;
  };
  std::deque<Item> queue_;  // copies issued, not yet delivered
  bool end_ = false;
  // Route::DeviceIssued: the batch taken from the pin thread whose GPU decode the consumer waits
  // for its decode thread to issue; kept across an interruption.
  Payload awaiting_;
  // Batches whose decode timed out: never delivered, and kept until the loader goes, so that their
  // device buffers are not reused while a decode may still come back and write them.
  std::vector<Payload> timed_out_;
};

}  // namespace ferry::detail
