// The DataLoader engine: see Note [Engine design] and Note [Shutdown order] in
// include/ferry/detail/engine.h.
#include "ferry/detail/engine.h"
#include "ferry/detail/numa.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ferry/core/error.h"
#include "log.h"
#include "queue.h"
#include "reorder.h"
#include "thread.h"

namespace ferry::detail {
namespace {

using Clock = std::chrono::steady_clock;

std::int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

struct Result {
  std::uint64_t key = 0;
  std::int64_t batch = 0;
  int worker = -1;
  Payload payload;
  std::exception_ptr error;
  bool end = false;      // stream mode: the worker's stream is exhausted (shared: no records for this key)
  bool skipped = false;  // stream mode: the batch's records all failed under Skip/Replace; left out
};

struct EpochState {
  EpochState(std::uint64_t epoch, std::shared_ptr<const BatchPlan> plan, int workers, std::shared_ptr<StreamShare> loader_share)
      : epoch(epoch),
        plan(std::move(plan)),
        streams(static_cast<std::size_t>(std::max(workers, 1))),
        loader_share(std::move(loader_share)) {}
  const std::uint64_t epoch;
  const std::shared_ptr<const BatchPlan> plan;
  std::atomic<bool> cancelled{false};
  StageQueue<Result> results;
  // One per worker; element w is touched only by worker w (its jobs come from its own queue).
  std::vector<std::shared_ptr<void>> streams;
  StreamShare share;                          // what the workers' streams share (WorkerInfo::share)
  std::shared_ptr<StreamShare> loader_share;  // the loader's (WorkerInfo::loader_share), kept while a task runs
  // The loader gave up on the epoch: its jobs, and the threads its streams' shared readers run.
  void cancel() noexcept {
    cancelled.store(true);
    share.cancel();
  }
};

struct Task {
  std::shared_ptr<EpochState> epoch;
  Job job;
};

// Batch b of `plan` as the job's indices: a view of a whole plan, or a lazy plan's batch computed
// now (Note [Lazy plans], ferry/core/sampler.h). The task holds the epoch, and so the plan.
void take_batch(Job& job, const BatchPlan& plan, std::size_t b) {
  job.plan = &plan;
  if (!plan.is_lazy()) {
    job.indices = plan.batch(b);
    return;
  }
  auto v = std::make_shared<std::vector<std::size_t>>();
  plan.batch_into(b, *v);
  job.indices = *v;
  job.owned = std::move(v);
}

// One worker thread's control block, shared by the thread and the engine (an abandoned thread
// keeps it). See Note [Abandoned workers].
enum WorkerState : int { kIdle = 0, kBusy = 1, kAbandoned = 2 };
// How often an idle worker moves its stream's reads sent ahead along (Producer::idle): often
// enough that a socket never sits full for long at a store's rates (2 ms of 1 GB/s is 2 MB).
constexpr std::chrono::microseconds kIdleDrive{2000};
struct WorkerCtl {
  StageMeter stage;
  std::atomic<int> state{kIdle};
  std::atomic<std::int64_t> batch{-1};
  std::atomic<std::int64_t> since_ns{0};
  std::atomic<std::int64_t> sample{-1};
  Task task;  // the job in hand: written by the worker before Busy, read by the engine after Abandoned
  std::mutex mu;
  std::condition_variable cv;
  bool exited = false;  // guarded by mu
  void signal(bool exit) {
    std::lock_guard lock(mu);
    if (exit) exited = true;
    cv.notify_all();
  }
};

std::string describe_indices(std::span<const std::size_t> indices, const char* noun) {
  std::ostringstream os;
  os << noun << " ";
  const std::size_t shown = std::min<std::size_t>(indices.size(), 16);
  for (std::size_t i = 0; i < shown; ++i) os << (i ? ", " : "") << indices[i];
  if (shown < indices.size()) os << ", ... (" << indices.size() << " in all)";
  return os.str();
}

std::string worker_name(int worker) {
  if (worker == WorkerError::kPinThread) return "the pin thread";
  return worker < 0 ? std::string("the consumer thread (num_workers=0)") : "worker " + std::to_string(worker);
}

}  // namespace

std::exception_ptr wrap_current_exception(int worker, std::int64_t batch, std::span<const std::size_t> indices, Stage stage,
                                          std::optional<std::size_t> sample, bool stream, bool shared_stream) {
  std::string what;
  DataError const* data_error = nullptr;
  IoError const* io_error = nullptr;
  try {
    throw;
  } catch (const IoError& e) {
    io_error = &e;  // alive until our caller's catch block ends
  } catch (const DataError& e) {
    data_error = &e;  // the object our caller is handling: alive until its catch block ends
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an exception of unknown type";
  }
  std::ostringstream os;
  os << worker_name(worker) << " failed in stage '" << stage_name(stage) << "' of ";
  if (stream && !shared_stream)
    os << "its stream batch " << batch;
  else
    os << "batch " << batch;
  if (sample) os << " at sample " << *sample;
  if (!indices.empty()) os << " (" << describe_indices(indices, stream ? "stream positions" : "samples") << ")";
  if (io_error) return std::make_exception_ptr(io_error->with_context(os.str()));  // keeps its errno
  if (data_error) {
    // Bad data keeps its type so the consumer can catch DataError (or IoError) and skip it; where
    // it happened goes at the end of the message, after the file and offset.
    return std::make_exception_ptr(data_error->with_context(os.str()));
  }
  os << ": " << what;
  // Constructed here, inside the caller's catch block, so std::nested_exception captures it.
  return std::make_exception_ptr(WorkerError(os.str(), worker, batch));
}

struct Engine::State {
  State(EngineOptions o, Producer& p) : opt(o), producer(p), W(o.num_workers) {}

