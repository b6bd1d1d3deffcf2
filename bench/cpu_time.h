// The process's CPU time, for the benchmarks' busy-cores columns (CPU seconds over wall seconds).
#pragma once

#include <sys/resource.h>

namespace ferry::bench {

/// User + system CPU seconds of every thread of the process so far.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace ferry::bench
