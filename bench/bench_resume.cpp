// bench_resume — what restoring a saved loader state costs.
//
// A map-style dataset of 1,281,167 samples (ImageNet's training set size; a sample is an int64
// drawn from its generator, so the loader's own costs show), shuffled, batch 256. Rows, medians of
// --runs trials, each with a new loader:
//   a fresh epoch: begin() to the first batch;
//   restore(state saved at 1%, 50% and 99% of the epoch), then begin() to the first batch;
//   replaying to those points instead: begin() and receive every batch before them (what a
//   loader without a seekable state must do, fetching every consumed sample again).
// Then the same for tar shards (written to a temporary folder: 16 shards of 2,000 records of 8 KiB,
// batch 64): a stream resumes by having each worker skip its consumed records (read, not mapped),
// so its cost grows with the position; the rows show by how much.
// Usage: bench_resume [--runs N] [--workers W]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"
#include "tar_writer.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Samples {
  std::size_t n;
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i, SampleContext& ctx) const {
    return static_cast<std::int64_t>(i) + static_cast<std::int64_t>(ctx.rng().randint(7));
  }
};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A ustar archive of `records` records "k.bin" (8 KiB) + "k.cls".
void write_shard(const std::string& path, int shard, int records) {
  bench::TarWriter out(path);
  const std::string payload(8192, 'x');
  for (int k = 0; k < records; ++k) {
    const std::string key = std::to_string(shard) + "_" + std::to_string(k);
    out.member(key + ".bin", payload);
    out.member(key + ".cls", std::to_string(k % 10));
  }
}

// Median ms, over `trials` new loaders from make(), from restore(*state) (when given) and begin()
// to the first batch after `skip` received ones.
template <class Make>
double to_batch_ms(Make&& make, const LoaderState* state, std::size_t skip, int trials) {
  std::vector<double> t;
  for (int r = 0; r < trials; ++r) {
    auto loader = make();
    const auto t0 = Clock::now();
    if (state) loader.restore(*state);
    auto it = loader.begin();
    for (std::size_t b = 0; b < skip; ++b, ++it) (void)*it;
    (void)*it;
    t.push_back(ms_since(t0));
  }
  return median(t);
}

// The rows for one dataset: a fresh epoch, restores at 1%, 50% and 99% (states from state_at(k)),
// and replays to those points.
template <class Make, class StateAt>
void rows(Make&& make, StateAt&& state_at, std::size_t batches, int runs) {
  std::printf("| to the first batch | ms | vs. a fresh epoch |\n|---|---:|---:|\n");
  const double fresh = to_batch_ms(make, nullptr, 0, runs);
  std::printf("| a fresh epoch | %.2f | 1.00 |\n", fresh);
  for (double at : {0.01, 0.5, 0.99}) {
    const auto k = static_cast<std::size_t>(at * static_cast<double>(batches));
    const LoaderState s = LoaderState::from_string(state_at(k).to_string());
    const double resume = to_batch_ms(make, &s, 0, runs);
    std::printf("| restore at %.0f%% (batch %zu) | %.2f | %.2f |\n", 100 * at, k, resume, resume / fresh);
  }
  for (double at : {0.01, 0.5, 0.99}) {
    const auto k = static_cast<std::size_t>(at * static_cast<double>(batches));
    const double replay = to_batch_ms(make, nullptr, k, std::max(1, runs / 2));
    std::printf("| replaying %.0f%% (%zu batches) | %.2f | %.1f |\n", 100 * at, k, replay, replay / fresh);
  }
}

void tar_rows(int runs, int workers) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("ferry-bench-resume-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<std::string> paths;
  for (int s = 0; s < 16; ++s) {
    paths.push_back((dir / ("shard-" + std::to_string(s) + ".tar")).string());
    write_shard(paths.back(), s, 2000);
  }
  DataLoaderOptions o;
  o.batch_size = 64;
  o.num_workers = workers;
  auto make = [&] {
    return DataLoader(TarShards(paths).map([](TarRecord r, SampleContext& ctx) {
      return static_cast<std::int64_t>(r.field("bin").size()) + static_cast<std::int64_t>(ctx.rng().randint(7));
    }),
                      o);
  };
  const std::size_t batches = 16 * 2000 / 64;  // 500, the shards split evenly
  std::printf("\n## tar shards: 16 shards of 2,000 records (8 KiB + a label), batch 64, %d workers, %zu batches an epoch\n\n",
              workers, batches);
  rows(
      make,
      [&](std::size_t k) {  // a stream's state: run to batch k
        auto loader = make();
        auto it = loader.begin();
        for (std::size_t b = 0; b + 1 < k; ++b, ++it) (void)*it;
        (void)*it;
        return loader.state();
      },
      batches, runs);
  std::filesystem::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 5, workers = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc)
      runs = std::stoi(argv[++i]);
    else if (a == "--workers" && i + 1 < argc)
      workers = std::stoi(argv[++i]);
  }
  const std::size_t n = 1281167;
  DataLoaderOptions o;
  o.batch_size = 256;
  o.shuffle = true;
  o.seed = 1;
  o.num_workers = workers;
  std::printf("bench_resume: %zu samples, batch 256, shuffled, %d workers, %u hardware threads; median of %d trials\n\n", n,
              workers, std::thread::hardware_concurrency(), runs);
  auto make = [&] { return DataLoader(Samples{n}, o); };
  const LoaderState start = make().state();
  rows(
      make,
      [&](std::size_t k) {  // a map-style state is a position: the epoch's start, k batches on
        LoaderState s = start;
        s.batches = k;
        return s;
      },
      start.batches_per_epoch, runs);
  tar_rows(runs, workers);
  return 0;
}