  const EngineOptions opt;
  Producer& producer;
  int W;  // opt.num_workers, or 0 after without_workers()

  // Workers (see Note [Shutdown order] and Note [Abandoned workers]).
  std::vector<std::shared_ptr<StageQueue<Task>>> queues;  // 1 shared (map-style) or W (streams)
  std::vector<std::shared_ptr<WorkerCtl>> ctl;            // the current thread of each slot
  std::vector<Thread> threads;
  std::int64_t retired_ns[kStageCount] = {};  // stage time of threads gone
  std::atomic<std::uint64_t> abandoned{0}, timeouts{0};
  bool keepable = false;  // the producer gave workers a keep-alive: they may be abandoned
  // What the loader's streams share for its life (WorkerInfo::loader_share); each epoch holds it too.
  std::shared_ptr<StreamShare> loader_share = std::make_shared<StreamShare>();

  // The live epoch; consumer thread only.
  std::shared_ptr<EpochState> ep;
  bool live = false;
  std::uint64_t total = 0;  // map-style: batches in the epoch
  std::uint64_t next_key = 0;
  std::uint64_t delivered = 0;
  std::uint64_t in_flight = 0;
  std::unique_ptr<ReorderWindow<Result>> window;
  // The next epoch, made ahead (prefetch_next): its jobs go out once the live epoch's are all out,
  // keyed after them (total + j) in the live window, so batches alive stay within limit().
  std::shared_ptr<EpochState> ahead;
  std::uint64_t ahead_dispatched = 0;
  bool can_prefetch_next() const {
    return (!opt.streaming || opt.shared_stream) && opt.in_order && opt.persistent_workers && W > 0 && opt.timeout.count() == 0;
  }
  std::deque<Result> arrived;          // in_order == false
  std::vector<std::int64_t> ended_at;  // streams: first exhausted j per worker, -1 if live
  int ended = 0;
  // Shared streams: the first key whose job found no records (the epoch ends before it).
  static constexpr std::uint64_t kNoEnd = ~std::uint64_t{0};
  std::uint64_t end_key = kNoEnd;
  bool inline_done = false;
  StageMeter inline_stage;
  // num_workers = 0 while a wait_poll can interrupt the consumer's wait: the batch is made on a
  // helper thread of the engine's (one, kept across batches and epochs) and the consumer polls,
  // so Ctrl-C ends the wait within a poll period even while one sample takes 30 s. A batch still
  // in the making when an interrupted epoch ends is abandoned like a stuck worker (Note
  // [Abandoned workers]): the helper is detached, finishes that one call and leaves, and a fresh
  // one serves the next epoch. Otherwise the epoch's end waits for it.
  struct InlineHelper {
    std::mutex mu;
    std::condition_variable cv;
    bool posted = false, done = false, exit = false, abandoned = false;  // guarded by mu
    bool skipped = false;                                                // guarded by mu: the batch was left out
    Job job;                                                             // guarded by mu until taken
    std::shared_ptr<EpochState> epoch;                                   // guarded by mu until taken
    std::shared_ptr<void> keep;                                          // the producer, kept alive while a job runs
    Payload payload;                                                     // guarded by mu
    std::exception_ptr error;                                            // guarded by mu
    StageMeter stage;                                                    // the helper's
  };
  std::shared_ptr<InlineHelper> helper;
  Thread helper_thread;
  bool inline_pending = false;     // a batch posted to the helper and not yet taken
  bool helper_keepable = false;    // that batch's job holds a keep-alive: it may be abandoned
  std::uint64_t refill_burst = 1;  // dispatch only when this many slots are free (or none in flight)

  std::size_t limit() const { return static_cast<std::size_t>(opt.prefetch_factor) * static_cast<std::size_t>(W); }

  bool dead(std::uint64_t key) const {
    const auto w = static_cast<std::size_t>(key % static_cast<std::uint64_t>(W));
    return ended_at[w] >= 0 && static_cast<std::int64_t>(key / static_cast<std::uint64_t>(W)) >= ended_at[w];
  }
  // Streams, in order: no live key at or after `key` remains.
  bool streams_done(std::uint64_t key) const {
    if (ended < W) return false;
    for (int w = 0; w < W; ++w)
      if (ended_at[w] > 0 && static_cast<std::uint64_t>((ended_at[w] - 1) * W + w) >= key) return false;
    return true;
  }

  // Streams, and map-style with round_robin: worker w takes the jobs whose key is w mod W.
  bool per_worker_queues() const noexcept { return (opt.streaming && !opt.shared_stream) || opt.round_robin; }
  std::size_t queue_of(std::uint64_t key) const noexcept {
    return per_worker_queues() ? static_cast<std::size_t>(key % static_cast<std::uint64_t>(W)) : 0;
  }

