// ferry/detail/pin_stage.h — the pin thread between the engine and the consumer. Not for direct use.
//
// Per epoch, one thread takes batches from the engine in order (it becomes the engine's only
// consumer), pins each through a type-erased function and hands it to the consumer through a
// queue. It runs at most `depth` batches ahead of the consumer. Errors from the workers
// (WorkerError, TimeoutError) and from pinning (a WorkerError naming stage 'pin') are forwarded in
// order. stop() interrupts the engine, wakes and joins the thread; the owner then ends the
// engine's epoch. See Note [Shutdown order] in engine.h.
#pragma once

#include <functional>
#include <memory>

#include "ferry/detail/engine.h"

namespace ferry::detail {

/// Batches pinned together: after a batch, the pin thread goes on with the next one while it
/// has a free place for it (of `depth`) and the engine has it ready (Engine::ready), up to
/// `max` batches, then calls `flush` (which finishes what pin() left for the group: the held
/// gathers' launch) before any of them is handed over. A flush that throws fails every batch of
/// the group. Default: one batch at a time, no flush.
struct PinGroup {
  int max = 1;
  std::function<void()> flush;
};

class PinStage {
 public:
  /// Pins batch number `batch` (its position in the epoch) in place.
  using PinFn = std::function<void(Payload&, std::int64_t batch)>;
  /// `engine` must outlive the stage; `pin` runs on the pin thread; `trace` may be null.
  /// `placement`: where the pin thread runs (ferry/detail/numa.h); null: anywhere.
  PinStage(Engine& engine, PinFn pin, int depth, std::chrono::milliseconds timeout, TraceRecorder* trace = nullptr,
           std::shared_ptr<const Placement> placement = nullptr, PinGroup group = {});
  ~PinStage();
  PinStage(const PinStage&) = delete;
  PinStage& operator=(const PinStage&) = delete;

  /// Starts the pin thread for the engine's live epoch.
  void start();
  /// The next pinned batch; empty at the end of the epoch. Rethrows forwarded errors.
  Payload next();
  /// Stops and joins the pin thread (idempotent).
  void stop() noexcept;
  /// Nanoseconds the pin thread has spent pinning, over all epochs.
  std::int64_t pin_ns() const noexcept;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace ferry::detail
