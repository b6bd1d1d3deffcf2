// bench_gather: the device gather (Note [Device gather], ferry/pinning/gather.h) beside the host
// path and the link, in one run, for bench_pin's workloads:
//   (a) 3x224x224 uint8 rows (38.5 MB batches of 256), 2,048 rows in memory;
//   (b) 784 float32 rows (0.8 MB batches), 60,000 rows;
//   (a) with the transforms image rows usually need: 224x224x3 uint8 HWC images (IdxDataset over
//   tensors) flipped at random, to float32 CHW, normalized; the device gather runs them in its
//   kernel (RowTransform) and reads 38.5 MB a batch, where the host path's workers transform
//   and the link carries the 154 MB of floats.
// Rows are drawn with replacement (as in bench_pin). Each row of the table: median of --runs
// timed passes after a warm-up pass; batches count once the consumer stream has them; busy cores =
// the process's CPU time (user + system) over the passes' wall time.
//   link: one pinned batch copied back to back (cudaMemcpyAsync), the ceiling;
//   host path: gather = Host (workers copy rows into pinned blocks, the copy engine moves them);
//   device gather: gather = Device, 0 workers (and 1, which starts none: the pin thread writes
//   the indices either way).
// Then a training loop: each step a fixed amount of arithmetic on every SM (about --step-ms alone)
// on the loader's stream, then a synchronize. GPU waiting = 1 - steps x (step alone) / wall; the
// step's slowdown = its GPU time (events) in the loop over its GPU time alone, which shows what
// sharing the SMs with the gather kernel costs. --loop-reps N runs the loop's rows N times (2);
// --loop-only 1 leaves out the (a) and (b) rows and the host path's loops.
// Usage: bench_gather [--batches 200] [--runs 5] [--workers-a 8] [--workers-b 10] [--workers-t 14] [--step-ms 10]
//                     [--steps 200] [--loop-reps 2] [--loop-only 0|1]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cpu_time.h"
#include "ferry/ferry.h"
#include "kernels.h"
#include "work_step.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::size_t batches = 200;
  int runs = 5, workers_a = 8, workers_b = 10, workers_t = 14, steps = 200, loop_reps = 2;
  double step_ms = 10;
  bool loop_only = false;  // --loop-only 1: the transformed rows and the device gather's training loops only
};

using bench::cpu_seconds;

struct Rate {
  double per_second = 0, cores = 0;
  double consumer = 0;  // of `cores`: the calling thread's (the consumer's), the rest being the loader's threads and CUDA's
};