  void start_workers() {
    if (!threads.empty() || W == 0) return;
    queues.clear();
    const int nq = per_worker_queues() ? W : 1;
    for (int q = 0; q < nq; ++q) queues.push_back(std::make_shared<StageQueue<Task>>());
    ctl.assign(static_cast<std::size_t>(W), nullptr);
    threads.resize(static_cast<std::size_t>(W));
    if (opt.trace)
      for (int w = 0; w < W; ++w) opt.trace->name_track(w, "worker " + std::to_string(w));
    for (int w = 0; w < W; ++w) spawn(w);
    logger().debug("started {} workers ({} queue{})", W, nq, nq == 1 ? "" : "s");
  }

  // Starts a thread for slot w (at start, or in place of an abandoned one).
  void spawn(int w) {
    auto c = std::make_shared<WorkerCtl>();
    std::shared_ptr<StageQueue<Task>> q = queues[per_worker_queues() ? static_cast<std::size_t>(w) : 0];
    ctl[static_cast<std::size_t>(w)] = c;
    std::shared_ptr<void> keep = producer.keep_alive();
    keepable = keep != nullptr;
    threads[static_cast<std::size_t>(w)] =
        Thread("ferry-w" + std::to_string(w), [this, w, c, q, keep = std::move(keep)] { worker_main(w, *c, *q); });
  }

  void retire_ctl(const WorkerCtl& c) {
    for (std::size_t k = 0; k < kStageCount; ++k) retired_ns[k] += c.stage.total_ns(static_cast<Stage>(k));
  }

  // After an interruption (Ctrl-C) the epoch's end abandons what is still being made rather than
  // wait for it: a 30 s sample must not hold the interrupted program for 30 s.
  bool interrupted() const { return opt.wait_poll.interrupted && opt.wait_poll.interrupted->load(); }
  bool can_abandon() const { return (opt.timeout.count() > 0 || interrupted()) && keepable; }

  // Abandons slot w's worker if it is still in a job; returns whether it did. Consumer thread.
  bool abandon(int w) {
    WorkerCtl& c = *ctl[static_cast<std::size_t>(w)];
    int expected = kBusy;
    if (!c.state.compare_exchange_strong(expected, kAbandoned, std::memory_order_acq_rel)) return false;
    abandoned.fetch_add(1);
    retire_ctl(c);
    threads[static_cast<std::size_t>(w)].detach();
    logger().warn("DataLoader: abandoned worker {} {} in stage '{}' of batch {} for {} ms", w,
                  interrupted() ? "(after an interruption)" : "stuck", stage_name(c.stage.current()), c.batch.load(),
                  (now_ns() - c.since_ns.load()) / 1000000);
    return true;
  }

  // Waits for slot w's thread to end (its queue is closed), abandoning it if it stays in one job
  // longer than `timeout` (Note [Abandoned workers]).
  void retire(int w) noexcept {
    Thread& t = threads[static_cast<std::size_t>(w)];
    if (!t.joinable()) return;
    const std::shared_ptr<WorkerCtl> c = ctl[static_cast<std::size_t>(w)];
    if (c && can_abandon()) {
      std::unique_lock lock(c->mu);
      const std::int64_t grace = opt.timeout.count() > 0 ? opt.timeout.count() * 1000000 : std::int64_t{50} * 1000000;
      for (;;) {
        if (c->exited) break;
        const bool busy = c->state.load() == kBusy;
        if (!busy && opt.timeout.count() == 0) {  // interrupted: an idle worker leaves at once
          c->cv.wait_for(lock, std::chrono::milliseconds(50));
          continue;
        }
        const std::int64_t limit = interrupted() && busy ? now_ns() : busy ? c->since_ns.load() + grace : now_ns() + grace;
        const std::int64_t left = limit - now_ns();
        if (left <= 0) {
          lock.unlock();
          if (abandon(w)) return;
          lock.lock();
          continue;
        }
        c->cv.wait_for(lock, std::chrono::nanoseconds(left));
      }
    }
    t.join();
    if (c) retire_ctl(*c);
  }

  void stop_workers() noexcept {
    for (auto& q : queues) q->close();
    for (int w = 0; w < static_cast<int>(threads.size()); ++w) retire(w);
    threads.clear();
    ctl.clear();
  }

  // Persistent workers between epochs: a worker stuck past `timeout` is replaced.
  void replace_stuck_workers() {
    if (!can_abandon()) return;
    const std::int64_t now = now_ns();
    const bool all = interrupted();
    for (int w = 0; w < static_cast<int>(threads.size()); ++w) {
      WorkerCtl& c = *ctl[static_cast<std::size_t>(w)];
      if (c.state.load() == kBusy && (all || now - c.since_ns.load() >= opt.timeout.count() * 1000000) && abandon(w)) spawn(w);
    }
  }

