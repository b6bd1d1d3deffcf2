// bench_plan: what an epoch's plan costs (the sampler's draws, made once an epoch on a thread of
// the loader's), against the same draws made one Generator call at a time.
//
//   (1) RandomSampler with replacement: 1,024,000 indices from 60,000 rows (bench_gather's (b)).
//   (2) RandomSampler without: a permutation of 1,024,000.
//   (3) DistributedSampler, shuffled: 1,024,000 samples on 8 ranks (one rank's plan).
//
// Beside each, its draws one at a time: Generator::randint per index, as a sampler drew them
// before Generator::fill (same amount of randomness, same Fisher-Yates). Median of `--runs`
// (default 9) after a warm-up; ns an index and the ratio. Usage: bench_plan [--runs N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

template <class F>
double median_ms(int runs, F&& make) {
  std::size_t sink = make().size();
  std::vector<double> ms;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = Clock::now();
    sink += make().size();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  if (sink == 0) std::printf(" ");
  return ms[ms.size() / 2];
}

std::vector<std::size_t> one_at_a_time(std::size_t n, std::size_t draws, std::uint64_t epoch) {
  Generator g(3, 7, epoch);
  std::vector<std::size_t> v(draws);
  for (auto& x : v) x = static_cast<std::size_t>(g.randint(n));
  return v;
}

std::vector<std::size_t> permutation_one_at_a_time(std::size_t n, std::uint64_t epoch) {
  Generator g(3, 7, epoch);
  std::vector<std::size_t> v(n);
  std::iota(v.begin(), v.end(), std::size_t{0});
  for (std::size_t i = n; i > 1; --i) std::swap(v[i - 1], v[g.randint(i)]);
  return v;
}

void row(const char* what, std::size_t indices, double ms, double alone_ms) {
  std::printf("| %s | %zu | %.2f | %.1f | %.2f | %.1f | %.2fx |\n", what, indices, ms, 1e6 * ms / static_cast<double>(indices),
              alone_ms, 1e6 * alone_ms / static_cast<double>(indices), alone_ms / ms);
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--runs")
      runs = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "bench_plan: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  std::printf("# bench_plan — %u hardware threads, median of %d\n\n", std::thread::hardware_concurrency(), runs);
  std::printf(
      "| plan | indices | ms | ns an index | one Generator call at a time: ms | ns an index | ratio "
      "|\n|---|---:|---:|---:|---:|---:|---:|\n");
  constexpr std::size_t kN = 1024000;
  std::uint64_t e = 0;
  const RandomSampler with(60000, 3, true, kN), without(kN, 3);
  const DistributedSampler dist(kN, 8, 0, true, 3);
  row("RandomSampler, with replacement (60,000 rows)", kN, median_ms(runs, [&] { return with.indices(e++); }),
      median_ms(runs, [&] { return one_at_a_time(60000, kN, e++); }));
  row("RandomSampler, a permutation", kN, median_ms(runs, [&] { return without.indices(e++); }),
      median_ms(runs, [&] { return permutation_one_at_a_time(kN, e++); }));
  row("DistributedSampler, 8 ranks (one rank's plan)", kN / 8, median_ms(runs, [&] { return dist.indices(e++); }),
      median_ms(runs, [&] {
        std::vector<std::size_t> v = permutation_one_at_a_time(kN, e++);
        std::vector<std::size_t> mine;
        for (std::size_t k = 0; k < v.size(); k += 8) mine.push_back(v[k]);
        return mine;
      }));
  return 0;
}
