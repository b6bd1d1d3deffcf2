// The threads of this process (Linux: /proc/self/task), for the probes that sample or signal them,
// and every thread's stack on demand, for the watchdogs that report a hang.
#pragma once

#include <dirent.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace ferry::bench {

/// The thread ids of every thread of the process now.
inline std::vector<pid_t> thread_ids() {
  std::vector<pid_t> out;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') out.push_back(static_cast<pid_t>(std::atoi(e->d_name)));
    ::closedir(d);
  }
  return out;
}

namespace detail {
// A signal handler: only async-signal-safe calls (backtrace is, once loaded: install_stack_dump).
inline void write_own_stack(int) {
  void* frames[40];
  const int n = ::backtrace(frames, 40);
  char head[40] = "== thread ";
  char digits[20];
  int d = 0;
  for (long tid = ::syscall(SYS_gettid); d == 0 || tid > 0; tid /= 10) digits[d++] = static_cast<char>('0' + tid % 10);
  std::size_t len = 10;
  while (d > 0) head[len++] = digits[--d];
  head[len++] = '\n';
  if (::write(2, head, len) < 0) return;
  ::backtrace_symbols_fd(frames, n, 2);
}
}  // namespace detail

/// Makes SIGUSR2 write the receiving thread's stack to stderr (link with -rdynamic for names).
/// Call it once, early: it loads the unwinder now rather than in the handler.
inline void install_stack_dump() {
  void* warm[2];
  ::backtrace(warm, 2);
  struct sigaction sa {};
  sa.sa_handler = detail::write_own_stack;
  ::sigaction(SIGUSR2, &sa, nullptr);
}

/// Every other thread's name and stack to stderr, one thread at a time (install_stack_dump first).
inline void dump_every_stack() {
  const long self = ::syscall(SYS_gettid);
  for (pid_t tid : thread_ids()) {
    if (tid == self) continue;
    char path[64], name[32] = {0};
    std::snprintf(path, sizeof path, "/proc/self/task/%ld/comm", static_cast<long>(tid));
    if (FILE* f = std::fopen(path, "r")) {
      if (!std::fgets(name, sizeof name, f)) name[0] = 0;
      std::fclose(f);
    }
    std::fprintf(stderr, "-- %ld %s", static_cast<long>(tid), name);
    std::fflush(stderr);
    ::syscall(SYS_tgkill, ::getpid(), tid, SIGUSR2);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace ferry::bench