  void worker_main(int id, WorkerCtl& c, StageQueue<Task>& queue) {
    if (opt.placement) apply_placement(*opt.placement);
    WorkerInfo info{id, W, opt.seed, 0, opt.next_epoch_ahead, opt.batch_size, nullptr, nullptr};
    std::exception_ptr init_error;
    c.stage.enter(Stage::WorkerInit);
    try {
      producer.init_worker(info);
    } catch (...) {
      init_error = std::current_exception();
    }
    c.stage.enter(Stage::Idle);
    // A stream's state after this worker's last job, while its reads sent ahead are on their way
    // (Producer::idle): between jobs they are moved along every kIdleDrive instead of waiting.
    std::weak_ptr<void> moving;
    for (;;) {
      std::optional<Task> task;
      std::shared_ptr<void> stream = moving.lock();
      if (stream && producer.idle(stream)) {
        stream.reset();  // the epoch may end meanwhile: its stream is not kept for the wait
        auto [next, timed_out] = queue.pop_for(kIdleDrive);
        if (timed_out) continue;
        task = std::move(next);
      } else {
        stream.reset();
        moving.reset();
        task = queue.pop();
      }
      if (!task) break;
      if (task->epoch->cancelled.load(std::memory_order_relaxed)) continue;
      c.task = std::move(*task);  // the job in hand, where the engine finds it if it abandons us
      EpochState& epoch = *c.task.epoch;
      const Job& job = c.task.job;
      info.epoch = epoch.epoch;
      info.share = &epoch.share;
      info.loader_share = epoch.loader_share.get();
      c.batch.store(job.batch, std::memory_order_relaxed);
      c.sample.store(-1, std::memory_order_relaxed);
      c.since_ns.store(now_ns(), std::memory_order_relaxed);
      c.state.store(kBusy, std::memory_order_release);
      c.stage.trace(opt.trace, job.batch, id);
      c.stage.enter(Stage::Fetch);
      Result r;
      r.key = job.key;
      r.batch = job.batch;
      r.worker = id;
      JobContext ctx(info, c.stage, epoch.cancelled, epoch.streams[static_cast<std::size_t>(id)], &c.state, &c.sample);
      StopScope stop_scope(&epoch.cancelled);  // a blocked allocation gives up when the epoch ends
      bool drop = false;
      if (init_error) {
        try {
          std::rethrow_exception(init_error);
        } catch (...) {
          r.error = wrap_current_exception(id, job.batch, job.indices, Stage::WorkerInit, std::nullopt, opt.streaming,
                                           opt.shared_stream);
        }
      } else {
        try {
          r.payload = producer.produce(job, ctx);
          if (!r.payload) {
            if (ctx.cancelled())
              drop = true;
            else if (ctx.skipped)
              r.skipped = true;
            else
              r.end = true;
          }
        } catch (...) {
          r.error = wrap_current_exception(id, job.batch, opt.streaming ? ctx.stream_indices : job.indices, c.stage.current(),
                                           ctx.current_sample, opt.streaming, opt.shared_stream);
        }
      }
      c.stage.enter(Stage::Idle);
      c.stage.trace(nullptr, -1, id);
      int expected = kBusy;
      const bool mine = c.state.compare_exchange_strong(expected, kIdle, std::memory_order_acq_rel);
      if (!mine) break;  // abandoned: the consumer has settled this batch without us
      c.signal(false);
      if (opt.streaming) moving = epoch.streams[static_cast<std::size_t>(id)];
      if (!drop) epoch.results.push(std::move(r));
      c.task = Task{};  // last: it may hold the last reference to the epoch
    }
    c.signal(true);
  }

  void dispatch() {
    const std::size_t k = limit();
    bool bursting = false;
    for (;;) {
      if (!opt.streaming) {
        if (next_key >= total) return dispatch_ahead();
      } else if (opt.shared_stream) {
        if (next_key >= end_key) return dispatch_ahead();
      } else {
        if (ended == W) return;
        while (dead(next_key)) ++next_key;
      }
      if (opt.in_order ? next_key >= window->next() + k : in_flight >= k) return;
      // Refill in bursts of half the window: a worker that ran dry is woken once per burst rather
      // than once per batch (bench/RESULTS.md, engine overhead). Not under round-robin:
      //
      // Note [Refill under round-robin]
      // With round_robin, batch b is worker b mod W's, and a worker's next job is the batch a full
      // round after its last. Held back until half the window was free, that job reached the
      // worker up to half a window of batches late: a worker whose batch came in slow held the
      // consumer, the other workers' finished batches filled the window behind it, and they all
      // waited for the burst. The ResNet recipe's second-long batches spread by 0.13-0.18 (stdev
      // over mean, traced on the H200 host): in bench/sim_refill.py's model that keeps workers
      // 0.91-0.93 busy with the bursts and 0.96-0.98 refilled a slot at a time, as PyTorch's index
      // queue refills; traced with this rule, ferry's worker processes were 0.97-0.98 busy
      // (bench/RESULTS.md, "Python datasets: the refill under round-robin"). Batches that slow make
      // the wake-ups a burst saves immaterial; round-robin serves Python datasets only.
      const std::uint64_t free = opt.in_order ? window->next() + k - next_key : k - in_flight;
      if (!bursting && in_flight > 0 && free < refill_burst) return;
      bursting = true;
      Job job;
      job.key = next_key;
      if (opt.streaming) {
        job.batch = static_cast<std::int64_t>(opt.shared_stream ? next_key : next_key / static_cast<std::uint64_t>(W));
      } else {
        job.batch = static_cast<std::int64_t>(next_key);
        take_batch(job, *ep->plan, next_key);
      }
      queues[queue_of(next_key)]->push(Task{ep, job});
      ++in_flight;
      ++next_key;
    }
  }

