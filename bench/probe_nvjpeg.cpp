// probe_nvjpeg — what nvJPEG's batched decode (hardware backend) does to the thread that calls it
// and to its stream's order, alone and beside a training step that fills the SMs; the facts
// behind Note [Decode threads] in pinning/gpu_decode.cu. Prints, for batches of the JPEGs in DIR:
//   1. alone, one thread: the call's time on the host, and what a stream synchronize adds after it;
//   2. ordering: ~25 ms of work and a memset of the output queued on the stream, then the decode:
//      whose bytes the output holds (the memset's: the decode wrote before work queued ahead of it);
//   3. beside a step (a thread keeps a stream busy with 20 ms launches of --blocks-per-sm blocks
//      of 256 threads a SM; 0 kernels: no step) with 1 to 3 threads decoding, each its own
//      handle, state and stream: images/s, the call's time, and the step's time meanwhile.
// With --alone-only it stops after 1 and prints the stream IDs (cudaStreamGetId) of the decode's
// stream and the legacy default stream, to read beside a profiler's kernel list.
// With --ceiling it prints only the JPEG engines' ceiling: 1 to 8 host threads, each with its own
// handle, state, stream and output, decoding batches of 64 to 512 back to back (decode only, no
// step): images/s and busy cores (the process's CPU time over the wall time) for each.
// With --blocking-sync the device's context is made with cudaDeviceScheduleBlockingSync (a host
// thread waiting on the device sleeps instead of spinning): how much of a decoding thread's busy
// core is a wait.
// With --backend hardware-device the bitstreams are in device memory (NVJPEG_BACKEND_HARDWARE_DEVICE,
// copied there once), and --flags N passes nvJPEG flags to every handle (1: HW_DECODE_NO_PIPELINE):
// what each does to the decoding threads' busy cores. --batches and --thread-counts (comma lists)
// narrow the ceiling's rows. --backend gpu-hybrid decodes on the SMs (Huffman on the GPU) instead of
// the JPEG engines; --thread-backends hardware,gpu-hybrid gives the ceiling's threads backends in
// turn (both at once: what the SMs add to the engines, and on how many cores).
// With --race KIND it only decodes, on --threads host threads (2; each its own handle, state and
// stream) back to back for --seconds, while one more thread does KIND in a loop: "none",
// "free-host" (cudaHostAlloc and cudaFreeHost of 16 MiB), "free-device" (cudaMalloc and cudaFree of
// 64 MiB), "state" (nvjpegJpegStateCreate and nvjpegJpegStateDestroy on a handle of its own). With
// --signal-us N a thread sends SIGPROF to every thread every N us. A watchdog prints "STALL" when
// no batch is decoded for 10 s and ends the process with status 3: which of those the hardware
// decode survives beside it (Note [Decode threads]).
// Usage: probe_nvjpeg DIR [--batch 256] [--blocks-per-sm 4] [--no-ordering] [--alone-only]
//                         [--ceiling [--seconds 1.5] [--batches 64,128,256,512] [--thread-counts 1,2,3,4,6,8]]
//                         [--blocking-sync] [--backend hardware|hardware-device|gpu-hybrid] [--flags 0]
//                         [--thread-backends B,B,...]
//                         [--race KIND [--threads 2] [--seconds 1.5] [--signal-us 0]]
#include <cuda_runtime.h>
#include <nvjpeg.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"
#include "proc_threads.h"