template <class F>
Rate measure(std::size_t batches, int runs, F&& pass) {
  pass();
  std::vector<double> r;
  const double c0 = cpu_seconds(), m0 = bench::thread_cpu_seconds();
  const auto w0 = Clock::now();
  for (int k = 0; k < runs; ++k) {
    const auto t0 = Clock::now();
    pass();
    r.push_back(static_cast<double>(batches) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double wall = std::chrono::duration<double>(Clock::now() - w0).count();
  std::sort(r.begin(), r.end());
  return {r[r.size() / 2], (cpu_seconds() - c0) / wall, (bench::thread_cpu_seconds() - m0) / wall};
}

Tensor filled(DType dtype, Shape shape) {
  Tensor t = Tensor::empty(dtype, std::move(shape));
  for (std::size_t i = 0; i < t.nbytes(); ++i) static_cast<std::uint8_t*>(t.raw())[i] = static_cast<std::uint8_t>(i * 131 + 7);
  return t;
}

DataLoaderOptions loader_options(std::size_t rows, std::size_t batches, Gather g, int workers) {
  DataLoaderOptions o;
  o.batch_size = 256;
  o.sampler = std::make_shared<RandomSampler>(rows, 3, true, batches * 256);
  o.num_workers = workers;
  o.persistent_workers = workers > 0;
  o.device = 0;
  o.gather = g;
  o.pinned_memory_limit = std::size_t{4} << 30;
  return o;
}

void workload(const char* name, const Tensor& data, std::size_t batches, int workers, const Args& a) {
  const std::size_t rows = static_cast<std::size_t>(data.size(0)), row = data.nbytes() / rows, batch_bytes = row * 256;
  const double mb = static_cast<double>(batch_bytes) / 1e6;
  std::printf("\n## %s: batch 256 = %.2f MB, %zu batches a pass\n\n", name, mb, batches);
  std::printf(
      "| pipeline | workers | batches/s | GB/s | of the link | busy CPU cores | of which the consumer's thread | the rest "
      "(loader, CUDA) | batches a launch |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  // The link: one pinned batch, copied back to back.
  auto pool = std::make_shared<PinnedPool>(PinnedPoolOptions{});
  DeviceStage stage({}, pool);
  Storage pinned = pool->allocate(batch_bytes);
  std::memcpy(pinned.data(), data.raw(), batch_bytes);
  void* dev = nullptr;
  {
    cuda::DeviceGuard g(0);
    dev = cuda::device_alloc(batch_bytes);
  }
  const Rate link = measure(batches, a.runs, [&] {
    for (std::size_t b = 0; b < batches; ++b)
      cuda::memcpy_async(dev, pinned.data(), batch_bytes, cuda::CopyKind::HostToDevice, stage.copy_stream());
    stage.copy_stream().synchronize();
  });
  std::printf(
      "| cudaMemcpyAsync of one pinned batch, back to back (the link) | - | %.0f | %.1f | 1.00 | %.2f | %.2f | %.2f | - |\n",
      link.per_second, link.per_second * mb / 1e3, link.cores, link.consumer, link.cores - link.consumer);
  auto row_of = [&](const char* label, Gather g, int w, int pin_depth = 0) {
    DataLoaderOptions o = loader_options(rows, batches, g, w);
    if (pin_depth) o.pin_depth = pin_depth;
    DataLoader loader(TensorDataset({data}), o);
    const Rate r = measure(batches, a.runs, [&] {
      for (auto& b : loader) (void)b;
      loader.stream()->synchronize();
    });
    const DeviceStageStats d = loader.device_stage()->stats();
    char per_launch[32] = "-";
    if (d.gather_launches) std::snprintf(per_launch, sizeof per_launch, "%.2f", double(d.batches) / double(d.gather_launches));
    std::printf("| ferry, %s | %d | %.0f | %.1f | %.2f | %.2f | %.2f | %.2f | %s |\n", label, w, r.per_second,
                r.per_second * mb / 1e3, r.per_second / link.per_second, r.cores, r.consumer, r.cores - r.consumer, per_launch);
    std::fflush(stdout);
  };
  row_of("host path (gather = Host)", Gather::Host, workers);
  row_of("device gather (gather = Device)", Gather::Device, 0);
  row_of("device gather (gather = Device)", Gather::Device, 1);
  if (batch_bytes < (std::size_t{4} << 20)) row_of("device gather, pin_depth 14", Gather::Device, 0, 14);
  cuda::device_free(dev);
}

// (a) with flip + to_float + normalize: the host path's workers against the gather kernel.
ImageTransform imagenet() {
  return ImageTransform().horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
}

void transformed(const Tensor& hwc, std::size_t batches, const Args& a) {
  const std::size_t rows = static_cast<std::size_t>(hwc.size(0)), row = hwc.nbytes() / rows;
  const IdxDataset ds(hwc, Tensor::zeros(DType::Int64, {hwc.size(0)}), {imagenet()});
  const double read_mb = static_cast<double>(row) * 256 / 1e6, out_mb = read_mb * 4;
  std::printf(
      "\n## (a) with flip + to_float + normalize: %.1f MB of uint8 read, %.1f MB of float32 delivered a batch, %zu batches a "
      "pass\n\n| pipeline | workers | batches/s | images/s | busy CPU cores |\n|---|---:|---:|---:|---:|\n",
      read_mb, out_mb, batches);
  auto row_of = [&](const char* label, Gather g, int w) {
    DataLoaderOptions o = loader_options(rows, batches, g, w);
    o.pinned_memory_limit = std::size_t{8} << 30;
    DataLoader loader(ds, o);
    const Rate r = measure(batches, a.runs, [&] {
      for (auto& b : loader) (void)b;
      loader.stream()->synchronize();
    });
    std::printf("| ferry, %s | %d | %.0f | %.0f | %.2f |\n", label, w, r.per_second, r.per_second * 256, r.cores);
    std::fflush(stdout);
  };
  row_of("host path: workers flip and normalize (gather = Host)", Gather::Host, a.workers_t);
  row_of("device gather, transforms in its kernel (gather = Device)", Gather::Device, 0);
}

template <class Dataset>
void training_loop(const Dataset& ds, const char* what, Gather g, int workers, const Args& a) {
  DataLoaderOptions o = loader_options(ds.size(), static_cast<std::size_t>(a.steps + 20), g, workers);
  o.pinned_memory_limit = std::size_t{8} << 30;
  DataLoader loader(ds, o);
  cuda::DeviceGuard guard(0);
  const bench::WorkStep work = bench::WorkStep::calibrate(*loader.stream(), a.step_ms);
  const double alone_wall = work.alone_wall_ms, alone_gpu = work.alone_gpu_ms;
  cuda::Event e0 = cuda::Event::create(0, true), e1 = cuda::Event::create(0, true);
  // The loop.
  double loop_gpu = 0;
  int step = 0;
  auto t0 = Clock::now();
  for (auto& b : loader) {
    (void)b;
    if (step == 10) t0 = Clock::now();
    if (step == a.steps + 10) break;
    e0.record(*loader.stream());
    work.launch(*loader.stream());
    e1.record(*loader.stream());
    loader.stream()->synchronize();
    if (step >= 10) loop_gpu += cuda::Event::elapsed_ms(e0, e1);
    ++step;
  }
  const double wall = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const int steps = step - 10;
  std::printf("| %s, ferry, %s | %d | %.2f ms | %.2f ms | %d | %.2f%% | %+.2f%% |\n", what,
              g == Gather::Host ? "host path" : "device gather", workers, alone_wall, alone_gpu, steps,
              100.0 * std::max(0.0, 1.0 - steps * alone_wall / wall), 100.0 * (loop_gpu / steps / alone_gpu - 1.0));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--batches")
      a.batches = std::stoul(v);
    else if (k == "--runs")
      a.runs = std::stoi(v);
    else if (k == "--workers-a")
      a.workers_a = std::stoi(v);
    else if (k == "--workers-b")
      a.workers_b = std::stoi(v);
    else if (k == "--workers-t")
      a.workers_t = std::stoi(v);
    else if (k == "--step-ms")
      a.step_ms = std::stod(v);
    else if (k == "--steps")
      a.steps = std::stoi(v);
    else if (k == "--loop-only")
      a.loop_only = v == "1";
    else if (k == "--loop-reps")
      a.loop_reps = std::stoi(v);
    else {
      std::fprintf(stderr, "bench_gather: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (!cuda::available()) {
    std::printf("bench_gather: no GPU (%s)\n", cuda::unavailable_reason().c_str());
    return 0;
  }
  std::printf("# bench_gather — %u hardware threads, median of %d passes\n", std::thread::hardware_concurrency(), a.runs);
  const Tensor wa = filled(DType::UInt8, {2048, 3, 224, 224});
  const Tensor wb = filled(DType::Float32, {60000, 784});
  if (!a.loop_only) {
    workload("(a) 3x224x224 uint8", wa, a.batches, a.workers_a, a);
    workload("(b) 784 float32", wb, a.batches * 20, a.workers_b, a);
  }
  const Tensor hwc = filled(DType::UInt8, {2048, 224, 224, 3});
  transformed(hwc, a.batches / 4, a);
  std::printf(
      "\n## training loop: (a) batches, plain and flipped + normalized to float32, a step of fixed arithmetic on every SM, "
      "synchronize each step\n\n");
  std::printf(
      "| loader | workers | step alone (wall) | step alone (GPU) | steps | GPU waiting for data | step's GPU time vs. alone |\n"
      "|---|---:|---:|---:|---:|---:|---:|\n");
  const TensorDataset rows({wa});
  const IdxDataset images(hwc, Tensor::zeros(DType::Int64, {hwc.size(0)}), {imagenet()});
  for (int rep = 0; rep < a.loop_reps; ++rep) {
    if (!a.loop_only) training_loop(rows, "(a)", Gather::Host, a.workers_a, a);
    training_loop(rows, "(a)", Gather::Device, 0, a);
    if (!a.loop_only) training_loop(images, "(a) + flip + normalize", Gather::Host, a.workers_t, a);
    training_loop(images, "(a) + flip + normalize", Gather::Device, 0, a);
  }
  return 0;
}