  // A shared stream's next epoch goes out once the live one's end is known (a job found no
  // records), keyed after it; its jobs past that epoch's own end come back as ends, as the live
  // epoch's do.
  void dispatch_ahead() {
    if (!ahead || !window) return;
    const std::size_t k = limit();
    const std::uint64_t live_end = opt.streaming ? end_key : total;
    while ((opt.streaming || ahead_dispatched < ahead->plan->size()) && live_end + ahead_dispatched < window->next() + k) {
      Job job;
      job.key = ahead_dispatched;
      job.batch = static_cast<std::int64_t>(ahead_dispatched);
      if (!opt.streaming) {
        take_batch(job, *ahead->plan, ahead_dispatched);
      }
      queues[queue_of(ahead_dispatched)]->push(Task{ahead, job});
      ++ahead_dispatched;
    }
  }

  void drop_ahead() noexcept {
    if (!ahead) return;
    ahead->cancel();
    ahead->results.close();
    ahead.reset();
    ahead_dispatched = 0;
  }

  void receive(Result r) {
    --in_flight;
    if (r.end && opt.shared_stream) {
      end_key = std::min(end_key, r.key);
      dispatch_ahead();  // the epoch's end is known: the next one's first batches (an epoch may end at once)
      return;
    }
    if (r.skipped && !opt.in_order) return;
    if (r.end) {
      auto& e = ended_at[static_cast<std::size_t>(r.worker)];
      if (e < 0) {
        e = r.batch;
        ++ended;
      } else {
        e = std::min(e, r.batch);
      }
      return;
    }
    if (opt.in_order)
      window->put(r.key, std::move(r));
    else
      arrived.push_back(std::move(r));
  }

  Payload deliver(Result r) {
    ++delivered;
    dispatch();
    if (r.error) std::rethrow_exception(r.error);
    return std::move(r.payload);
  }

  // "worker 2 in stage 'fetch' of batch 5 at sample 41 for 512 ms", or "worker 2 idle".
  std::string describe_worker(int w, std::int64_t now) const {
    const WorkerCtl& c = *ctl[static_cast<std::size_t>(w)];
    std::ostringstream os;
    os << "worker " << w;
    if (c.state.load() != kBusy) return os.str() + " idle";
    os << " in stage '" << stage_name(c.stage.current()) << "' of batch " << c.batch.load();
    if (const std::int64_t sample = c.sample.load(); sample >= 0) os << " at sample " << sample;
    os << " for " << (now - c.since_ns.load()) / 1000000 << " ms";
    return os.str();
  }

  [[noreturn]] void throw_timeout(std::uint64_t waiting_for) {
    timeouts.fetch_add(1);
    std::ostringstream os;
    os << "DataLoader timed out after " << opt.timeout.count() << " ms waiting for ";
    if (opt.in_order)
      os << (opt.streaming ? "stream key " : "batch ") << waiting_for;
    else
      os << "any batch";
    os << " (" << in_flight << " in flight, " << W << " workers):";
    const std::int64_t now = now_ns();
    for (int w = 0; w < W; ++w) os << " " << describe_worker(w, now) << (w + 1 < W ? ";" : "");
    throw TimeoutError(os.str());
  }

  // Map-style, when the consumer's wait reached its deadline: abandons every worker that has been
  // on its current batch for `timeout` or longer, replaces it, and settles its batch: dispatched
  // again without its stuck sample, or failed at its position with TimeoutError. Returns the next
  // deadline (when the next busy worker's batch reaches `timeout`), or nullopt when no worker is
  // busy and none was abandoned: then nothing the engine can see is stuck (the caller throws).
  std::optional<Clock::time_point> on_timeout() {
    if (opt.streaming || !can_abandon()) return std::nullopt;
    const std::int64_t now = now_ns(), limit = opt.timeout.count() * 1000000;
    bool any = false;
    std::int64_t next = std::numeric_limits<std::int64_t>::max();
    for (int w = 0; w < W; ++w) {
      const std::shared_ptr<WorkerCtl> held = ctl[static_cast<std::size_t>(w)];  // spawn() replaces the slot's
      WorkerCtl& c = *held;
      if (c.state.load() != kBusy) continue;
      const std::int64_t since = c.since_ns.load();
      if (now - since < limit) {
        next = std::min(next, since + limit);
        continue;
      }
      const std::string where = describe_worker(w, now);
      const std::int64_t sample = c.sample.load();
      if (!abandon(w)) continue;  // it finished just now: its result is on its way
      any = true;
      Task task = c.task;  // ours now: the worker lost the race (Note [Abandoned workers])
      spawn(w);
      if (task.epoch != ep) continue;  // a job of an epoch already ended
      if (sample >= 0) producer.sample_abandoned(static_cast<std::size_t>(sample));
      Job job = task.job;
      if (opt.redispatch_stuck && sample >= 0 && job.attempt < opt.max_redispatch) {
        auto stuck = std::make_shared<std::vector<StuckSample>>(job.stuck ? *job.stuck : std::vector<StuckSample>{});
        stuck->push_back(StuckSample{static_cast<std::size_t>(sample), "stuck for " + std::to_string((now - since) / 1000000) +
                                                                           " ms (" + where + "; the worker was abandoned)"});
        job.stuck = std::move(stuck);
        ++job.attempt;
        queues[queue_of(job.key)]->push(Task{ep, job});
        continue;
      }
      timeouts.fetch_add(1);
      std::ostringstream os;
      os << "DataLoader timed out after " << opt.timeout.count() << " ms on batch " << job.batch << ": " << where
         << "; the worker was abandoned and replaced";
      if (opt.redispatch_stuck && sample < 0)
        os << " (the stuck sample is unknown: with intra_batch_threads > 1 a stuck sample costs its batch)";
      else if (opt.redispatch_stuck)
        os << " (the batch was already dispatched " << job.attempt + 1 << " times)";
      Result r;
      r.key = job.key;
      r.batch = job.batch;
      r.worker = w;
      r.error = std::make_exception_ptr(TimeoutError(os.str()));
      receive(std::move(r));
    }
    if (any) return Clock::now() + opt.timeout;  // replacements start on the batches dispatched again
    if (next != std::numeric_limits<std::int64_t>::max())
      return Clock::now() + std::chrono::nanoseconds(std::max<std::int64_t>(next - now_ns(), 0) + 1000);
    return std::nullopt;
  }

