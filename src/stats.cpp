// Loader statistics: see include/ferry/core/stats.h.
#include "ferry/core/stats.h"
#include "ferry/detail/io_counters.h"
#include "ferry/loaders/storage.h"

#include <algorithm>
#include <cstdio>

namespace ferry {

namespace {
double fraction(double part, double whole) { return whole > 0 ? std::clamp(part / whole, 0.0, 1.0) : 0.0; }
}  // namespace

double LoaderStats::workers_busy() const noexcept {
  return fraction(fetch_seconds + transform_seconds + collate_seconds, wall_seconds * std::max(workers, 1));
}
double LoaderStats::pin_busy() const noexcept { return fraction(pin_seconds, wall_seconds); }
double LoaderStats::copy_busy() const noexcept { return fraction(copy_seconds, wall_seconds); }
double LoaderStats::decode_busy() const noexcept { return fraction(decode_seconds, wall_seconds * std::max(decode_threads, 1)); }
double LoaderStats::gather_busy() const noexcept { return fraction(gather_seconds, wall_seconds); }
double LoaderStats::consumer_busy() const noexcept { return wall_seconds > 0 ? 1.0 - fraction(wait_seconds, wall_seconds) : 0.0; }

std::string LoaderStats::bottleneck() const {
  if (wall_seconds <= 0 || batches == 0) return "none";
  if (consumer_busy() >= 0.95) return "consumer";
  std::string name = "workers";
  double busiest = workers_busy();
  if (pinning && pin_busy() > busiest) {
    name = "pin";
    busiest = pin_busy();
  }
  if (device && copy_busy() > busiest) {
    name = "copy";
    busiest = copy_busy();
  }
  if (device && images_decoded && decode_busy() > busiest) {
    name = "decode";
    busiest = decode_busy();
  }
  if (device && device_gather && gather_busy() > busiest) name = "gather";
  return name;
}

std::string LoaderStats::report() const {
  char line[160];
  std::string out;
  std::snprintf(line, sizeof line, "%llu batches in %.3f s: %.1f batches/s\n", static_cast<unsigned long long>(batches),
                wall_seconds, batches_per_second());
  out += line;
  out += "stage        thread-s    busy  capacity\n";
  auto row = [&](const char* name, double seconds, double busy, const char* capacity) {
    std::snprintf(line, sizeof line, "%-10s %10.3f  %5.1f%%  %s\n", name, seconds, 100 * busy, capacity);
    out += line;
  };
  char workers_cap[48];
  std::snprintf(workers_cap, sizeof workers_cap, "%d worker thread%s", std::max(workers, 1), workers == 1 ? "" : "s");
  const double wcap = wall_seconds * std::max(workers, 1);
  row("fetch", fetch_seconds, fraction(fetch_seconds, wcap), workers_cap);
  row("transform", transform_seconds, fraction(transform_seconds, wcap), workers_cap);
  row("collate", collate_seconds, fraction(collate_seconds, wcap), workers_cap);
  if (pinning) row("pin", pin_seconds, pin_busy(), "the pin thread");
  if (device) row("copy", copy_seconds, copy_busy(), "the GPU copy engine");
  char decode_cap[64];
  std::snprintf(decode_cap, sizeof decode_cap, "%d decode thread%s (nvJPEG + the transform kernel)", std::max(decode_threads, 1),
                decode_threads == 1 ? "" : "s");
  if (device && images_decoded) row("decode", decode_seconds, decode_busy(), decode_cap);
  if (device && device_gather) row("gather", gather_seconds, gather_busy(), "the GPU (rows read from registered host memory)");
  row("wait", wait_seconds, fraction(wait_seconds, wall_seconds), "the consumer, waiting for data");
  const std::string b = bottleneck();
  if (b == "consumer")
    out += "bottleneck: the consumer (it waited for data " + std::to_string(static_cast<int>(100 * (1 - consumer_busy()) + 0.5)) +
           "% of the time; the loader keeps up)\n";
  else
    out += "bottleneck: " + b + "\n";
  if (numa_node >= 0) out += "numa: threads and pinned pool on node " + std::to_string(numa_node) + "\n";
  if (store_requests || cache_hits) {
    std::snprintf(line, sizeof line,
                  "object store: %llu requests, %.1f MB, %llu retried, %llu hedged; %llu reads from the disk cache\n",
                  static_cast<unsigned long long>(store_requests), static_cast<double>(store_bytes) / 1e6,
                  static_cast<unsigned long long>(store_retries), static_cast<unsigned long long>(store_hedges),
                  static_cast<unsigned long long>(cache_hits));
    out += line;
  }
  if (samples_skipped || samples_replaced || io_retries || timeouts || abandoned_workers) {
    std::snprintf(line, sizeof line,
                  "faults: %llu skipped, %llu replaced (%llu damaged, %llu i/o, %llu stuck); %llu i/o retries; %llu timeouts; "
                  "%llu workers abandoned\n",
                  static_cast<unsigned long long>(samples_skipped), static_cast<unsigned long long>(samples_replaced),
                  static_cast<unsigned long long>(data_errors), static_cast<unsigned long long>(io_errors),
                  static_cast<unsigned long long>(stuck_samples), static_cast<unsigned long long>(io_retries),
                  static_cast<unsigned long long>(timeouts), static_cast<unsigned long long>(abandoned_workers));
    out += line;
    for (const std::string& e : first_errors) out += "  " + e + "\n";
  }
  return out;
}

namespace detail {
namespace {
thread_local IoCounters* t_io = nullptr;
thread_local CancelCheck t_cancelled = nullptr;
thread_local const void* t_cancel_arg = nullptr;
thread_local std::chrono::steady_clock::time_point t_deadline;  // ReadDeadline's, where t_deadline_ms > 0
thread_local long long t_deadline_ms = 0;
}  // namespace
IoCounters* current_io() noexcept { return t_io; }
bool io_deadline_passed() noexcept { return t_deadline_ms > 0 && std::chrono::steady_clock::now() >= t_deadline; }
long long io_deadline_ms() noexcept { return t_deadline_ms; }
bool io_cancelled() noexcept { return (t_cancelled != nullptr && t_cancelled(t_cancel_arg)) || io_deadline_passed(); }
ScopedIo::ScopedIo(IoCounters* counters, CancelCheck cancelled, const void* arg) noexcept
    : previous_(t_io), previous_check_(t_cancelled), previous_arg_(t_cancel_arg) {
  t_io = counters;
  t_cancelled = cancelled;
  t_cancel_arg = arg;
}
ScopedIo::~ScopedIo() {
  t_io = previous_;
  t_cancelled = previous_check_;
  t_cancel_arg = previous_arg_;
}
}  // namespace detail

ReadDeadline::ReadDeadline(std::chrono::milliseconds limit) noexcept
    : previous_at_(detail::t_deadline), previous_ms_(detail::t_deadline_ms) {
  detail::t_deadline = std::chrono::steady_clock::now() + limit;
  detail::t_deadline_ms = std::max<long long>(limit.count(), 1);
}
ReadDeadline::~ReadDeadline() {
  detail::t_deadline = previous_at_;
  detail::t_deadline_ms = previous_ms_;
}

}  // namespace ferry
