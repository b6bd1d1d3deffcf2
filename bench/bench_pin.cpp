// bench_pin: batches delivered on the GPU, ferry against two ceilings, in one run.
//
//   (a) 3x224x224 uint8 samples, batch 256 (38.5 MB), in memory, shuffled;
//   (b) 784 float32 samples, batch 256 (0.8 MB).
//
// Rows: a plain cudaMemcpyAsync loop from one pinned buffer (the link's ceiling); a bare probe
// with no framework (T threads gather the batch's samples straight into one of 4 pinned buffers,
// the main thread copies each to the GPU and recycles the buffer after its event); ferry's loader
// with device=0 in pin modes copy and direct for several worker counts. Each row: median of 5
// timed passes over --batches batches after a warm-up pass; batches count as delivered once their
// copy has completed (the consumer stream is synchronized at the end of each pass).
// Usage: bench_pin [--batches N] [--workers 6,8,10,12] [--prefetch 2,4]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"
#ifdef FERRY_BENCH_TRAINING_LOOP
#include "kernels.h"
#endif

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double rate(std::size_t batches, F&& pass) {  // batches per second, median of 5 after one warm-up
  pass();
  std::vector<double> r;
  for (int k = 0; k < 5; ++k) {
    const auto t0 = Clock::now();
    pass();
    r.push_back(static_cast<double>(batches) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(r);
}

struct Workload {
  const char* name;
  DType dtype;
  Shape sample;
  std::int64_t samples;
};

std::vector<int> g_prefetch{2};
std::vector<std::pair<int, int>> g_split{{1, 8}, {2, 4}, {2, 8}, {4, 4}, {8, 2}};  // workers x intra_batch_threads rows

void run(const Workload& w, std::size_t batches, const std::vector<int>& worker_counts) {
  constexpr std::int64_t kBatch = 256;
  Shape full{w.samples};
  full.insert(full.end(), w.sample.begin(), w.sample.end());
  Tensor data = Tensor::empty(w.dtype, full);
  for (std::size_t i = 0; i < data.nbytes(); ++i)
    static_cast<std::uint8_t*>(data.raw())[i] = static_cast<std::uint8_t>(i * 131 + 7);
  const std::size_t row = data.nbytes() / static_cast<std::size_t>(w.samples);
  const std::size_t batch_bytes = row * kBatch;
  const double mb = batch_bytes / 1e6;
  std::printf("\n## %s: batch 256 = %.2f MB, %zu batches per pass\n\n", w.name, mb, batches);
  std::printf("| pipeline | workers | batches/s | GB/s | vs. bare probe |\n|---|---:|---:|---:|---:|\n");

  auto pool = std::make_shared<PinnedPool>(PinnedPoolOptions{});
  DeviceStage stage({}, pool);
  cuda::DeviceGuard guard(0);

  // Ceiling 1: back-to-back copies of one pinned batch.
  Storage pinned = pool->allocate(batch_bytes);
  std::memcpy(pinned.data(), data.raw(), batch_bytes);
  void* dev = cuda::device_alloc(batch_bytes);
  const double memcpy_rate = rate(batches, [&] {
    for (std::size_t b = 0; b < batches; ++b)
      cuda::memcpy_async(dev, pinned.data(), batch_bytes, cuda::CopyKind::HostToDevice, stage.copy_stream());
    stage.copy_stream().synchronize();
  });

  // Ceiling 2: the bare probe (T gather threads, 4 pinned buffers, recycle after each event).
  const int probe_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2);
  RandomSampler order(static_cast<std::size_t>(w.samples), 3, true, batches * kBatch);
  const auto idx = order.indices(0);
  std::vector<Storage> ring;
  std::vector<cuda::Event> done;
  for (int k = 0; k < 4; ++k) {
    ring.push_back(pool->allocate(batch_bytes));
    done.push_back(cuda::Event::create(0));
  }
  ParallelFor gather(probe_threads);
  const double probe_rate = rate(batches, [&] {
    for (std::size_t b = 0; b < batches; ++b) {
      const int k = static_cast<int>(b % 4);
      if (b >= 4) done[k].synchronize();  // recycle only after its copy completed
      auto* dst = ring[k].data();
      gather.run(
          kBatch,
          [&](std::size_t lo, std::size_t hi) {
            for (std::size_t r = lo; r < hi; ++r)
              std::memcpy(dst + r * row, static_cast<const std::byte*>(data.raw()) + idx[b * kBatch + r] * row, row);
          },
          8);
      cuda::memcpy_async(dev, dst, batch_bytes, cuda::CopyKind::HostToDevice, stage.copy_stream());
      done[k].record(stage.copy_stream());
    }
    stage.copy_stream().synchronize();
  });
  std::printf("| cudaMemcpyAsync loop, pinned (link ceiling) | - | %.0f | %.1f | %.2f |\n", memcpy_rate, memcpy_rate * mb / 1e3,
              memcpy_rate / probe_rate);
  std::printf("| bare probe: %d gather threads + 4 pinned buffers | %d | %.0f | %.1f | 1.00 |\n", probe_threads, probe_threads,
              probe_rate, probe_rate * mb / 1e3);
  std::fflush(stdout);

  // One ferry row: the loader over the workload with `configure` applied, delivering on cuda:0.
  auto ferry_row = [&](const std::string& label, int workers, auto&& configure) {
    DataLoaderOptions o;
    o.batch_size = kBatch;
    o.sampler = std::make_shared<RandomSampler>(static_cast<std::size_t>(w.samples), 3, true, batches * kBatch);
    o.num_workers = workers;
    o.persistent_workers = true;
    o.device = 0;
    o.pinned_memory_limit = std::size_t{4} << 30;
    o.gather = Gather::Host;  // the host path (workers + pin thread); bench_gather measures the device gather
    configure(o);
    DataLoader loader(TensorDataset({data}), o);
    std::size_t rows = 0;
    const double r = rate(batches, [&] {
      for (auto& b : loader) rows += static_cast<std::size_t>(b[0].size(0));
      loader.stream()->synchronize();
    });
    std::printf("| ferry, device=0, %s | %d | %.0f | %.1f | %.2f |\n", label.c_str(), workers, r, r * mb / 1e3, r / probe_rate);
    if (rows == 0) std::printf("(no batches?)\n");
    std::fflush(stdout);
  };
  for (auto mode : {DataLoaderOptions::PinMode::Direct, DataLoaderOptions::PinMode::Copy})
    for (int prefetch : g_prefetch)
      for (int workers : worker_counts)
        ferry_row(std::string("pin_mode=") + (mode == DataLoaderOptions::PinMode::Direct ? "direct" : "copy") +
                      ", prefetch_factor=" + std::to_string(prefetch),
                  workers, [&](DataLoaderOptions& o) {
                    o.prefetch_factor = prefetch;
                    o.pin_mode = mode;
                    o.pin_threads = 8;
                  });
  // Few workers, each batch's samples fetched by several threads (intra_batch_threads), as the
  // probe spreads one batch over its threads.
  for (auto [workers, intra] : g_split)
    ferry_row("direct, intra_batch_threads=" + std::to_string(intra), workers,
              [intra = intra](DataLoaderOptions& o) { o.intra_batch_threads = intra; });
  cuda::device_free(dev);
}

#ifdef FERRY_BENCH_TRAINING_LOOP
// A training loop: each step runs `step_ms` of GPU work on the batch's stream, then synchronizes
// (as reading the loss does). The same loop without a loader sets the baseline time per step;
// GPU waiting for data = 1 - steps * baseline / wall.
void training_loop(double step_ms, int steps, int workers, int intra) {
  constexpr std::int64_t kBatch = 256;
  Tensor data = Tensor::empty(DType::UInt8, {2048, 3, 224, 224});
  std::memset(data.raw(), 3, data.nbytes());
  DataLoaderOptions o;
  o.batch_size = kBatch;
  o.sampler = std::make_shared<RandomSampler>(2048, 5, true, static_cast<std::size_t>(steps + 10) * kBatch);
  o.num_workers = workers;
  o.intra_batch_threads = intra;
  o.device = 0;
  o.pin_mode = DataLoaderOptions::PinMode::Direct;
  o.gather = Gather::Host;
  DataLoader loader(TensorDataset({data}), o);
  // Baseline: the identical step with no data loading.
  const double base_ms = test::step_alone_ms(loader.stream()->native(), step_ms, 30);
  const double wall = test::training_loop_ms(loader, step_ms, steps);
  std::printf("| ferry, device=0, direct, %d workers x intra_batch_threads=%d | %.2f ms | %d | %.0f ms | %.2f%% |\n", workers,
              intra, base_ms, steps, wall, 100.0 * std::max(0.0, 1.0 - steps * base_ms / wall));
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::size_t batches = 200;
  std::vector<int> workers{6, 8, 10, 12};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--batches") batches = std::stoul(argv[i + 1]);
    if (a == "--prefetch") {
      g_prefetch.clear();
      std::stringstream ss(argv[i + 1]);
      std::string tok;
      while (std::getline(ss, tok, ',')) g_prefetch.push_back(std::stoi(tok));
    }
    if (a == "--workers") {
      workers.clear();
      std::stringstream ss(argv[i + 1]);
      std::string tok;
      while (std::getline(ss, tok, ',')) workers.push_back(std::stoi(tok));
    }
  }
  if (!cuda::available()) {
    std::printf("bench_pin: no GPU (%s)\n", cuda::unavailable_reason().c_str());
    return 0;
  }
  std::printf("# bench_pin — %u hardware threads, median of 5 passes\n", std::thread::hardware_concurrency());
  run({"(a) 3x224x224 uint8", DType::UInt8, {3, 224, 224}, 2048}, batches, workers);
  run({"(b) 784 float32", DType::Float32, {784}, 60000}, batches * 20, workers);
#ifdef FERRY_BENCH_TRAINING_LOOP
  std::printf("\n## training loop: (a) batches, GPU work per step, synchronize each step\n\n");
  std::printf("| loader | step alone (baseline) | steps | wall | GPU waiting for data |\n|---|---:|---:|---:|---:|\n");
  for (double ms : {10.0, 20.0})
    for (auto [workers, intra] : {std::pair{8, 1}, std::pair{1, 8}})
      for (int rep = 0; rep < 3; ++rep) training_loop(ms, 200, workers, intra);
#endif
  return 0;
}