  // Makes one batch of a num_workers = 0 epoch on the calling thread; throws the wrapped error.
  // skipped: set when the stream's batch was left out (JobContext::skipped).
  Payload make_inline(const Job& job, EpochState& epoch, StageMeter& stage, bool& skipped) {
    WorkerInfo info{0, 1, opt.seed, epoch.epoch, opt.next_epoch_ahead, opt.batch_size, &epoch.share, epoch.loader_share.get()};
    JobContext ctx(info, stage, epoch.cancelled, epoch.streams[0]);
    stage.trace(opt.trace, job.batch, TraceRecorder::kInlineTrack);
    stage.enter(Stage::Fetch);
    Payload p;
    try {
      p = producer.produce(job, ctx);
    } catch (...) {
      const Stage st = stage.enter(Stage::Idle);
      std::rethrow_exception(wrap_current_exception(-1, job.batch, opt.streaming ? ctx.stream_indices : job.indices, st,
                                                    ctx.current_sample, opt.streaming, opt.shared_stream));
    }
    stage.enter(Stage::Idle);
    stage.trace(nullptr, -1, TraceRecorder::kInlineTrack);
    skipped = !p && ctx.skipped;
    return p;
  }

  void start_helper() {
    auto h = std::make_shared<InlineHelper>();
    helper = h;
    helper_thread = Thread("ferry-inline", [this, h] {
      std::unique_lock lock(h->mu);
      for (;;) {
        h->cv.wait(lock, [&h] { return h->posted || h->exit; });
        if (!h->posted) return;
        h->posted = false;
        const Job job = std::move(h->job);
        const std::shared_ptr<EpochState> epoch = std::move(h->epoch);
        std::shared_ptr<void> keep = std::move(h->keep);
        lock.unlock();
        Payload p;
        std::exception_ptr error;
        bool skipped = false;
        {
          StopScope stop_scope(&epoch->cancelled);  // a blocked allocation gives up when the epoch ends
          try {
            p = make_inline(job, *epoch, h->stage, skipped);
          } catch (...) {
            error = std::current_exception();
          }
        }
        lock.lock();
        if (h->abandoned) {  // the engine settled the epoch without us: drop the batch and leave
          lock.unlock();
          return;
        }
        h->payload = std::move(p);
        h->error = std::move(error);
        h->skipped = skipped;
        h->done = true;
        h->cv.notify_all();
        lock.unlock();
        keep.reset();  // outside the lock: it may be the loader's last reference
        lock.lock();
      }
    });
  }

  void retire_helper_stage(const InlineHelper& h) {
    for (std::size_t k = 0; k < kStageCount; ++k) retired_ns[k] += h.stage.total_ns(static_cast<Stage>(k));
  }

  // Ends the helper thread (waiting for a batch it is making). Consumer thread.
  void stop_helper() noexcept {
    if (!helper) return;
    {
      std::lock_guard lock(helper->mu);
      helper->exit = true;
    }
    helper->cv.notify_all();
    helper_thread.join();
    retire_helper_stage(*helper);
    helper.reset();
    inline_pending = false;
  }

  Payload next_inline() {
    for (;;) {  // again after a stream's batch that was left out (JobContext::skipped)
      if (inline_done) return {};
      bool skipped = false;
      if (!inline_pending) {
        Job job;
        job.key = delivered;
        job.batch = static_cast<std::int64_t>(delivered);
        if (!opt.streaming) {
          if (delivered >= total) return {};
          take_batch(job, *ep->plan, delivered);
        }
        if (!opt.wait_poll.active()) {
          ++delivered;
          Payload p = make_inline(job, *ep, inline_stage, skipped);
          if (skipped) continue;
          if (!p) inline_done = true;
          return p;
        }
        if (!helper) start_helper();
        std::shared_ptr<void> keep = producer.keep_alive();
        helper_keepable = keep != nullptr;
        {
          std::lock_guard lock(helper->mu);
          helper->job = std::move(job);
          helper->epoch = ep;
          helper->keep = std::move(keep);
          helper->done = false;
          helper->posted = true;
        }
        helper->cv.notify_all();
        inline_pending = true;
      }
      InlineHelper& h = *helper;
      std::unique_lock lock(h.mu);
      while (!h.cv.wait_for(lock, opt.wait_poll.period, [&h] { return h.done; })) {
        lock.unlock();
        opt.wait_poll.check();  // Interrupted: the batch goes on being made; the next call takes it
        lock.lock();
      }
      h.done = false;
      inline_pending = false;
      Payload p = std::move(h.payload);
      const std::exception_ptr error = std::move(h.error);
      h.error = nullptr;
      skipped = std::exchange(h.skipped, false);
      lock.unlock();
      ++delivered;
      if (error) std::rethrow_exception(error);
      if (skipped) continue;
      if (!p) inline_done = true;
      return p;
    }
  }

