// stress_gpu_decode: GPU-decode loaders made and destroyed one after another, each left in the
// middle of its epoch (by default), to find decodes that never end. Each loader is an ImageFolder of DIR's
// JPEGs decoded on the GPU (RandomResizedCrop 224 + flip + normalize, float32), batch 256,
// 4 workers, --threads decode threads; the consumer takes --batches batches (the whole epoch where
// it has fewer: 41 batches for the 10,260 images of the 500x375 set) and drops the loader.
// A watchdog reports a batch that takes more than --stall-s seconds, with the loader and batch it
// stopped at and every thread's name and stack (stderr), and then leaves the process as it is
// (for a debugger) until --stall-exit-s more seconds have passed, when it ends it with status 3.
// Prints one line per loader (its batches and wall time) and a last line: "loaders N, batches M,
// stalls 0" or the stall.
// With --prof-us N, a process-wide profiling timer (ITIMER_PROF) signals the process every N us
// of its CPU time, as a sampling profiler's does; with --signal-us N, a thread sends SIGPROF to
// every other thread of the process every N us (threads made since are found every 50 ms), as a
// profiler sampling each thread does. The handler only counts.
// With --timeout-ms N the loaders have that timeout: a decode that stops then fails its batch with
// TimeoutError after 2N ms, and the loader's destruction gives up on it after 10 s (Note [A decode
// that never returns]); the run counts it ("TIMEOUT" lines) and goes on with the next loader. Give
// --stall-s more than 2N ms + 10 s then.
// Usage: stress_gpu_decode --images DIR [--loaders 20] [--batches 40] [--threads 2] [--stall-s 15]
//        [--stall-exit-s 60] [--prof-us 0] [--signal-us 0] [--timeout-ms 0]
#include <signal.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"
#include "proc_threads.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {
std::atomic<long> g_signals{0};
void on_prof(int) { g_signals.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

int main(int argc, char** argv) {
  std::string images;
  int loaders = 20, batches = 40, threads = 2;
  double stall_s = 15, stall_exit_s = 60;
  long prof_us = 0, signal_us = 0, timeout_ms = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--images")
      images = argv[i + 1];
    else if (k == "--loaders")
      loaders = std::atoi(argv[i + 1]);
    else if (k == "--batches")
      batches = std::atoi(argv[i + 1]);
    else if (k == "--threads")
      threads = std::atoi(argv[i + 1]);
    else if (k == "--stall-s")
      stall_s = std::atof(argv[i + 1]);
    else if (k == "--stall-exit-s")
      stall_exit_s = std::atof(argv[i + 1]);
    else if (k == "--prof-us")
      prof_us = std::atol(argv[i + 1]);
    else if (k == "--signal-us")
      signal_us = std::atol(argv[i + 1]);
    else if (k == "--timeout-ms")
      timeout_ms = std::atol(argv[i + 1]);
    else {
      std::fprintf(stderr, "stress_gpu_decode: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (images.empty() || !cuda::available()) {
    std::fprintf(stderr, "stress_gpu_decode: needs --images DIR and a GPU\n");
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = on_prof;
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGPROF, &sa, nullptr);
  if (prof_us > 0) {
    itimerval spec{{0, prof_us}, {0, prof_us}};
    ::setitimer(ITIMER_PROF, &spec, nullptr);
  }
  bench::install_stack_dump();
  std::atomic<Clock::rep> last{Clock::now().time_since_epoch().count()};  // the last batch (or loader's end)
  const auto mark = [&] { last = Clock::now().time_since_epoch().count(); };
  std::atomic<int> at_loader{0}, at_batch{0};
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const double idle = std::chrono::duration<double>(Clock::now() - Clock::time_point(Clock::duration(last.load()))).count();
      if (idle < stall_s) continue;
      std::printf("STALL: loader %d, batch %d: no batch for %.0f s (pid %d, %ld profiling signals)\n", at_loader.load(),
                  at_batch.load(), idle, static_cast<int>(::getpid()), g_signals.load());
      std::fflush(stdout);
      bench::dump_every_stack();
      std::this_thread::sleep_for(std::chrono::duration<double>(stall_exit_s));
      std::_Exit(3);
    }
  });
  std::thread storm;
  if (signal_us > 0)
    storm = std::thread([&] {
      const pid_t self = static_cast<pid_t>(::syscall(SYS_gettid)), pid = ::getpid();
      std::vector<pid_t> tids;
      auto found = Clock::now() - std::chrono::seconds(1);
      while (!done.load()) {
        if (Clock::now() - found > std::chrono::milliseconds(50)) {
          tids = bench::thread_ids();
          found = Clock::now();
        }
        for (pid_t t : tids)
          if (t != self) ::syscall(SYS_tgkill, pid, t, SIGPROF);
        std::this_thread::sleep_for(std::chrono::microseconds(signal_us));
      }
    });
  struct EndHelpers {  // the watchdog and the storm end with main, however it leaves
    std::atomic<bool>& done;
    std::thread& watchdog;
    std::thread& storm;
    ~EndHelpers() {
      done = true;
      watchdog.join();
      if (storm.joinable()) storm.join();
    }
  } end_helpers{done, watchdog, storm};
  ImageFolderOptions fo;
  fo.transform.random_resized_crop(224, 224).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                    {0.229f, 0.224f, 0.225f});
  fo.decode = ImageFolderOptions::Decode::Gpu;
  ImageFolder folder(images, fo);
  long total = 0, timeouts = 0;
  for (int l = 0; l < loaders; ++l) {
    at_loader = l;
    const auto t0 = Clock::now();
    DataLoaderOptions o;
    o.batch_size = 256;
    o.num_workers = 4;
    o.device = 0;
    o.gpu_decode_threads = threads;
    o.shuffle = true;
    o.seed = static_cast<std::uint64_t>(l);
    o.timeout = std::chrono::milliseconds(timeout_ms);
    int n = 0;
    try {
      DataLoader loader(folder, o);
      for (auto& b : loader) {
        (void)b;
        ++n;
        at_batch = n;
        mark();
        if (n == batches) break;
      }
    } catch (const TimeoutError& e) {  // the loader is gone by now (its destruction bounded)
      ++timeouts;
      std::printf("TIMEOUT: loader %d, batch %d: %s\n", l, n, e.what());
    }  // left mid-epoch: the loader ends its workers, pin thread and decoder here
    mark();
    total += n;
    std::printf("loader %d: %d batches, %.2f s\n", l, n, std::chrono::duration<double>(Clock::now() - t0).count());
    std::fflush(stdout);
  }
  std::printf("loaders %d, batches %ld, stalls 0, timeouts %ld, %ld profiling signals\n", loaders, total, timeouts,
              g_signals.load());
  return 0;
}
