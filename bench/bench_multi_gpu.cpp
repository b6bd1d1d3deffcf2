// bench_multi_gpu: batches per second on each GPU with one GPU busy and with several busy, and
// the training loop's GPU wait, for bench_pin's workloads and the image workload.
//
//   bench_multi_gpu --devices 0 | 0,1 [options]       one process: a loader and a consumer thread per device
//   torchrun --nproc-per-node 2 --no-python bench_multi_gpu [options]
//                                                     one process per GPU (device = LOCAL_RANK)
//
// Workloads (batch 256, delivered on the GPU, rows drawn with replacement as in bench_pin):
//   (a) 3x224x224 uint8 rows in memory (38.5 MB batches), --workers-a workers per GPU;
//   (b) 784 float32 rows (0.8 MB batches), --workers-b;
//   image: --photos DIR, RandomResizedCrop 224 + flip + normalize, GPU decode, --image-workers;
//   gather: (a) and (b) by the device gather (Note [Device gather]), 0 workers;
//   host: controls without the GPU: (a) collated into pageable memory (no pinning, no copy), and
//         host memcpy bandwidth with --workers-a threads;
//   loop: (a) batches into a loop of --step-ms GPU steps that synchronizes each step; GPU wait =
//         1 - steps x (the step alone) / wall.
// Every pass starts on all devices together (a barrier: threads, or one TCP round through rank 0
// for ranks); each row is the median of --runs passes after a warm-up pass. --cpu-slices K binds
// a rank to the local_rank-th of K equal slices of the CPUs it may use ("each rank with half the
// cores": K = 2, also for a rank alone).
#include <barrier>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>

#include "ferry/detail/numa.h"
#include "ferry/ferry.h"
#include "../examples/ddp/rendezvous.h"
#ifdef FERRY_BENCH_TRAINING_LOOP
#include "kernels.h"
#endif

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::vector<int> devices{0};
  int workers_a = 8, workers_b = 6, image_workers = 2, runs = 5, steps = 200, cpu_slices = 0;
  std::size_t batches = 100;
  double step_ms = 10;
  std::string photos, what = "a,gather,host,b,image,loop";
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// All participants start each pass together.
struct Sync {
  std::barrier<>* threads = nullptr;
  int rank = 0, world = 1;
  void operator()() const {
    if (threads) threads->arrive_and_wait();
    if (world > 1) {
      char byte = 1;
      ddp::exchange(&byte, 1, rank, world);
    }
  }
};

