// bench_faults — what fault handling costs, and how fast a stuck sample reaches the caller.
//
// 1. Policy cost on a fault-free run: the loaders' workload (JPEG decode + random_resized_crop
//    224 + flip + to_float over the photograph tiles of scripts/bench-loaders.sh), all cores,
//    on_error = raise / skip / replace, epochs interleaved (raise, skip, replace, raise, ...) so
//    drift hits all three alike; medians and ratios to raise.
// 2. Hang to TimeoutError: a sample that never returns, timeout T; the time from the moment the
//    consumer starts waiting for that batch to the TimeoutError, over many trials (the goal: T +
//    at most 100 ms). Each trial's stuck worker is abandoned and replaced.
// 3. Chaos throughput: a map-style dataset with a fixed per-sample cost (50 us of work), 1% of
//    samples throwing, under skip and replace, against the same dataset without faults.
//
// Usage: bench_faults [--photos DIR] [--runs N] [--trials N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

const char* policy_name(OnError p) { return p == OnError::Raise ? "raise" : p == OnError::Skip ? "skip" : "replace"; }

int workers_all() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

void policy_cost(const std::string& photos, int runs) {
  ImageFolderOptions io;
  io.transform.random_resized_crop(224, 224).horizontal_flip().to_float();
  ImageFolder ds(photos, io);
  std::printf(
      "\n1. policy cost, fault-free: %zu photographs, decode + random_resized_crop 224 + flip + to_float, batch 64, "
      "%d workers\n",
      ds.size(), workers_all());
  const OnError policies[] = {OnError::Raise, OnError::Skip, OnError::Replace};
  std::vector<double> rate[3];
  for (int r = 0; r < runs + 1; ++r) {
    for (int p = 0; p < 3; ++p) {
      DataLoaderOptions o;
      o.batch_size = 64;
      o.shuffle = true;
      o.num_workers = workers_all();
      o.on_error = policies[p];
      DataLoader loader(ds, o);
      std::size_t n = 0;
      const auto t0 = Clock::now();
      for (LabeledBatch& b : loader) n += static_cast<std::size_t>(b.label.size(0));
      if (r > 0) rate[p].push_back(static_cast<double>(n) / seconds_since(t0));  // run 0 warms the page cache
    }
  }
  const double base = median(rate[0]);
  for (int p = 0; p < 3; ++p)
    std::printf("   on_error=%-8s %8.0f images/s (median of %d epochs)   %.3f of raise\n", policy_name(policies[p]),
                median(rate[p]), runs, median(rate[p]) / base);
}

void hang_latency(int trials) {
  for (int timeout_ms : {200, 500}) {
    std::vector<double> late;
    for (int t = 0; t < trials; ++t) {
      struct Ints {
        std::size_t size() const { return 64; }
        std::int64_t get(std::size_t i) const { return static_cast<std::int64_t>(i); }
      };
      FaultOptions one;
      one.hang_indices = {static_cast<std::size_t>(8 + t % 40)};
      FaultInjector ds(Ints{}, one);
      DataLoaderOptions o;
      o.batch_size = 4;
      o.num_workers = 4;
      o.timeout = std::chrono::milliseconds(timeout_ms);
      {
        DataLoader loader(ds, o);
        auto it = loader.begin();
        for (;;) {
          const auto t0 = Clock::now();
          try {
            if (it == loader.end()) break;
            ++it;
          } catch (const TimeoutError&) {
            late.push_back(seconds_since(t0) * 1e3 - timeout_ms);
          }
        }
      }
      ds.release();
    }
    std::sort(late.begin(), late.end());
    std::printf("   timeout %d ms: TimeoutError %.1f ms after the timeout (median of %zu trials), max %.1f ms\n", timeout_ms,
                median(late), late.size(), late.empty() ? 0 : late.back());
  }
}

void chaos_throughput(int runs) {
  struct Work {
    std::size_t n;
    std::size_t size() const { return n; }
    std::int64_t get(std::size_t i) const {
      const auto end = Clock::now() + 50us;  // a sample's decode
      std::uint64_t x = i;
      while (Clock::now() < end) x = x * 6364136223846793005ull + 1;
      return static_cast<std::int64_t>(x & 1) + static_cast<std::int64_t>(i);
    }
  };
  const std::size_t n = 40000;
  std::printf("\n3. chaos throughput: %zu samples of 50 us each, batch 32, %d workers; 1%% of samples throw\n", n, workers_all());
  FaultOptions f;
  f.seed = 1;
  f.throw_rate = 0.01;
  FaultInjector chaotic(Work{n}, f);
  std::vector<double> clean, skip, replace;
  for (int r = 0; r < runs; ++r) {
    auto run = [&](auto& ds, OnError p) {
      DataLoaderOptions o;
      o.batch_size = 32;
      o.shuffle = true;
      o.num_workers = workers_all();
      o.on_error = p;
      DataLoader loader(ds, o);
      std::size_t k = 0;
      const auto t0 = Clock::now();
      for (Tensor& b : loader) k += static_cast<std::size_t>(b.numel());
      return static_cast<double>(k) / seconds_since(t0);
    };
    Work plain{n};
    clean.push_back(run(plain, OnError::Raise));
    skip.push_back(run(chaotic, OnError::Skip));
    replace.push_back(run(chaotic, OnError::Replace));
  }
  std::printf("   fault-free (raise)  %8.0f samples/s\n", median(clean));
  std::printf("   1%% faults, skip     %8.0f samples/s   %.3f of fault-free\n", median(skip), median(skip) / median(clean));
  std::printf("   1%% faults, replace  %8.0f samples/s   %.3f of fault-free (each replacement is one more fetch)\n",
              median(replace), median(replace) / median(clean));
}

}  // namespace

int main(int argc, char** argv) {
  std::string photos;
  int runs = 5, trials = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--photos" && i + 1 < argc)
      photos = argv[++i];
    else if (a == "--runs" && i + 1 < argc)
      runs = std::atoi(argv[++i]);
    else if (a == "--trials" && i + 1 < argc)
      trials = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_faults [--photos DIR] [--runs N] [--trials N]\n");
      return 2;
    }
  }
  std::printf("bench_faults: %u hardware threads\n", std::thread::hardware_concurrency());
  if (!photos.empty()) policy_cost(photos, runs);
  std::printf("\n2. hang -> TimeoutError, 4 workers, batch 4\n");
  hang_latency(trials);
  chaos_throughput(runs);
  return 0;
}
