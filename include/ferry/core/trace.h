// ferry/core/trace.h — per-batch timelines, written as a Chrome trace.
//
// Give a loader a TraceRecorder (DataLoaderOptions::trace) and every loader thread records, for
// the first `max_batches` batches of each epoch, when it worked on which batch and in which stage:
// workers (fetch, transform, collate), the pin thread (pin, with the pinned block's address),
// and the consumer (waiting for the batch, then holding it). write_chrome_json() writes the
// Trace Event Format that chrome://tracing and https://ui.perfetto.dev open: one row per thread,
// one box per stage of a batch, the batch number in each box's arguments.
//
//   auto trace = std::make_shared<ferry::TraceRecorder>(50);
//   options.trace = trace;
//   ... iterate ...
//   std::ofstream out("trace.json");
//   trace->write_chrome_json(out);
//
// Thread safety: record calls come from any thread; write_chrome_json may run concurrently.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace ferry {

class TraceRecorder {
 public:
  /// Records batches 0..max_batches-1 of every epoch; at most max_events events in all (the rest
  /// are counted in dropped()).
  explicit TraceRecorder(std::int64_t max_batches, std::size_t max_events = 1'000'000);

  /// Whether batch `batch` is recorded.
  bool wants(std::int64_t batch) const noexcept { return batch >= 0 && batch < max_batches_; }
  /// One box on `track` from begin_ns to end_ns (steady_clock nanoseconds) named `name`; `args`
  /// is extra "key": value JSON text (may be empty).
  void span(int track, std::string_view name, std::int64_t batch, std::int64_t begin_ns, std::int64_t end_ns,
            std::string args = {});
  /// Names a track (a thread) in the output.
  void name_track(int track, std::string name);

  std::size_t events() const;
  std::size_t dropped() const;
  /// The Trace Event Format JSON object ({"traceEvents": [...]}); times relative to construction.
  void write_chrome_json(std::ostream& out) const;

  /// Tracks the loader uses: workers are 0..num_workers-1.
  static constexpr int kConsumerTrack = 1000;
  static constexpr int kPinTrack = 1001;
  static constexpr int kInlineTrack = 1002;

 private:
  struct Event {
    int track;
    std::string name;
    std::int64_t batch, begin_ns, end_ns;
    std::string args;
  };
  const std::int64_t max_batches_;
  const std::size_t max_events_;
  const std::int64_t origin_ns_;
  mutable std::mutex mu_;
  std::vector<Event> events_;                        // guarded by mu_
  std::vector<std::pair<int, std::string>> tracks_;  // guarded by mu_
  std::size_t dropped_ = 0;                          // guarded by mu_
};

/// steady_clock now, in nanoseconds (the clock traces and stage meters use).
std::int64_t now_ns() noexcept;

}  // namespace ferry
