// A preload for diagnosing a stuck process: SIGUSR1 prints the receiving thread's stack (glibc
// backtrace_symbols_fd) to stderr and exits. Used by scripts/npy-register-probe.sh.
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

static void print_stack(int sig) {
  (void)sig;
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  _exit(134);
}

__attribute__((constructor)) static void install(void) { signal(SIGUSR1, print_stack); }
