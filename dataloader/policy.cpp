// The per-sample error policy (ferry/core/faults.h): retries of transient I/O errors, Raise / Skip /
// Replace, samples that got stuck, the intra-batch pool. Runs on the workers.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>

#include "core_parts.h"

namespace ferry::detail {
namespace {

bool listed_stuck(const Job& job, std::size_t i, std::string* message = nullptr) {
  if (!job.stuck) return false;
  for (const StuckSample& s : *job.stuck)
    if (s.index == i) {
      if (message) *message = s.message;
      return true;
    }
  return false;
}

Rows check_not_empty(const Job& job, Rows rows) {
  // Bad data, not a broken loader: a DataError, which a loop (and the tool) catches and goes on
  // from; the batch keeps its position, so resume and batch numbers stay the epoch's.
  if (rows.complete && rows.kept == 0 && !job.indices.empty())
    throw DataError("batch " + std::to_string(job.batch), DataError::kNoOffset,
                    "every sample of the batch failed and was skipped: there is nothing to deliver (see "
                    "stats().first_errors); the next batch follows");
  return rows;
}

}  // namespace

// Fetches sample i into `row` through fn(row, i, sc), retrying transient I/O errors; returns the
// error that remains, if any.
std::exception_ptr LoaderCore::Parts::attempt(std::size_t row, std::size_t i, JobContext& ctx, StageMeter* meter,
                                              const SampleFn& fn, int first) {
  for (int a = first;; ++a) {
    SampleContext sc(i, opt.seed, ctx.worker.epoch, ctx.worker, meter);
    try {
      fn(row, i, sc);
      return nullptr;
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      if (!retry_after(e, a, ctx)) return e;
    }
  }
}

// Whether try `a` that failed with `e` is tried again (a transient I/O error, io_retries not
// spent, the epoch not cancelled); if so, counts the retry and waits its backoff first.
bool LoaderCore::Parts::retry_after(const std::exception_ptr& e, int a, JobContext& ctx) {
  if (a >= opt.io_retries || ctx.cancelled() || !is_transient(e)) return false;
  faults.count_retry();
  std::this_thread::sleep_for(opt.io_retry_backoff * (1 << std::min(a, 16)));
  return true;
}

// Row r of the batch under the error policy; returns whether a sample landed in `row`. Raise
// rethrows; the limit check in faults.report() may throw too.
bool LoaderCore::Parts::fetch_row(const Job& job, JobContext& ctx, std::size_t r, std::size_t row, StageMeter* meter,
                                  const SampleFn& fn, std::size_t* used) {
  const std::size_t i = job.indices[r];
  if (used) *used = i;
  std::exception_ptr error;
  std::string stuck_message;
  SampleError::Kind kind = SampleError::Kind::Timeout;
  if (listed_stuck(job, i, &stuck_message)) {
  } else if (opt.on_error != OnError::Raise && faults.is_stuck(i)) {
    stuck_message = "got stuck in an earlier fetch (its worker was abandoned); not fetched again by this loader";
  } else {
    error = attempt(row, i, ctx, meter, fn);
    if (!error) return true;
    kind = is_io_error(error) ? SampleError::Kind::Io : SampleError::Kind::Data;
  }
  if (opt.on_error == OnError::Raise) {
    if (!error) throw TimeoutError("sample " + std::to_string(i) + " " + stuck_message);
    std::rethrow_exception(error);
  }
  SampleError report;
  report.epoch = ctx.worker.epoch;
  report.batch = job.batch;
  report.index = i;
  report.worker = ctx.worker.id;
  report.kind = kind;
  report.message = error ? what_of(error) : stuck_message;
  if (opt.on_error == OnError::Replace) {
    const std::size_t all = job.plan ? job.plan->samples() : 0;
    for (unsigned t = 0; t < 16 && all > 0; ++t) {
      const std::size_t c = job.plan->sample_at(replacement_position(opt.seed, ctx.worker.epoch, i, t, all));
      if (c == i || listed_stuck(job, c) || faults.is_stuck(c)) continue;
      if (meter) ctx.set_sample(c);  // a candidate that gets stuck is the one to leave out next time
      const bool failed = attempt(row, c, ctx, meter, fn) != nullptr;
      if (meter) ctx.set_sample(i);
      if (failed) continue;
      report.action = SampleError::Action::Replaced;
      report.replacement = c;
      if (used) *used = c;
      faults.report(report);
      return true;
    }
    throw Error("on_error=Replace: no replacement found for sample " + std::to_string(i) +
                " (16 candidates failed); it failed with: " + report.message);
  }
  report.action = SampleError::Action::Skipped;
  faults.report(report);
  return false;
}

bool LoaderCore::simple_policy(const Job& job) const noexcept {
  return p_->opt.on_error == OnError::Raise && !p_->pool && !job.stuck;
}

void LoaderCore::retry_sample(std::size_t row, std::size_t index, JobContext& ctx, const SampleFn& fn) {
  Parts& s = *p_;
  std::exception_ptr e = std::current_exception();
  if (!s.retry_after(e, 0, ctx)) std::rethrow_exception(e);
  if (std::exception_ptr left = s.attempt(row, index, ctx, &ctx.stage, fn, 1)) std::rethrow_exception(left);
}

Rows LoaderCore::for_each_sample(const Job& job, JobContext& ctx, bool compact, const SampleFn& fn) {
  Parts& s = *p_;
  const std::span<const std::size_t> idx = job.indices;
  Rows out;
  ctx.stage.enter(Stage::Fetch);
  if (!s.pool || idx.size() < 2) {
    for (std::size_t r = 0; r < idx.size(); ++r) {
      if (ctx.cancelled()) return {false, out.kept};
      ctx.set_sample(idx[r]);
      ctx.stage.enter(Stage::Fetch);
      if (s.fetch_row(job, ctx, r, compact ? out.kept : r, &ctx.stage, fn, nullptr)) ++out.kept;
    }
    ctx.set_sample(std::nullopt);
    out.complete = !ctx.cancelled();
    return check_not_empty(job, out);
  }
  // Across the intra-batch pool: rows are independent (each writes only its own row or slot).
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::exception_ptr error;            // guarded by mu
  std::optional<std::size_t> failing;  // guarded by mu
  std::vector<unsigned char> kept(idx.size(), 0);
  std::vector<std::size_t> used(idx.size());
  const std::size_t parts = static_cast<std::size_t>(s.opt.intra_batch_threads);
  s.pool->run(
      idx.size(),
      [&](std::size_t begin, std::size_t end) {
        for (std::size_t r = begin; r < end; ++r) {
          if (ctx.cancelled() || failed.load(std::memory_order_relaxed)) return;
          // No stage meter: it belongs to the worker thread, which waits here in 'fetch'.
          try {
            kept[r] = s.fetch_row(job, ctx, r, r, nullptr, fn, &used[r]) ? 1 : 0;
          } catch (...) {
            std::lock_guard lock(mu);
            if (!error) {
              error = std::current_exception();
              failing = idx[r];
            }
            failed = true;
            return;
          }
        }
      },
      (idx.size() + parts - 1) / parts);  // intra_batch_threads parts per batch
  if (error) {
    ctx.set_sample(failing);
    std::rethrow_exception(error);
  }
  out.complete = !ctx.cancelled();
  for (std::size_t r = 0; r < idx.size(); ++r) {
    if (!kept[r]) continue;
    if (compact && out.kept != r) {  // close the hole: fetch this row's sample again, one row up
      ctx.set_sample(used[r]);
      if (std::exception_ptr e = s.attempt(out.kept, used[r], ctx, &ctx.stage, fn)) std::rethrow_exception(e);
    }
    ++out.kept;
  }
  ctx.set_sample(std::nullopt);
  return check_not_empty(job, out);
}

void LoaderCore::stream_record_failed(JobContext& ctx, std::int64_t batch, std::size_t position, std::size_t failures_in_a_row) {
  Parts& s = *p_;
  std::exception_ptr e = std::current_exception();
  if (s.opt.on_error == OnError::Raise) std::rethrow_exception(e);
  SampleError report;
  report.epoch = ctx.worker.epoch;
  report.batch = batch;
  report.index = position;
  report.stream = true;
  report.worker = ctx.worker.id;
  report.kind = is_io_error(e) ? SampleError::Kind::Io : SampleError::Kind::Data;
  report.action = s.opt.on_error == OnError::Replace ? SampleError::Action::Replaced : SampleError::Action::Skipped;
  report.message = what_of(e);
  s.faults.report(report);
  if (failures_in_a_row >= 1024)
    throw Error("the stream failed 1024 times in a row (the last at position " + std::to_string(position) +
                "): it cannot get past a bad record; the last error: " + report.message);
}

}  // namespace ferry::detail
