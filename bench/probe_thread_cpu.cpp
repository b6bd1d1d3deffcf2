// probe_thread_cpu: where each thread of a device-gather loader spends its CPU time. Runs the
// device gather with 0 workers over bench_gather's rows, (a) 3x224x224 uint8 (2,048 rows) and
// (b) 784 float32 (60,000 rows), batch 256, the consumer taking and dropping each batch, while
// every thread of the process is sampled on its own CPU clock (a POSIX timer a thread, on the
// thread's CPU-time clock, signalling that thread): each sample is the thread's stack. Prints,
// per thread (by name) and workload, its busy cores and the functions its samples were in:
// innermost (where the time is spent), the first frame in ferry (who spent it) and each of ferry's
// functions anywhere on the stack (hidden ones named from the library's symbol table). The kernel
// checks a thread's CPU clock at its ticks (250 a second here), so a thread busy all the time gives
// that many samples a second; busy cores come from the threads' CPU clocks themselves.
// Without a GPU, the same loader delivers pageable batches on the host (to try the probe).
// With --images DIR it probes GPU decode instead: an ImageFolder of DIR's JPEGs, decode=gpu
// (RandomResizedCrop 224 + flip + normalize), batch 256, 4 workers, with 1 and then 2 decode threads.
// With --epoch-batches N it probes (b) in epochs of N batches (bench_gather's passes are epochs of
// 4,000), where threads start and end with each epoch: samples then come from one process-wide
// timer on the process's CPU clock (ITIMER_PROF, delivered to the thread that ran) and are grouped
// by thread name; each epoch is split into its start (begin() to the first batch in hand), its
// middle and its end (the last batch in hand to the loop's end and the stream synchronized), each
// with the process's CPU time. Rows: 0 workers over bench_gather's sampler; a plan with no draws
// (index i mod 60,000: what the plan's random draws cost); no plan made ahead
// (prefetch_next_epoch = false); 1 worker, persistent (bench_gather's 1-worker row).
// Usage: probe_thread_cpu [--seconds 4] [--interval-us 200] [--images DIR] [--epoch-batches N]
#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cpu_time.h"
#include "proc_threads.h"
#include "ferry/ferry.h"

using namespace ferry;

