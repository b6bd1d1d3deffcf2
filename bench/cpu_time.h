// The process's CPU time, for the benchmarks' busy-cores columns (CPU seconds over wall seconds).
#pragma once

#include <sys/resource.h>
#include <time.h>

namespace ferry::bench {

/// User + system CPU seconds of every thread of the process so far.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

/// CPU seconds of the calling thread so far.
inline double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
}

}  // namespace ferry::bench
