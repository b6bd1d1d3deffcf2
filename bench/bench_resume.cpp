// bench_resume — what restoring a saved loader state costs.
//
// A map-style dataset of 1,281,167 samples (ImageNet's training set size; a sample is an int64
// drawn from its generator, so the loader's own costs show), shuffled, batch 256. Rows, medians of
// --runs trials, each with a new loader:
//   a fresh epoch: begin() to the first batch;
//   restore(state saved at 1%, 50% and 99% of the epoch), then begin() to the first batch;
//   replaying to those points instead: begin() and receive every batch before them (what a
//   loader without a seekable state must do, fetching every consumed sample again).
// Usage: bench_resume [--runs N] [--workers W]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Samples {
  std::size_t n;
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i, SampleContext& ctx) const { return static_cast<std::int64_t>(i) + static_cast<std::int64_t>(ctx.rng().randint(7)); }
};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 5, workers = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc) runs = std::stoi(argv[++i]);
    else if (a == "--workers" && i + 1 < argc) workers = std::stoi(argv[++i]);
  }
  const std::size_t n = 1281167;
  DataLoaderOptions o;
  o.batch_size = 256;
  o.shuffle = true;
  o.seed = 1;
  o.num_workers = workers;
  std::printf("bench_resume: %zu samples, batch 256, shuffled, %d workers, %u hardware threads; median of %d trials\n\n", n, workers,
              std::thread::hardware_concurrency(), runs);
  std::printf("| to the first batch | ms | vs. a fresh epoch |\n|---|---:|---:|\n");
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    DataLoader loader(Samples{n}, o);
    const auto t0 = Clock::now();
    auto it = loader.begin();
    (void)*it;
    t.push_back(ms_since(t0));
  }
  const double fresh = median(t);
  std::printf("| a fresh epoch | %.2f | 1.00 |\n", fresh);
  LoaderState start = DataLoader(Samples{n}, o).state();
  for (double at : {0.01, 0.5, 0.99}) {
    LoaderState s = start;
    s.batches = static_cast<std::uint64_t>(at * static_cast<double>(s.batches_per_epoch));
    const std::string text = s.to_string();
    t.clear();
    for (int r = 0; r < runs; ++r) {
      DataLoader loader(Samples{n}, o);
      const auto t0 = Clock::now();
      loader.restore(LoaderState::from_string(text));
      auto it = loader.begin();
      (void)*it;
      t.push_back(ms_since(t0));
    }
    const double resume = median(t);
    std::printf("| restore at %.0f%% (batch %llu) | %.2f | %.2f |\n", 100 * at, static_cast<unsigned long long>(s.batches), resume,
                resume / fresh);
  }
  for (double at : {0.01, 0.5, 0.99}) {
    const auto k = static_cast<std::size_t>(at * static_cast<double>(start.batches_per_epoch));
    t.clear();
    for (int r = 0; r < std::max(1, runs / 2); ++r) {
      DataLoader loader(Samples{n}, o);
      const auto t0 = Clock::now();
      auto it = loader.begin();
      for (std::size_t b = 0; b < k; ++b, ++it) (void)*it;
      (void)*it;
      t.push_back(ms_since(t0));
    }
    const double replay = median(t);
    std::printf("| replaying %.0f%% (%zu batches) | %.2f | %.1f |\n", 100 * at, k, replay, replay / fresh);
  }
  return 0;
}
