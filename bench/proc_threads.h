// The threads of this process (Linux: /proc/self/task), for the probes that sample or signal them.
#pragma once

#include <dirent.h>
#include <sys/types.h>

#include <cstdlib>
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

}  // namespace ferry::bench