template <class L>
double rate(L& loader, const Sync& sync, int runs, double per_pass) {
  std::vector<double> r;
  for (int k = 0; k <= runs; ++k) {
    sync();
    const auto t0 = Clock::now();
    for (auto& b : loader) (void)b;
    if (loader.stream()) loader.stream()->synchronize();
    if (k > 0) r.push_back(per_pass / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(r);
}

// GB/s (bytes read + bytes written) of `threads` threads each copying its own 64 MiB, 8 times.
double memcpy_rate(int threads, const Sync& sync, int runs) {
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  constexpr int kReps = 8;
  std::vector<std::vector<char>> src(static_cast<std::size_t>(threads), std::vector<char>(kBytes, 1)),
      dst(static_cast<std::size_t>(threads), std::vector<char>(kBytes, 0));
  std::vector<double> r;
  for (int k = 0; k <= runs; ++k) {
    sync();
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        for (int rep = 0; rep < kReps; ++rep)
          std::memcpy(dst[static_cast<std::size_t>(t)].data(), src[static_cast<std::size_t>(t)].data(), kBytes);
      });
    for (auto& t : pool) t.join();
    if (k > 0) r.push_back(2.0 * kBytes * kReps * threads / 1e9 / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return median(r);
}

struct Result {
  std::string row;
  int device;
  double value;
  const char* unit;
};

Tensor workload_a() {
  static Tensor t = [] {
    Tensor d = Tensor::empty(DType::UInt8, {2048, 3, 224, 224});
    for (std::size_t i = 0; i < d.nbytes(); ++i) static_cast<std::uint8_t*>(d.raw())[i] = static_cast<std::uint8_t>(i * 131 + 7);
    return d;
  }();
  return t;
}
Tensor workload_b() {
  static Tensor t = [] {
    Tensor d = Tensor::empty(DType::Float32, {60000, 784});
    for (std::int64_t i = 0; i < d.numel(); ++i) d.data<float>()[i] = static_cast<float>(i % 255) / 255.0f;
    return d;
  }();
  return t;
}

DataLoaderOptions base(int device, int workers, std::size_t samples, std::size_t batches) {
  DataLoaderOptions o;
  o.batch_size = 256;
  o.sampler = std::make_shared<RandomSampler>(samples, 3, true, batches * 256);
  o.num_workers = workers;
  o.persistent_workers = true;
  o.device = device;
  o.pinned_memory_limit = std::size_t{4} << 30;
  o.gather = Gather::Host;  // the host path; the "gather" rows take the device gather
  return o;
}

// Everything one device does, in order; results appended to `out`.
void run_device(const Args& a, int device, const Sync& sync, std::vector<Result>& out) {
  auto want = [&](const char* w) { return ("," + a.what + ",").find(std::string(",") + w + ",") != std::string::npos; };
  if (want("a")) {
    DataLoader loader(TensorDataset({workload_a()}), base(device, a.workers_a, 2048, a.batches));
    out.push_back({"(a) 3x224x224 uint8, " + std::to_string(a.workers_a) + " workers", device,
                   rate(loader, sync, a.runs, static_cast<double>(a.batches)), "batches/s"});
    out.push_back({"(a) NUMA node of the loader", device, static_cast<double>(loader.stats().numa_node), "node"});
  }
  if (want("gather")) {
    // The device gather (Note [Device gather]): no worker copies, rows read by the GPU.
    DataLoaderOptions o = base(device, 0, 2048, a.batches);
    o.gather = Gather::Device;
    o.persistent_workers = false;
    DataLoader la(TensorDataset({workload_a()}), o);
    out.push_back({"(a) device gather, 0 workers", device, rate(la, sync, a.runs, static_cast<double>(a.batches)), "batches/s"});
    const std::size_t nb = a.batches * 20;
    DataLoaderOptions ob = base(device, 0, 60000, nb);
    ob.gather = Gather::Device;
    ob.persistent_workers = false;
    DataLoader lb(TensorDataset({workload_b()}), ob);
    out.push_back({"(b) device gather, 0 workers", device, rate(lb, sync, a.runs, static_cast<double>(nb)), "batches/s"});
  }
  if (want("host")) {
    // Controls, to tell the host's limits from the GPU path's: (a) collated by the same workers
    // into pageable memory with no GPU at all, and plain memcpy by as many threads.
    DataLoaderOptions o = base(device, a.workers_a, 2048, a.batches);
    o.device.reset();
    o.pin_memory = false;
    DataLoader loader(TensorDataset({workload_a()}), o);
    out.push_back({"(a) on the host alone: no pinning, no copy, " + std::to_string(a.workers_a) + " workers", device,
                   rate(loader, sync, a.runs, static_cast<double>(a.batches)), "batches/s"});
    out.push_back({"host memcpy, " + std::to_string(a.workers_a) + " threads of 64 MiB", device,
                   memcpy_rate(a.workers_a, sync, a.runs), "GB/s"});
  }
  if (want("b")) {
    const std::size_t nb = a.batches * 20;
    DataLoader loader(TensorDataset({workload_b()}), base(device, a.workers_b, 60000, nb));
    out.push_back({"(b) 784 float32, " + std::to_string(a.workers_b) + " workers", device,
                   rate(loader, sync, a.runs, static_cast<double>(nb)), "batches/s"});
  }
  if (want("image") && !a.photos.empty()) {
    ImageFolderOptions io;
    io.transform.random_resized_crop(224, 224).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                      {0.229f, 0.224f, 0.225f});
    io.decode = ImageFolderOptions::Decode::Gpu;
    ImageFolder images(a.photos, io);
    DataLoaderOptions o;
    o.batch_size = 256;
    o.shuffle = true;
    o.num_workers = a.image_workers;
    o.persistent_workers = true;
    o.device = device;
    o.pinned_memory_limit = std::size_t{8} << 30;
    const double n = static_cast<double>(images.size());
    DataLoader loader(std::move(images), o);
    out.push_back({"image, GPU decode, " + std::to_string(a.image_workers) + " workers", device,
                   rate(loader, sync, std::min(a.runs, 3), n), "images/s"});
  }
#ifdef FERRY_BENCH_TRAINING_LOOP
  if (want("loop")) {
    DataLoaderOptions o = base(device, a.workers_a, 2048, static_cast<std::size_t>(a.steps + 20));
    DataLoader loader(TensorDataset({workload_a()}), o);
    sync();
    const double base_ms = test::step_alone_ms(loader.stream()->native(), a.step_ms, 30);
    sync();
    const double wall = test::training_loop_ms(loader, a.step_ms, a.steps);
    out.push_back({"loop: (a) batches, " + std::to_string(static_cast<int>(a.step_ms)) + " ms steps, GPU waiting", device,
                   100.0 * std::max(0.0, 1.0 - a.steps * base_ms / wall), "%"});
  }
#endif
}

std::vector<int> list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) v.push_back(std::stoi(tok));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--devices")
      a.devices = list(v);
    else if (k == "--workers-a")
      a.workers_a = std::stoi(v);
    else if (k == "--workers-b")
      a.workers_b = std::stoi(v);
    else if (k == "--image-workers")
      a.image_workers = std::stoi(v);
    else if (k == "--runs")
      a.runs = std::stoi(v);
    else if (k == "--batches")
      a.batches = std::stoul(v);
    else if (k == "--steps")
      a.steps = std::stoi(v);
    else if (k == "--step-ms")
      a.step_ms = std::stod(v);
    else if (k == "--photos")
      a.photos = v;
    else if (k == "--what")
      a.what = v;
    else if (k == "--cpu-slices")
      a.cpu_slices = std::stoi(v);
    else {
      std::fprintf(stderr, "bench_multi_gpu: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (!cuda::available()) {
    std::printf("bench_multi_gpu: no GPU (%s)\n", cuda::unavailable_reason().c_str());
    return 0;
  }
  const DistributedEnv env = DistributedEnv::from_environment();
  if (a.cpu_slices > 0) {
    // This rank's slice of the CPUs it may use; threads started later inherit it.
    const std::vector<int> all = detail::allowed_cpus();
    const std::size_t k = static_cast<std::size_t>(a.cpu_slices), per = all.size() / k, s = env.local_rank % k;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (std::size_t i = s * per; i < (s + 1) * per; ++i) CPU_SET(all[i], &set);
    sched_setaffinity(0, sizeof set, &set);
  }
  std::vector<Result> results;
  const char* mode;
  std::size_t busy;
  if (env.distributed() || env.launcher != DistributedEnv::Launcher::None) {
    mode = "one process per GPU";
    busy = env.world_size;
    Sync sync{nullptr, static_cast<int>(env.rank), static_cast<int>(env.world_size)};
    run_device(a, static_cast<int>(env.local_rank), sync, results);
  } else {
    mode = "one process, a thread per GPU";
    busy = a.devices.size();
    std::barrier<> bar(static_cast<std::ptrdiff_t>(a.devices.size()));
    std::vector<std::vector<Result>> per(a.devices.size());
    std::vector<std::thread> threads;
    for (std::size_t d = 0; d < a.devices.size(); ++d)
      threads.emplace_back([&, d] { run_device(a, a.devices[d], Sync{&bar}, per[d]); });
    for (auto& t : threads) t.join();
    for (auto& p : per) results.insert(results.end(), p.begin(), p.end());
  }
  const std::string cpus = detail::format_cpu_list(detail::allowed_cpus());
  for (const Result& r : results)
    std::printf("| %s | %zu GPU%s busy | %s | cuda:%d | %.*f %s | CPUs %s |\n", mode, busy, busy == 1 ? "" : "s", r.row.c_str(),
                r.device, std::strcmp(r.unit, "%") == 0 ? 2 : 0, r.value, r.unit, cpus.c_str());
  std::fflush(stdout);
  return 0;
}