  // The epoch ends with a batch still posted to the helper: abandoned after an interruption (when
  // its job holds a keep-alive), else waited for and dropped.
  void settle_inline() noexcept {
    if (!inline_pending) return;
    inline_pending = false;
    InlineHelper& h = *helper;
    std::unique_lock lock(h.mu);
    if (!h.done && interrupted() && helper_keepable) {
      h.abandoned = true;
      lock.unlock();
      abandoned.fetch_add(1);
      retire_helper_stage(h);
      helper_thread.detach();
      helper.reset();  // a fresh helper serves the next batch
      logger().warn("DataLoader: abandoned the batch in the making (num_workers=0) after an interruption");
      return;
    }
    h.cv.wait(lock, [&h] { return h.done; });
    h.done = false;
    h.payload = Payload{};
    h.error = nullptr;
  }

  bool ready() {
    if (!live || W == 0) return true;
    for (;;) {
      auto [r, timed_out] = ep->results.try_pop();
      if (timed_out || !r) break;
      receive(std::move(*r));
    }
    if (ep->results.closed()) return true;
    if (opt.in_order) return window->ready() || (!opt.streaming && window->next() >= total);
    return !arrived.empty() || (!opt.streaming && delivered >= total);
  }

  Payload next() {
    if (!live) throw Error("DataLoader: next() called with no live epoch");
    if (W == 0) return next_inline();
    auto deadline = Clock::now() + opt.timeout;
    for (;;) {
      if (opt.in_order) {
        if (opt.shared_stream) {
          if (!window->ready() && window->next() >= end_key) return {};
        } else if (opt.streaming) {
          while (!window->ready() && !streams_done(window->next()) && dead(window->next())) window->skip();
          if (!window->ready() && streams_done(window->next())) return {};
        } else if (window->next() >= total) {
          return {};
        }
        if (window->ready()) {
          Result r = window->take();
          if (!r.skipped) return deliver(std::move(r));
          ++delivered;  // a batch whose records all failed: left out, the epoch goes on
          dispatch();
          continue;
        }
      } else {
        if (!arrived.empty()) {
          Result r = std::move(arrived.front());
          arrived.pop_front();
          return deliver(std::move(r));
        }
        if (opt.shared_stream ? (end_key != kNoEnd && in_flight == 0)
            : opt.streaming   ? (ended == W && in_flight == 0)
                              : delivered >= total)
          return {};
      }
      dispatch();
      if (opt.timeout.count() > 0) {
        auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
        if (opt.wait_poll) left = std::min(left, opt.wait_poll.period);
        auto [r, timed_out] = ep->results.pop_for(std::max(left, std::chrono::microseconds(0)));
        if (timed_out && opt.wait_poll && Clock::now() < deadline) {
          opt.wait_poll.check();  // nothing taken: the next call waits for the same batch
          continue;
        }
        if (timed_out) {
          const std::optional<Clock::time_point> next_deadline = on_timeout();
          if (!next_deadline) throw_timeout(window ? window->next() : 0);
          deadline = *next_deadline;
          continue;
        }
        if (r) receive(std::move(*r));
      } else if (opt.wait_poll) {
        auto [r, timed_out] = ep->results.pop_for(opt.wait_poll.period);
        if (timed_out) {
          opt.wait_poll.check();
          continue;
        }
        if (r) receive(std::move(*r));
      } else if (std::optional<Result> r = ep->results.pop()) {
        receive(std::move(*r));
      }
      if (ep->results.closed()) return {};  // interrupted
    }
  }
};

namespace {
EngineOptions with_interrupt_flag(EngineOptions o) {
  o.wait_poll.interrupted = std::make_shared<std::atomic<bool>>(false);
  return o;
}
}  // namespace

Engine::Engine(EngineOptions options, Producer& producer)
    : state_(std::make_unique<State>(with_interrupt_flag(std::move(options)), producer)) {
  if (options.num_workers < 0) throw Error("DataLoader: num_workers must be >= 0, got " + std::to_string(options.num_workers));
  if (options.prefetch_factor < 1)
    throw Error("DataLoader: prefetch_factor must be >= 1, got " + std::to_string(options.prefetch_factor));
}

Engine::~Engine() { shutdown(); }

std::int64_t Engine::stage_ns(Stage stage) const noexcept {
  const State& s = *state_;
  std::int64_t total = s.inline_stage.total_ns(stage) + s.retired_ns[static_cast<std::size_t>(stage)];
  if (s.helper) total += s.helper->stage.total_ns(stage);
  for (const auto& c : s.ctl)
    if (c) total += c->stage.total_ns(stage);
  return total;
}

std::uint64_t Engine::abandoned_workers() const noexcept { return state_->abandoned.load(); }
std::uint64_t Engine::timeouts() const noexcept { return state_->timeouts.load(); }

void Engine::begin_epoch(std::uint64_t epoch, std::shared_ptr<const BatchPlan> plan, std::uint64_t start) {
  State& s = *state_;
  if (s.live)
    throw Error(
        "DataLoader: begin() was called while an iterator of this loader is still live; finish or destroy "
        "the first iterator before starting another epoch");
  if (!s.opt.streaming && !plan) throw Error("DataLoader: no batch plan for a map-style epoch");
  // The epoch made ahead is this one (the same plan, from its start): its jobs out so far, done or
  // not, count as in flight; their results wait in its queue. Any other is dropped.
  const bool adopt = s.ahead && s.ahead->epoch == epoch && s.ahead->plan == plan && start == 0;
  const std::uint64_t ahead_out = adopt ? s.ahead_dispatched : 0;
  if (adopt) {
    s.ep = std::move(s.ahead);
    s.ahead_dispatched = 0;
  } else {
    s.drop_ahead();
    s.ep = std::make_shared<EpochState>(epoch, std::move(plan), s.W, s.loader_share);
  }
  s.total = s.opt.streaming ? 0 : s.ep->plan->size();
  if (start > 0 && !s.opt.streaming && start > s.total)
    throw Error("DataLoader: cannot start the epoch at batch " + std::to_string(start) + " of " + std::to_string(s.total));
  s.delivered = start;
  s.next_key = start + ahead_out;
  s.in_flight = ahead_out;
  s.arrived.clear();
  s.ended_at.assign(static_cast<std::size_t>(std::max(s.W, 1)), -1);
  s.ended = 0;
  s.end_key = State::kNoEnd;
  s.inline_done = false;
  s.window = std::make_unique<ReorderWindow<Result>>(std::max<std::size_t>(s.limit(), 1), start);
  // Round-robin jobs go out one per freed slot, as PyTorch's index queue refills (Note [Refill
  // under round-robin]); any-free-worker jobs in bursts of half the window.
  s.refill_burst = s.opt.round_robin ? 1 : std::max<std::uint64_t>(1, s.limit() / 2);
  s.live = true;
  s.start_workers();
  if (s.W > 0) s.dispatch();
}

void Engine::prefetch_next(std::uint64_t epoch, std::shared_ptr<const BatchPlan> plan) {
  State& s = *state_;
  s.drop_ahead();
  if (!s.live || !s.can_prefetch_next() || (!plan && !s.opt.streaming)) return;
  s.ahead = std::make_shared<EpochState>(epoch, std::move(plan), s.W, s.loader_share);
  s.dispatch();
}

bool Engine::prefetches_next() const noexcept { return state_->can_prefetch_next(); }

std::shared_ptr<const BatchPlan> Engine::plan_made_ahead(std::uint64_t epoch) const noexcept {
  const State& s = *state_;
  return s.ahead && s.ahead->epoch == epoch ? s.ahead->plan : nullptr;
}

void Engine::without_workers() {
  State& s = *state_;
  if (s.live || s.ahead || !s.threads.empty()) throw Error("Engine::without_workers: after the workers started");
  s.W = 0;
}

Payload Engine::next() { return state_->next(); }

bool Engine::ready() { return state_->ready(); }

std::int64_t Engine::next_key() const noexcept {
  const State& s = *state_;
  if (!s.live) return 0;
  if (s.W == 0) return static_cast<std::int64_t>(s.delivered);
  if (!s.opt.in_order || !s.window) return -1;
  return static_cast<std::int64_t>(s.window->next());
}

void Engine::end_epoch() noexcept {
  State& s = *state_;
  if (!s.live) return;
  s.ep->cancel();
  s.ep->results.close();
  s.settle_inline();
  if (!s.opt.persistent_workers)
    s.stop_workers();
  else
    s.replace_stuck_workers();
  if (s.opt.wait_poll.interrupted) s.opt.wait_poll.interrupted->store(false);
  s.window.reset();
  s.arrived.clear();
  s.ep.reset();
  s.live = false;
}

void Engine::shutdown() noexcept {
  end_epoch();
  state_->loader_share->cancel();  // the next epoch's readers made ahead stop too
  state_->drop_ahead();
  state_->stop_workers();
  state_->stop_helper();
}

bool Engine::epoch_live() const noexcept { return state_->live; }

const WaitPoll& Engine::wait_poll() const noexcept { return state_->opt.wait_poll; }

namespace {
thread_local bool t_no_wait_poll = false;
}  // namespace

NoWaitPoll::NoWaitPoll() noexcept : previous_(t_no_wait_poll) { t_no_wait_poll = true; }
NoWaitPoll::~NoWaitPoll() { t_no_wait_poll = previous_; }

bool WaitPoll::active() const noexcept { return fn && !t_no_wait_poll; }

void WaitPoll::check() const {
  if (t_no_wait_poll) return;
  if (!fn) return;
  bool stop = false;
  try {
    stop = fn();
  } catch (...) {
    if (interrupted) interrupted->store(true);
    throw;
  }
  if (stop) {
    if (interrupted) interrupted->store(true);
    throw Interrupted("DataLoader: the wait for the next batch was interrupted (DataLoaderOptions::wait_poll)");
  }
}

void Engine::interrupt() noexcept {
  State& s = *state_;
  if (!s.live) return;
  s.ep->cancel();
  s.ep->results.close();
}

}  // namespace ferry::detail