namespace {

constexpr int kDepth = 24;
constexpr std::size_t kMaxSamples = 1 << 18;

struct Sample {
  pid_t tid;
  char name[16];
  int depth;
  void* frames[kDepth];
};

Sample* g_samples = nullptr;
std::atomic<std::size_t> g_count{0};
std::atomic<bool> g_on{false};

void on_prof(int, siginfo_t*, void*) {
  if (!g_on.load(std::memory_order_relaxed)) return;
  const std::size_t k = g_count.fetch_add(1, std::memory_order_relaxed);
  if (k >= kMaxSamples) return;
  Sample& s = g_samples[k];
  s.tid = static_cast<pid_t>(::syscall(SYS_gettid));
  ::prctl(PR_GET_NAME, s.name, 0, 0, 0);
  s.depth = ::backtrace(s.frames, kDepth);
}

// The CPU-time clock of thread `tid` (Linux: CPUCLOCK_SCHED of a thread, as glibc makes it).
clockid_t thread_clock(pid_t tid) { return static_cast<clockid_t>((~static_cast<unsigned>(tid) << 3) | 6u); }

std::string thread_name(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/comm");
  std::string n;
  std::getline(in, n);
  return n + " (" + std::to_string(tid) + ")";
}

// The symbols of the shared object at `path` from its symbol table (`nm`, which also lists the
// hidden functions dladdr cannot name): start offset -> name, read once per object.
const std::map<std::uintptr_t, std::string>& symbol_table(const std::string& path) {
  static std::map<std::string, std::map<std::uintptr_t, std::string>> tables;
  auto [it, fresh] = tables.try_emplace(path);
  if (!fresh) return it->second;
  const std::string cmd = "nm -C --defined-only '" + path + "' 2>/dev/null";
  if (FILE* f = ::popen(cmd.c_str(), "r")) {
    char line[4096];
    while (std::fgets(line, sizeof line, f)) {
      char* end = nullptr;
      const unsigned long long off = std::strtoull(line, &end, 16);
      if (end == line || !end || std::strlen(end) < 4 || (end[1] != 't' && end[1] != 'T' && end[1] != 'W' && end[1] != 'w'))
        continue;
      std::string name = end + 3;
      while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
      it->second[static_cast<std::uintptr_t>(off)] = name;
    }
    ::pclose(f);
  }
  return it->second;
}

std::string symbol(void* addr) {
  Dl_info info{};
  if (!::dladdr(addr, &info) || !info.dli_fname) return "?";
  std::string lib = info.dli_fname;
  const std::string path = lib;
  lib = lib.substr(lib.rfind('/') + 1);
  std::string name;
  if (info.dli_sname) {
    int status = 0;
    char* dem = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    name = status == 0 && dem ? dem : info.dli_sname;
    std::free(dem);
  } else if (path.find("libferry") != std::string::npos) {  // a hidden function: from the symbol table
    const auto& table = symbol_table(path);
    const auto off = reinterpret_cast<std::uintptr_t>(addr) - reinterpret_cast<std::uintptr_t>(info.dli_fbase);
    auto it = table.upper_bound(off);
    if (it != table.begin()) name = std::prev(it)->second;
  }
  if (name.empty()) return lib;
  if (name.size() > 110) name = name.substr(0, 110) + "...";
  return lib + ": " + name;
}

bool in_ferry(const std::string& s) { return s.find("libferry") != std::string::npos || s.find("ferry::") != std::string::npos; }

double cpu_of(pid_t tid) {
  timespec ts{};
  if (::clock_gettime(thread_clock(tid), &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The functions `ss`'s samples were in: innermost (where the time is spent) and the first frame in
// ferry (who spent it), the ten most frequent of each.
void summarize(const std::vector<const Sample*>& ss) {
  std::map<std::string, int> leaf, owner, inclusive;
  for (const Sample* s : ss) {
    // frames[0] is the handler, [1] the signal trampoline.
    if (s->depth > 2) ++leaf[symbol(s->frames[2])];
    std::vector<std::string> seen;
    for (int f = 2; f < s->depth; ++f) {
      std::string sym = symbol(s->frames[f]);
      if (!in_ferry(sym) || std::find(seen.begin(), seen.end(), sym) != seen.end()) continue;
      ++inclusive[sym];
      seen.push_back(std::move(sym));
    }
    std::string who = "(no ferry frame)";
    for (int f = 2; f < s->depth; ++f) {
      const std::string sym = symbol(s->frames[f]);
      if (in_ferry(sym)) {
        who = sym;
        break;
      }
    }
    ++owner[who];
  }
  const auto top = [&](const char* title, const std::map<std::string, int>& m) {
    std::vector<std::pair<int, std::string>> v;
    for (const auto& [k, c] : m) v.emplace_back(c, k);
    std::sort(v.rbegin(), v.rend());
    std::printf("%s:\n", title);
    for (std::size_t i = 0; i < std::min<std::size_t>(v.size(), &m == &inclusive ? 25 : 10); ++i)
      std::printf("  %5.1f%%  %s\n", 100.0 * v[i].first / static_cast<double>(ss.size()), v[i].second.c_str());
  };
  top("innermost frame", leaf);
  top("first frame in ferry", owner);
  top("ferry's functions anywhere on the stack (a sample counts once for each)", inclusive);
}

void report(const char* what, double seconds, const std::vector<pid_t>& tids, const std::map<pid_t, double>& cpu) {
  const std::size_t n = std::min(g_count.load(), kMaxSamples);
  std::map<pid_t, std::vector<const Sample*>> by;
  for (std::size_t k = 0; k < n; ++k) by[g_samples[k].tid].push_back(&g_samples[k]);
  std::printf("\n## %s (%.1f s; samples on each thread's CPU clock, which the kernel checks at its ticks)\n", what, seconds);
  double all = 0;
  for (pid_t tid : tids) all += cpu.at(tid);
  std::printf("\nthe process: %.2f busy cores over %zu threads (threads of fewer than 20 samples not listed below)\n",
              all / seconds, tids.size());
  for (pid_t tid : tids) {
    auto it = by.find(tid);
    if (it == by.end() || it->second.size() < 20) continue;
    const auto& ss = it->second;
    const bool consumer = tid == static_cast<pid_t>(::getpid());
    std::printf("\n### %s%s: %.2f busy cores, %zu samples\n\n", thread_name(tid).c_str(), consumer ? ", the consumer" : "",
                cpu.at(tid) / seconds, ss.size());
    summarize(ss);
  }
}

// Runs `loader` (one long epoch) for `seconds` under the sampler and prints each thread's report.
template <class Loader>
void probe(const char* what, Loader& loader, double seconds, long interval_us, bool gpu) {
  auto it = loader.begin();
  for (int k = 0; k < 200; ++k) ++it;  // warm: threads started, buffers made
  std::vector<pid_t> tids = bench::thread_ids();
  std::vector<timer_t> timers;
  for (pid_t tid : tids) {
    sigevent ev{};
    ev.sigev_notify = SIGEV_THREAD_ID;
    ev.sigev_signo = SIGPROF;
    ev._sigev_un._tid = tid;
    timer_t t{};
    if (::timer_create(thread_clock(tid), &ev, &t) != 0) continue;
    itimerspec spec{};
    spec.it_interval.tv_nsec = interval_us * 1000;
    spec.it_value.tv_nsec = interval_us * 1000;
    ::timer_settime(t, 0, &spec, nullptr);
    timers.push_back(t);
  }
  std::map<pid_t, double> cpu;
  for (pid_t tid : tids) cpu[tid] = cpu_of(tid);
  g_count = 0;
  g_on = true;
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t batches = 0;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::duration<double>(seconds) && it != loader.end()) {
    ++it;
    ++batches;
  }
  g_on = false;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (pid_t tid : tids) cpu[tid] = cpu_of(tid) - cpu[tid];
  for (timer_t t : timers) ::timer_delete(t);
  std::printf("\n%s: %.0f batches/s\n", what, batches / s);
  report(what, s, tids, cpu);
  if (gpu) loader.stream()->synchronize();
}

void run(const char* what, const Tensor& data, double seconds, long interval_us, bool gpu) {
  DataLoaderOptions o;
  o.batch_size = 256;
  // One long epoch (300,000 batches, more than the probe takes), its plan made before the
  // measurement, and none made ahead for the next.
  o.sampler = std::make_shared<RandomSampler>(static_cast<std::size_t>(data.size(0)), 3, true, std::size_t{256} * 300000);
  o.prefetch_next_epoch = false;
  if (gpu) {
    o.device = 0;
    o.gather = Gather::Device;
  }
  DataLoader loader(TensorDataset({data}), o);
  probe(what, loader, seconds, interval_us, gpu);
}

// index i mod n for i < size: a plan that draws nothing.
class ModuloSampler final : public Sampler {
 public:
  ModuloSampler(std::size_t n, std::size_t size) : n_(n), size_(size) {}
  std::size_t size() const override { return size_; }
  std::vector<std::size_t> indices(std::uint64_t) const override {
    std::vector<std::size_t> v(size_);
    for (std::size_t i = 0; i < size_; ++i) v[i] = i % n_;
    return v;
  }

 private:
  std::size_t n_, size_;
};

// `data` in epochs of `epoch_batches` batches for `seconds` (after two epochs of warm-up): each
// epoch's start, middle and end with the process's CPU time, and the samples by thread name.
void run_epochs(const char* what, const Tensor& data, std::size_t epoch_batches, double seconds, long interval_us, bool gpu,
                std::shared_ptr<const Sampler> sampler, bool ahead, int workers) {
  using C = std::chrono::steady_clock;
  DataLoaderOptions o;
  o.batch_size = 256;
  o.sampler = std::move(sampler);
  o.prefetch_next_epoch = ahead;
  o.num_workers = workers;
  o.persistent_workers = workers > 0;
  if (gpu) {
    o.device = 0;
    o.gather = Gather::Device;
  }
  DataLoader loader(TensorDataset({data}), o);
  struct Phase {
    double wall = 0, cpu = 0;
  };
  Phase phase[3];  // start, middle, end
  std::size_t epochs = 0, batches = 0;
  long faults = 0;  // the process's minor page faults over the measured epochs
  const auto minor_faults = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  };
  const auto epoch = [&](bool measured) {
    const long f0 = minor_faults();
    const double c0 = bench::cpu_seconds();
    const auto w0 = C::now();
    double c1 = 0, c2 = 0;
    C::time_point w1, w2;
    std::size_t n = 0;
    {
      auto it = loader.begin();
      (void)(it != loader.end());  // the first batch, in hand
      c1 = bench::cpu_seconds();
      w1 = C::now();
      c2 = c1;
      w2 = w1;
      for (; it != loader.end(); ++it) {
        if (++n == epoch_batches) {
          c2 = bench::cpu_seconds();
          w2 = C::now();
        }
      }
    }  // the iterator ends the epoch
    if (gpu) loader.stream()->synchronize();
    const double c3 = bench::cpu_seconds();
    const auto w3 = C::now();
    if (!measured) return;
    const auto sec = [](C::duration d) { return std::chrono::duration<double>(d).count(); };
    phase[0].wall += sec(w1 - w0), phase[0].cpu += c1 - c0;
    phase[1].wall += sec(w2 - w1), phase[1].cpu += c2 - c1;
    phase[2].wall += sec(w3 - w2), phase[2].cpu += c3 - c2;
    ++epochs;
    batches += n;
    faults += minor_faults() - f0;
  };
  epoch(false);
  epoch(false);
  itimerval spec{};
  spec.it_interval.tv_usec = interval_us;
  spec.it_value.tv_usec = interval_us;
  g_count = 0;
  g_on = true;
  ::setitimer(ITIMER_PROF, &spec, nullptr);
  const auto t0 = C::now();
  while (C::now() - t0 < std::chrono::duration<double>(seconds)) epoch(true);
  const itimerval off{};
  ::setitimer(ITIMER_PROF, &off, nullptr);
  g_on = false;
  double wall = 0, cpu = 0;
  for (const Phase& p : phase) wall += p.wall, cpu += p.cpu;
  std::printf(
      "\n## %s: epochs of %zu batches, %zu epochs in %.1f s\n\n%.0f batches/s, %.2f busy cores (the process's CPU time over the "
      "epochs' wall time), %.0f minor page faults an epoch\n\n| part of an epoch | ms an epoch | CPU ms an epoch | busy cores |\n"
      "|---|---:|---:|---:|\n",
      what, epoch_batches, epochs, wall, static_cast<double>(batches) / wall, cpu / wall,
      static_cast<double>(faults) / static_cast<double>(epochs));
  const char* names[3] = {"start: begin() to the first batch in hand", "middle: to the last batch in hand",
                          "end: the epoch ended, the stream synchronized"};
  for (int k = 0; k < 3; ++k)
    std::printf("| %s | %.3f | %.3f | %.2f |\n", names[k], 1e3 * phase[k].wall / static_cast<double>(epochs),
                1e3 * phase[k].cpu / static_cast<double>(epochs), phase[k].wall > 0 ? phase[k].cpu / phase[k].wall : 0.0);
  const std::size_t n = std::min(g_count.load(), kMaxSamples);
  std::map<std::string, std::vector<const Sample*>> by;
  for (std::size_t k = 0; k < n; ++k) by[g_samples[k].name].push_back(&g_samples[k]);
  std::printf(
      "\n%zu samples on the process's CPU clock, by thread name (a thread's busy cores: its share of the samples times "
      "the process's; names of fewer than 20 samples not listed):\n",
      n);
  std::vector<std::pair<std::size_t, std::string>> order;
  for (const auto& [name, ss] : by) order.emplace_back(ss.size(), name);
  std::sort(order.rbegin(), order.rend());
  for (const auto& [count, name] : order) {
    if (count < 20) continue;
    std::printf("\n### %s: %.2f busy cores, %zu samples\n\n", name.c_str(),
                cpu / wall * static_cast<double>(count) / static_cast<double>(n), count);
    summarize(by[name]);
  }
  std::fflush(stdout);
}

// GPU decode of the JPEGs under `dir` (RandomResizedCrop 224 + flip + normalize, float32), batch
// 256, 4 workers, `threads` decode threads.
void run_images(const std::string& dir, int threads, double seconds, long interval_us) {
  ImageFolderOptions fo;
  fo.transform.random_resized_crop(224, 224).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                    {0.229f, 0.224f, 0.225f});
  fo.decode = ImageFolderOptions::Decode::Gpu;
  ImageFolder folder(dir, fo);
  DataLoaderOptions o;
  o.batch_size = 256;
  o.num_workers = 4;
  o.device = 0;
  o.gpu_decode_threads = threads;
  o.sampler = std::make_shared<RandomSampler>(folder.size(), 3, true, std::size_t{256} * 300000);
  o.prefetch_next_epoch = false;
  DataLoader loader(folder, o);
  const std::string what =
      "GPU decode, " + std::to_string(threads) + " decode thread" + (threads == 1 ? "" : "s") + ", 4 workers";
  probe(what.c_str(), loader, seconds, interval_us, true);
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 4;
  long interval_us = 200;
  std::string images;
  std::size_t epoch_batches = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--seconds")
      seconds = std::atof(argv[i + 1]);
    else if (k == "--interval-us")
      interval_us = std::atol(argv[i + 1]);
    else if (k == "--images")
      images = argv[i + 1];
    else if (k == "--epoch-batches")
      epoch_batches = static_cast<std::size_t>(std::atol(argv[i + 1]));
  }
  const bool gpu = cuda::available();
  g_samples = new Sample[kMaxSamples];
  void* warm[2];
  ::backtrace(warm, 2);  // loads the unwinder now, not in the handler
  struct sigaction sa {};
  sa.sa_sigaction = on_prof;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  ::sigaction(SIGPROF, &sa, nullptr);
  if (!images.empty()) {
    if (!gpu) {
      std::fprintf(stderr, "probe_thread_cpu: --images needs a GPU\n");
      return 1;
    }
    std::printf("# probe_thread_cpu — GPU decode of %s, batch 256; %u hardware threads\n", images.c_str(),
                std::thread::hardware_concurrency());
    for (int threads : {1, 2}) run_images(images, threads, seconds, interval_us);
    return 0;
  }
  std::printf("# probe_thread_cpu — %s, 0 workers, batch 256; %u hardware threads\n",
              gpu ? "device gather" : "no GPU: pageable batches on the host", std::thread::hardware_concurrency());
  Tensor b = Tensor::empty(DType::Float32, {60000, 784});
  std::memset(b.raw(), 1, b.nbytes());
  if (epoch_batches > 0) {
    const std::size_t draws = 256 * epoch_batches;
    run_epochs("(b) 784 float32, 0 workers", b, epoch_batches, seconds, interval_us, gpu,
               std::make_shared<RandomSampler>(60000, 3, true, draws), true, 0);
    run_epochs("(b), 0 workers, a plan that draws nothing (i mod 60,000)", b, epoch_batches, seconds, interval_us, gpu,
               std::make_shared<ModuloSampler>(60000, draws), true, 0);
    run_epochs("(b), 0 workers, prefetch_next_epoch = false", b, epoch_batches, seconds, interval_us, gpu,
               std::make_shared<RandomSampler>(60000, 3, true, draws), false, 0);
    run_epochs("(b), 1 worker, persistent", b, epoch_batches, seconds, interval_us, gpu,
               std::make_shared<RandomSampler>(60000, 3, true, draws), true, 1);
    return 0;
  }
  run("(b) 784 float32", b, seconds, interval_us, gpu);
  Tensor a = Tensor::empty(DType::UInt8, {2048, 3, 224, 224});
  std::memset(a.raw(), 7, a.nbytes());
  run("(a) 3x224x224 uint8", a, seconds, interval_us, gpu);
  return 0;
}
