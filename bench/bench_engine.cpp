// bench_engine: what the engine itself costs, on this machine.
//
//   (1) overhead: a dataset whose get() does nothing, batches of 64 int64 scalars. Every
//       microsecond per batch here is the engine (dispatch, queues, reorder, collate call).
//   (2) throughput: 784-float samples (MNIST-sized), batches of 256 (800 KB), via get + collate and
//       via direct mode (get_into), against a ceiling with no engine at all: one thread gathering
//       the same rows into a fresh buffer.
//
// Each configuration runs `--runs` times (default 7) after a warm-up epoch; the table reports the
// median and the ratio to the ceiling. Usage: bench_engine [--runs N] [--batches N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Nothing {
  std::size_t n;
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i) const { return static_cast<std::int64_t>(i); }
};

struct Rows {  // get() returns a view: collate does the one copy
  Tensor data;
  std::size_t size() const { return static_cast<std::size_t>(data.size(0)); }
  Tensor get(std::size_t i) const { return data.select(static_cast<std::int64_t>(i)); }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Loader>
double batches_per_second(Loader& loader, std::size_t& sink) {
  for (auto& b : loader) sink += static_cast<std::size_t>(b.numel());  // warm-up epoch
  const auto t0 = Clock::now();
  std::size_t batches = 0;
  for (auto& b : loader) {
    sink += static_cast<std::size_t>(b.numel());
    ++batches;
  }
  return static_cast<double>(batches) / std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 7;
  std::size_t overhead_batches = 20000, throughput_batches = 1500;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--runs")
      runs = std::stoi(argv[i + 1]);
    else if (a == "--batches")
      overhead_batches = std::stoul(argv[i + 1]);
  }
  std::size_t sink = 0;
  std::printf("# bench_engine — %s, %u hardware threads, median of %d runs\n\n", cpu_model().c_str(),
              std::thread::hardware_concurrency(), runs);

  std::printf("## (1) engine overhead: empty get(), batch of 64 int64 scalars, %zu batches\n\n", overhead_batches);
  std::printf(
      "| num_workers | prefetch_factor | batches/s | us per batch (median) | fastest run | slowest run "
      "|\n|---:|---:|---:|---:|---:|---:|\n");
  for (auto [workers, prefetch] : {std::pair{0, 2}, {1, 2}, {1, 4}, {1, 8}, {2, 2}, {2, 4}}) {
    DataLoaderOptions o;
    o.batch_size = 64;
    o.num_workers = workers;
    o.persistent_workers = workers > 0;
    o.prefetch_factor = prefetch;
    DataLoader loader(Nothing{overhead_batches * 64}, o);
    std::vector<double> r;
    for (int k = 0; k < runs; ++k) r.push_back(batches_per_second(loader, sink));
    const double m = median(r);
    const auto [lo, hi] = std::minmax_element(r.begin(), r.end());
    std::printf("| %d | %d | %.0f | %.2f | %.2f | %.2f |\n", workers, prefetch, m, 1e6 / m, 1e6 / *hi, 1e6 / *lo);
  }

  constexpr std::int64_t kFeatures = 784, kBatch = 256;
  const std::int64_t n = static_cast<std::int64_t>(throughput_batches) * kBatch;
  Tensor data = Tensor::empty(DType::Float32, {n, kFeatures});
  for (std::int64_t i = 0; i < data.numel(); ++i) data.data<float>()[i] = static_cast<float>(i % 1000);
  const double batch_mb = kBatch * kFeatures * 4 / 1e6;

  // Ceiling: the copy collate must do, with no engine: gather 256 shuffled rows into a new buffer.
  std::vector<double> ceil_runs;
  {
    RandomSampler order(static_cast<std::size_t>(n), 1);
    auto idx = order.indices(0);
    for (int k = 0; k < runs; ++k) {
      const auto t0 = Clock::now();
      for (std::size_t b = 0; b < throughput_batches; ++b) {
        Tensor out = Tensor::empty(DType::Float32, {kBatch, kFeatures});
        for (std::int64_t r = 0; r < kBatch; ++r)
          std::memcpy(out.data<float>() + r * kFeatures, data.data<float>() + idx[b * kBatch + r] * kFeatures, kFeatures * 4);
        sink += static_cast<std::size_t>(out.data<float>()[0]);
      }
      ceil_runs.push_back(throughput_batches / std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  const double ceiling = median(ceil_runs);
  std::printf("\n## (2) throughput: 784 float32 per sample, batch 256 (%.2f MB), shuffled, %zu batches\n\n", batch_mb,
              throughput_batches);
  std::printf("| path | num_workers | batches/s | samples/s | GB/s | vs. bare gather |\n|---|---:|---:|---:|---:|---:|\n");
  std::printf("| bare gather, no engine (ceiling) | - | %.0f | %.0f | %.2f | 1.00 |\n", ceiling, ceiling * kBatch,
              ceiling * batch_mb / 1e3);
  for (int workers : {0, 1, 2}) {
    DataLoaderOptions o;
    o.batch_size = kBatch;
    o.shuffle = true;
    o.num_workers = workers;
    o.persistent_workers = workers > 0;
    o.prefetch_factor = 4;
    {
      DataLoader loader(Rows{data}, o);
      std::vector<double> r;
      for (int k = 0; k < runs; ++k) r.push_back(batches_per_second(loader, sink));
      const double m = median(r);
      std::printf("| get + collate | %d | %.0f | %.0f | %.2f | %.2f |\n", workers, m, m * kBatch, m * batch_mb / 1e3,
                  m / ceiling);
    }
    {
      DataLoader loader(TensorDataset({data}), o);
      std::vector<double> r;
      for (int k = 0; k < runs; ++k) {
        for (auto& b : loader) sink += static_cast<std::size_t>(b[0].numel());
        const auto t0 = Clock::now();
        std::size_t batches = 0;
        for (auto& b : loader) {
          sink += static_cast<std::size_t>(b[0].numel());
          ++batches;
        }
        r.push_back(static_cast<double>(batches) / std::chrono::duration<double>(Clock::now() - t0).count());
      }
      const double m = median(r);
      std::printf("| direct (get_into) | %d | %.0f | %.0f | %.2f | %.2f |\n", workers, m, m * kBatch, m * batch_mb / 1e3,
                  m / ceiling);
    }
  }
  std::printf("\n(checksum %zu)\n", sink % 1000);
  return 0;
}