using Clock = std::chrono::steady_clock;
static double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
#define CK(x)                                                   \
  do {                                                          \
    cudaError_t e_ = (x);                                       \
    if (e_ != cudaSuccess) {                                    \
      std::printf("CUDA %s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                             \
    }                                                           \
  } while (0)
#define NJ(x)                                      \
  do {                                             \
    nvjpegStatus_t s_ = (x);                       \
    if (s_ != NVJPEG_STATUS_SUCCESS) {             \
      std::printf("nvJPEG %s: %d\n", #x, (int)s_); \
      std::exit(1);                                \
    }                                              \
  } while (0)

static void launch_work(cudaStream_t s, long long iters, int blocks_per_sm) { ferry::test::launch_work(s, iters, blocks_per_sm); }
static double cpu_seconds() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_stime.tv_sec + (r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1e-6;
}

struct Image {
  std::vector<unsigned char> bytes;
  int w = 0, h = 0;
};

static nvjpegBackend_t g_backend = NVJPEG_BACKEND_HARDWARE;  // --backend
static std::vector<nvjpegBackend_t> g_thread_backends;       // --thread-backends: the ceiling's thread t takes [t % size]

static bool parse_backend(const std::string& b, nvjpegBackend_t* out) {
  if (b == "hardware")
    *out = NVJPEG_BACKEND_HARDWARE;
  else if (b == "hardware-device")
    *out = NVJPEG_BACKEND_HARDWARE_DEVICE;
  else if (b == "gpu-hybrid")
    *out = NVJPEG_BACKEND_GPU_HYBRID;
  else
    return false;
  return true;
}
static const char* backend_name(nvjpegBackend_t b) {
  return b == NVJPEG_BACKEND_HARDWARE_DEVICE ? "hardware-device" : b == NVJPEG_BACKEND_GPU_HYBRID ? "gpu-hybrid" : "hardware";
}
static unsigned g_flags = 0;  // --flags

static std::vector<int> int_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    v.push_back(static_cast<int>(std::strtol(p, &end, 10)));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

static std::atomic<long> g_signals{0};
static void on_signal(int) { g_signals.fetch_add(1, std::memory_order_relaxed); }

struct Decoder {
  nvjpegHandle_t h{};
  nvjpegJpegState_t st{};
  cudaStream_t s{};
  unsigned char* out = nullptr;
  std::vector<nvjpegImage_t> imgs;
  nvjpegOutputFormat_t fmt;
  ~Decoder() {
    cudaStreamSynchronize(s);
    cudaFree(out);
    nvjpegJpegStateDestroy(st);
  }
  Decoder(const std::vector<Image>& batch, bool own_handle, nvjpegHandle_t shared, nvjpegOutputFormat_t f = NVJPEG_OUTPUT_RGBI,
          bool high = false, nvjpegBackend_t backend = g_backend)
      : fmt(f) {
    if (own_handle)
      NJ(nvjpegCreateEx(backend, nullptr, nullptr, g_flags, &h));
    else
      h = shared;
    NJ(nvjpegJpegStateCreate(h, &st));
    int lo = 0, hi = 0;
    cudaDeviceGetStreamPriorityRange(&lo, &hi);
    CK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, high ? hi : lo));
    size_t total = 0;
    for (auto& im : batch) total += (size_t)im.w * im.h * 3;
    CK(cudaMalloc(&out, total));
    imgs.resize(batch.size());
    size_t off = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      imgs[i] = {};
      imgs[i].channel[0] = out + off;
      imgs[i].pitch[0] = batch[i].w * 3;
      if (fmt == NVJPEG_OUTPUT_YUV) {
        for (int c = 0; c < 3; ++c) {
          imgs[i].channel[c] = out + off + (size_t)c * batch[i].w * batch[i].h;
          imgs[i].pitch[c] = batch[i].w;
        }
      }
      off += (size_t)batch[i].w * batch[i].h * 3;
    }
    NJ(nvjpegDecodeBatchedInitialize(h, st, (int)batch.size(), 1, fmt));
  }
  double decode(const std::vector<const unsigned char*>& data, const std::vector<size_t>& len) {  // call time, ms
    auto t = Clock::now();
    NJ(nvjpegDecodeBatched(h, st, data.data(), len.data(), imgs.data(), s));
    return ms_since(t);
  }
};

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: probe_nvjpeg DIR [--batch 256] [--blocks-per-sm 4] [--no-ordering]\n");
    return 2;
  }
  int B = 256, bps = 4;
  bool ordering = true, alone_only = false, ceiling = false, blocking = false;
  double seconds = 1.5;
  std::string race;
  std::vector<int> batches{64, 128, 256, 512}, thread_counts{1, 2, 3, 4, 6, 8};
  int race_threads = 2;
  long signal_us = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--batch" && i + 1 < argc)
      B = std::atoi(argv[++i]);
    else if (a == "--blocks-per-sm" && i + 1 < argc)
      bps = std::atoi(argv[++i]);
    else if (a == "--no-ordering")
      ordering = false;
    else if (a == "--alone-only")
      alone_only = true;
    else if (a == "--ceiling")
      ceiling = true;
    else if (a == "--seconds" && i + 1 < argc)
      seconds = std::atof(argv[++i]);
    else if (a == "--blocking-sync")
      blocking = true;
    else if (a == "--race" && i + 1 < argc)
      race = argv[++i];
    else if (a == "--threads" && i + 1 < argc)
      race_threads = std::atoi(argv[++i]);
    else if (a == "--signal-us" && i + 1 < argc)
      signal_us = std::atol(argv[++i]);
    else if (a == "--batches" && i + 1 < argc)
      batches = int_list(argv[++i]);
    else if (a == "--thread-counts" && i + 1 < argc)
      thread_counts = int_list(argv[++i]);
    else if (a == "--flags" && i + 1 < argc)
      g_flags = static_cast<unsigned>(std::atoi(argv[++i]));
    else if ((a == "--backend" || a == "--thread-backends") && i + 1 < argc) {
      std::string list = argv[++i];
      for (std::size_t at = 0; at <= list.size();) {
        const std::size_t comma = std::min(list.find(',', at), list.size());
        nvjpegBackend_t b;
        if (!parse_backend(list.substr(at, comma - at), &b)) {
          std::fprintf(stderr, "probe_nvjpeg: %s takes hardware, hardware-device or gpu-hybrid, not %s\n", a.c_str(),
                       list.c_str());
          return 2;
        }
        if (a == "--backend")
          g_backend = b;
        else
          g_thread_backends.push_back(b);
        at = comma + 1;
      }
    }
  }
  auto positive = [](const std::vector<int>& v) { return !v.empty() && *std::min_element(v.begin(), v.end()) > 0; };
  if (!positive(batches) || !positive(thread_counts)) {
    std::fprintf(stderr, "probe_nvjpeg: --batches and --thread-counts take comma lists of positive numbers\n");
    return 2;
  }
  if (!race.empty() && race != "none" && race != "free-host" && race != "free-device" && race != "state") {
    std::fprintf(stderr, "probe_nvjpeg: --race takes none, free-host, free-device or state, not %s\n", race.c_str());
    return 2;
  }
  if (blocking) CK(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));  // before the context exists
  CK(cudaSetDevice(0));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  nvjpegHandle_t shared;
  NJ(nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, 0, &shared));
  std::vector<Image> files;
  for (auto& e : std::filesystem::recursive_directory_iterator(argv[1])) {
    if (e.path().extension() != ".jpg") continue;
    std::ifstream f(e.path(), std::ios::binary);
    Image im;
    im.bytes.assign(std::istreambuf_iterator<char>(f), {});
    int n = 0;
    nvjpegChromaSubsampling_t sub;
    int w[4], h[4];
    if (nvjpegGetImageInfo(shared, im.bytes.data(), im.bytes.size(), &n, &sub, w, h) != NVJPEG_STATUS_SUCCESS) continue;
    im.w = w[0];
    im.h = h[0];
    files.push_back(std::move(im));
  }
  if (files.empty()) {
    std::fprintf(stderr, "probe_nvjpeg: no JPEG nvJPEG can read under %s\n", argv[1]);
    return 1;
  }
  if (ceiling) B = *std::max_element(batches.begin(), batches.end());  // smaller batches take its first images
  std::vector<Image> batch;
  for (int i = 0; i < B; ++i) batch.push_back(files[i % files.size()]);
  // pinned copies of the bytes, as ferry's workers give them
  size_t bytes = 0;
  for (auto& im : batch) bytes += im.bytes.size();
  unsigned char* pinned;
  CK(cudaHostAlloc(&pinned, bytes, 0));
  std::vector<const unsigned char*> data;
  std::vector<size_t> len;
  size_t off = 0;
  for (auto& im : batch) {
    std::memcpy(pinned + off, im.bytes.data(), im.bytes.size());
    data.push_back(pinned + off);
    len.push_back(im.bytes.size());
    off += im.bytes.size();
  }
  if (!g_thread_backends.empty() &&
      (g_backend == NVJPEG_BACKEND_HARDWARE_DEVICE ||
       std::count(g_thread_backends.begin(), g_thread_backends.end(), NVJPEG_BACKEND_HARDWARE_DEVICE))) {
    std::fprintf(stderr, "probe_nvjpeg: --thread-backends takes host-input backends only\n");
    return 2;
  }
  if (g_backend == NVJPEG_BACKEND_HARDWARE_DEVICE) {  // the bitstreams in device memory, copied once
    unsigned char* on_device = nullptr;
    CK(cudaMalloc(&on_device, bytes));
    CK(cudaMemcpy(on_device, pinned, bytes, cudaMemcpyHostToDevice));
    for (auto& p : data) p = on_device + (p - pinned);
  }
  std::string backends = backend_name(g_backend);
  if (!g_thread_backends.empty()) {
    backends = "by thread:";
    for (nvjpegBackend_t b : g_thread_backends) backends += std::string(" ") + backend_name(b);
  }
  std::printf("# probe_nvjpeg: %zu files, batch %d, %.1f KB an image, %d SMs%s, backend %s, flags %u\n", files.size(), B,
              bytes / 1024.0 / B, sms, blocking ? ", blocking sync" : "", backends.c_str(), g_flags);
  if (!race.empty()) {
    // Decodes back to back on race_threads threads beside one thread doing `race` in a loop.
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGPROF, &sa, nullptr);
    std::vector<Decoder*> decs;
    for (int t = 0; t < race_threads; ++t) decs.push_back(new Decoder(batch, true, nullptr));
    for (auto* d : decs) {
      d->decode(data, len);
      CK(cudaStreamSynchronize(d->s));
    }
    std::atomic<bool> stop{false};
    std::atomic<long> decoded{0}, races{0};
    std::atomic<Clock::rep> last{Clock::now().time_since_epoch().count()};
    std::vector<std::thread> ts;
    for (int t = 0; t < race_threads; ++t)
      ts.emplace_back([&, t] {
        cudaSetDevice(0);
        while (!stop.load()) {
          decs[t]->decode(data, len);
          CK(cudaStreamSynchronize(decs[t]->s));
          ++decoded;
          last = Clock::now().time_since_epoch().count();
        }
      });
    ts.emplace_back([&] {
      cudaSetDevice(0);
      nvjpegHandle_t own = nullptr;
      if (race == "state") NJ(nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, 0, &own));
      while (!stop.load()) {
        if (race == "free-host") {
          void* p = nullptr;
          CK(cudaHostAlloc(&p, 16 << 20, cudaHostAllocPortable));
          std::memset(p, 1, 4096);
          CK(cudaFreeHost(p));
        } else if (race == "free-device") {
          void* p = nullptr;
          CK(cudaMalloc(&p, 64 << 20));
          CK(cudaFree(p));
        } else if (race == "state") {
          nvjpegJpegState_t st = nullptr;
          NJ(nvjpegJpegStateCreate(own, &st));
          NJ(nvjpegJpegStateDestroy(st));
        }
        ++races;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
    if (signal_us > 0)
      ts.emplace_back([&] {
        const pid_t self = static_cast<pid_t>(::syscall(SYS_gettid)), pid = ::getpid();
        const std::vector<pid_t> tids = ferry::bench::thread_ids();  // every thread is made by now
        while (!stop.load()) {
          for (pid_t id : tids)
            if (id != self) ::syscall(SYS_tgkill, pid, id, SIGPROF);
          std::this_thread::sleep_for(std::chrono::microseconds(signal_us));
        }
      });
    const auto t0 = Clock::now();
    while (ms_since(t0) < seconds * 1000) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const double idle = std::chrono::duration<double>(Clock::now() - Clock::time_point(Clock::duration(last.load()))).count();
      if (idle > 10) {
        std::printf("race %s, %d threads, signals every %ld us: STALL after %.1f s (%ld batches, %ld of the race, %ld signals)\n",
                    race.c_str(), race_threads, signal_us, ms_since(t0) / 1000 - idle, decoded.load(), races.load(),
                    g_signals.load());
        std::fflush(stdout);
        std::_Exit(3);
      }
    }
    stop = true;
    for (auto& t : ts) t.join();
    std::printf("race %s, %d threads, signals every %ld us: no stall in %.0f s (%ld batches, %ld of the race, %ld signals)\n",
                race.c_str(), race_threads, signal_us, ms_since(t0) / 1000, decoded.load(), races.load(), g_signals.load());
    for (auto* d : decs) delete d;
    return 0;
  }
  if (ceiling) {
    // The engines' ceiling: T threads, each its own handle, state, stream and output, decoding
    // back to back for `seconds`; nothing else on the GPU.
    std::printf("\n| batch | host threads | images/s | busy cores | images/s a busy core |\n|---:|---:|---:|---:|---:|\n");
    for (int b : batches) {
      const std::vector<Image> sub(batch.begin(), batch.begin() + b);
      const std::vector<const unsigned char*> sub_data(data.begin(), data.begin() + b);
      const std::vector<size_t> sub_len(len.begin(), len.begin() + b);
      for (int threads : thread_counts) {
        std::vector<Decoder*> decs;
        for (int t = 0; t < threads; ++t)
          decs.push_back(new Decoder(sub, true, nullptr, NVJPEG_OUTPUT_RGBI, false,
                                     g_thread_backends.empty() ? g_backend : g_thread_backends[t % g_thread_backends.size()]));
        for (auto* d : decs) {
          d->decode(sub_data, sub_len);
          CK(cudaStreamSynchronize(d->s));
        }
        if (b == batches.front() && threads == thread_counts.front()) {  // the output's checksum, to compare backends by
          size_t total = 0;
          for (auto& im : sub) total += (size_t)im.w * im.h * 3;
          std::vector<unsigned char> host(total);
          CK(cudaMemcpy(host.data(), decs[0]->out, total, cudaMemcpyDeviceToHost));
          unsigned long long sum = 1469598103934665603ull;
          for (unsigned char c : host) sum = (sum ^ c) * 1099511628211ull;
          std::printf("output of batch %d: %zu bytes, FNV-1a %016llx\n", b, total, sum);
        }
        std::atomic<bool> stop{false};
        std::atomic<long> images{0};
        std::vector<long> by_thread(static_cast<std::size_t>(threads), 0);
        const double c0 = cpu_seconds();
        const auto t0 = Clock::now();
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t)
          ts.emplace_back([&, t] {
            cudaSetDevice(0);
            while (!stop.load()) {
              decs[t]->decode(sub_data, sub_len);
              CK(cudaStreamSynchronize(decs[t]->s));
              images += b;
              by_thread[static_cast<std::size_t>(t)] += b;
            }
          });
        std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
        stop = true;
        for (auto& t : ts) t.join();
        const double wall = ms_since(t0) / 1000.0, cores = (cpu_seconds() - c0) / wall;
        const double rate = images.load() / wall;
        std::string split;
        if (!g_thread_backends.empty())
          for (long n : by_thread)
            split += (split.empty() ? " (by thread: " : " / ") + std::to_string(static_cast<long>(n / wall));
        if (!split.empty()) split += ")";
        std::printf("| %d | %d | %.0f%s | %.2f | %.0f |\n", b, threads, rate, split.c_str(), cores, rate / std::max(cores, 1e-9));
        std::fflush(stdout);
        for (auto* d : decs) delete d;
      }
    }
    return 0;
  }

  // 1. Alone: the call's time on the host, and what is left for a stream synchronize.
  Decoder d0(batch, false, shared);
  for (int i = 0; i < 3; ++i) {
    d0.decode(data, len);
    CK(cudaStreamSynchronize(d0.s));
  }
  {
    double call = 0, sync = 0;
    const int n = 10;
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      call += d0.decode(data, len);
      auto t = Clock::now();
      CK(cudaStreamSynchronize(d0.s));
      sync += ms_since(t);
    }
    double wall = ms_since(t0);
    std::printf("alone, 1 thread: call %.2f ms, then sync %.2f ms a batch; %.0f images/s\n", call / n, sync / n,
                n * B * 1000.0 / wall);
  }
  if (alone_only) {
    unsigned long long id = 0, legacy = 0;
    CK(cudaStreamGetId(d0.s, &id));
    CK(cudaStreamGetId(cudaStreamLegacy, &legacy));
    std::printf("stream IDs: the decode's %llu, the legacy default stream %llu\n", id, legacy);
    return 0;
  }
  // 2. Ordering: 60 ms of work, then a memset of the output to 0xAB on the stream, then the decode.
  if (ordering) {
    int out_of_order = 0;
    for (int k = 0; k < 5; ++k) {
      CK(cudaMemset(d0.out, 0, 16));
      CK(cudaDeviceSynchronize());
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventRecord(e0, d0.s);
      launch_work(d0.s, 3000000, 4);
      CK(cudaMemsetAsync(d0.out, 0xAB, 16, d0.s));
      auto t = Clock::now();
      double call = d0.decode(data, len);
      double after = ms_since(t);
      CK(cudaStreamSynchronize(d0.s));
      cudaEventRecord(e1, d0.s);
      cudaEventSynchronize(e1);
      float gpu = 0;
      cudaEventElapsedTime(&gpu, e0, e1);
      unsigned char first[16];
      CK(cudaMemcpy(first, d0.out, 16, cudaMemcpyDeviceToHost));
      bool memset_last = true;
      for (int i = 0; i < 16; ++i) memset_last &= first[i] == 0xAB;
      out_of_order += memset_last;
      std::printf("ordering %d: work+memset queued (%.1f ms GPU in all); decode call %.2f ms (%.2f); output %s\n", k, gpu, call,
                  after, memset_last ? "is the memset's (decode wrote BEFORE the queued memset)" : "is the decode's");
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
    }
    std::printf("ordering: decode's write overtaken by work queued before it: %d of 5\n", out_of_order);
  }
  // 3. Beside a step: a thread keeps a stream full of work kernels (kernels of `step_ms / kernels`).
  cudaStream_t step_s;
  CK(cudaStreamCreateWithFlags(&step_s, cudaStreamNonBlocking));
  long long iters = 100000;
  for (int k = 0; k < 3; ++k) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0, step_s);
    launch_work(step_s, iters, bps);
    cudaEventRecord(e1, step_s);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    iters = (long long)(iters * 20.0 / ms);
  }
  struct Variant {
    const char* name;
    nvjpegOutputFormat_t fmt;
    bool high;
  };
  for (Variant v : {Variant{"RGBI", NVJPEG_OUTPUT_RGBI, false}, Variant{"YUV", NVJPEG_OUTPUT_YUV, false},
                    Variant{"RGBI, high-priority stream", NVJPEG_OUTPUT_RGBI, true}}) {
    std::vector<Decoder*> decs;
    for (int t = 0; t < 3; ++t) decs.push_back(new Decoder(batch, true, nullptr, v.fmt, v.high));
    for (auto* d : decs) {
      d->decode(data, len);
      CK(cudaStreamSynchronize(d->s));
    }
    for (int kernels : {0, 1, 40}) {
      for (int threads : {1, 2, 3}) {
        if (kernels == 0 && threads > 2) continue;
        std::atomic<bool> stop{false};
        std::atomic<long> steps{0};
        std::thread stepper([&] {
          cudaSetDevice(0);
          while (kernels > 0 && !stop) {
            for (int k = 0; k < kernels; ++k) launch_work(step_s, iters / kernels, bps);
            cudaStreamSynchronize(step_s);
            ++steps;
          }
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        const int per = 8;
        long s0 = steps;
        auto t0 = Clock::now();
        std::vector<std::thread> ts;
        std::vector<double> calls(threads, 0);
        for (int t = 0; t < threads; ++t)
          ts.emplace_back([&, t] {
            cudaSetDevice(0);
            for (int i = 0; i < per; ++i) {
              calls[t] += decs[t]->decode(data, len);
              cudaStreamSynchronize(decs[t]->s);
            }
          });
        for (auto& t : ts) t.join();
        double wall = ms_since(t0);
        long s1 = steps;
        stop = true;
        stepper.join();
        double call = 0;
        for (double c : calls) call += c;
        std::printf(
            "blocks/SM %d, %s: step of %d kernels (20 ms alone), %d threads: %.0f images/s, call %.2f ms; steps done meanwhile "
            "%.1f ms each\n",
            bps, v.name, kernels, threads, threads * per * B * 1000.0 / wall, call / (threads * per),
            s1 > s0 ? wall / (s1 - s0) : 0.0);
      }
    }
    for (auto* d : decs) delete d;
  }
  return 0;
}
