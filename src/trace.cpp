// Trace recording and Chrome trace-event output: see include/ferry/core/trace.h.
#include "ferry/core/trace.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ostream>

#include "ferry/core/dataset.h"

namespace ferry {

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

TraceRecorder::TraceRecorder(std::int64_t max_batches, std::size_t max_events)
    : max_batches_(max_batches), max_events_(max_events), origin_ns_(now_ns()) {}

void TraceRecorder::span(int track, std::string_view name, std::int64_t batch, std::int64_t begin_ns, std::int64_t end_ns,
                         std::string args) {
  std::lock_guard l(mu_);
  if (events_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  events_.push_back({track, std::string(name), batch, begin_ns, end_ns, std::move(args)});
}

void TraceRecorder::name_track(int track, std::string name) {
  std::lock_guard l(mu_);
  for (auto& [t, n] : tracks_)
    if (t == track) {
      n = std::move(name);
      return;
    }
  tracks_.emplace_back(track, std::move(name));
}

std::size_t TraceRecorder::events() const {
  std::lock_guard l(mu_);
  return events_.size();
}

std::size_t TraceRecorder::dropped() const {
  std::lock_guard l(mu_);
  return dropped_;
}

namespace {
// Names come from ferry itself (stage names, "wait", thread names): escape quotes and
// backslashes anyway so the output is always valid JSON.
void json_string(std::ostream& out, std::string_view s) {
  out << '"';
  for (char c : s) {
    if (c == '"' || c == '\\')
      out << '\\' << c;
    else if (static_cast<unsigned char>(c) < 0x20)
      out << ' ';
    else
      out << c;
  }
  out << '"';
}
}  // namespace

void TraceRecorder::write_chrome_json(std::ostream& out) const {
  std::lock_guard l(mu_);
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) out << ",\n";
    first = false;
  };
  for (const auto& [track, name] : tracks_) {
    sep();
    out << R"({"ph":"M","name":"thread_name","pid":1,"tid":)" << track << R"(,"args":{"name":)";
    json_string(out, name);
    out << "}}";
    sep();
    out << R"({"ph":"M","name":"thread_sort_index","pid":1,"tid":)" << track << R"(,"args":{"sort_index":)" << track << "}}";
  }
  char num[64];
  for (const Event& e : events_) {
    sep();
    out << R"({"ph":"X","pid":1,"tid":)" << e.track << ",\"name\":";
    json_string(out, e.name);
    std::snprintf(num, sizeof num, "%.3f", static_cast<double>(e.begin_ns - origin_ns_) / 1e3);
    out << ",\"ts\":" << num;
    std::snprintf(num, sizeof num, "%.3f", static_cast<double>(std::max<std::int64_t>(e.end_ns - e.begin_ns, 0)) / 1e3);
    out << ",\"dur\":" << num << ",\"args\":{\"batch\":" << e.batch;
    if (!e.args.empty()) out << ',' << e.args;
    out << "}}";
  }
  out << "\n]}\n";
}

Stage StageMeter::enter(Stage s) noexcept {
  const std::int64_t now = now_ns();
  const Stage prev = stage_.exchange(s, std::memory_order_relaxed);
  if (since_ns_ != 0) {
    auto& total = total_ns_[static_cast<std::size_t>(prev)];
    total.store(total.load(std::memory_order_relaxed) + (now - since_ns_), std::memory_order_relaxed);
    if (trace_ && prev != Stage::Idle && prev != s && trace_->wants(batch_)) {
      try {
        trace_->span(track_, stage_name(prev), batch_, span_since_ns_, now);
      } catch (...) {  // out of memory while tracing: drop the event
      }
    }
  }
  since_ns_ = now;
  if (prev != s || span_since_ns_ == 0) span_since_ns_ = now;
  return prev;
}

}  // namespace ferry
