#include "ferry/detail/pin_stage.h"

#include <atomic>
#include <semaphore>
#include <string>
#include <vector>

#include "queue.h"
#include "thread.h"
#include "ferry/core/error.h"

namespace ferry::detail {

namespace {
struct Item {
  Payload payload;
  std::exception_ptr error;
  bool end = false;
};
}  // namespace

struct PinStage::State {
  State(Engine& e, PinFn p, int d, std::chrono::milliseconds t, TraceRecorder* tr, std::shared_ptr<const Placement> pl,
        PinGroup g)
      : engine(e),
        pin(std::move(p)),
        depth(d < 1 ? 1 : d),
        timeout(t),
        trace(tr),
        placement(std::move(pl)),
        group(std::move(g)) {}
  Engine& engine;
  PinFn pin;
  const int depth;
  const std::chrono::milliseconds timeout;
  TraceRecorder* const trace;
  const std::shared_ptr<const Placement> placement;
  const PinGroup group;
  std::unique_ptr<StageQueue<Item, HandOverTraits>> out;
  std::unique_ptr<std::counting_semaphore<>> credits;
  std::atomic<bool> stopping{false};
  StageMeter stage;
  std::atomic<std::int64_t> batches{0};
  Thread thread;

  // The next batch from the engine, pinned: batch number `batch` of the epoch.
  Item take(std::int64_t batch) {
    Item item;
    stage.enter(Stage::Fetch);  // waiting on the workers
    try {
      item.payload = engine.next();
      if (!item.payload) {
        item.end = true;
      } else {
        stage.enter(Stage::Pin);  // pin() records its own trace span (with the block it used)
        try {
          pin(item.payload, batch);
        } catch (...) {
          item.payload = Payload();
          item.error = wrap_current_exception(WorkerError::kPinThread, batch, {}, Stage::Pin, std::nullopt, false);
        }
      }
    } catch (...) {
      item.error = std::current_exception();  // already a WorkerError / TimeoutError
    }
    return item;  // still in 'pin' (or 'fetch'): run() marks the group's end, after its flush
  }

  void run() {
    if (placement) apply_placement(*placement);
    StopScope stop_scope(&stopping);  // a pool wait inside pin() gives up on stop()
    NoWaitPoll no_poll;               // engine.next() here never runs the consumer's poll
    std::vector<Item> items;
    for (;;) {
      credits->acquire();
      if (stopping.load()) return;
      items.clear();
      const std::int64_t first = batches.load();
      items.push_back(take(first));
      // More of the group: while a place is free and the engine has the batch at hand.
      while (static_cast<int>(items.size()) < group.max && !items.back().end && !items.back().error && !stopping.load() &&
             credits->try_acquire()) {
        if (!engine.ready()) {
          credits->release();
          break;
        }
        items.push_back(take(first + static_cast<std::int64_t>(items.size())));
      }
      if (group.flush) {
        stage.enter(Stage::Pin);
        try {
          group.flush();  // also when stopping: what pin() left is finished before its batches go
        } catch (...) {
          for (std::size_t k = 0; k < items.size(); ++k) {
            if (!items[k].payload) continue;
            items[k].payload = Payload();
            items[k].error = wrap_current_exception(WorkerError::kPinThread, first + static_cast<std::int64_t>(k), {}, Stage::Pin,
                                                    std::nullopt, false);
          }
        }
      }
      stage.enter(Stage::Idle);  // once a group: a clock read saved a batch
      if (stopping.load()) return;
      for (Item& item : items) {
        ++batches;
        const bool end = item.end;
        out->push(std::move(item));
        if (end) return;
      }
    }
  }
};

PinStage::PinStage(Engine& engine, PinFn pin, int depth, std::chrono::milliseconds timeout, TraceRecorder* trace,
                   std::shared_ptr<const Placement> placement, PinGroup group)
    : state_(std::make_unique<State>(engine, std::move(pin), depth, timeout, trace, std::move(placement), std::move(group))) {
  if (trace) trace->name_track(TraceRecorder::kPinTrack, "pin thread");
}

std::int64_t PinStage::pin_ns() const noexcept { return state_->stage.total_ns(Stage::Pin); }

PinStage::~PinStage() { stop(); }

void PinStage::start() {
  State& s = *state_;
  stop();
  s.stopping = false;
  s.batches = 0;
  s.out = std::make_unique<StageQueue<Item, HandOverTraits>>();
  s.credits = std::make_unique<std::counting_semaphore<>>(s.depth);
  s.thread = Thread("ferry-pin", [&s] { s.run(); });
}

Payload PinStage::next() {
  State& s = *state_;
  if (!s.out) throw Error("PinStage: next() before start()");
  std::optional<Item> item;
  const WaitPoll& poll = s.engine.wait_poll();
  if (s.timeout.count() > 0 || poll) {
    // The workers' own timeout is enforced inside engine.next(); this one catches a stalled pin.
    // While the pin thread waits on the workers ('fetch'), the engine's own timeout governs (it
    // abandons stuck workers and may dispatch a batch again); only a pin that stalls is ours.
    using std::chrono::microseconds;
    const microseconds limit = stage_timeout(s.timeout);
    const auto take = [&s, &item](microseconds slice) {
      auto [got, timed_out] = s.out->pop_for(slice);
      if (timed_out) return false;
      item = std::move(got);
      return true;
    };
    // Interrupted (the poll) propagates: nothing was taken, the next call waits for the same batch.
    while (!wait_polled(poll, limit, take, microseconds::max())) {
      if (s.stage.current() != Stage::Fetch)
        throw TimeoutError("DataLoader timed out after " +
                           std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(limit).count()) +
                           " ms waiting for the pin thread, which is in stage '" + stage_name(s.stage.current()) + "'");
    }
  } else {
    item = s.out->pop();
  }
  if (!item) return {};
  s.credits->release();
  if (item->error) std::rethrow_exception(item->error);
  return std::move(item->payload);
}

void PinStage::stop() noexcept {
  State& s = *state_;
  if (!s.thread.joinable()) return;
  s.stopping = true;
  s.engine.interrupt();
  s.credits->release();
  s.out->close();
  s.thread.join();
}

}  // namespace ferry::detail
