// A program whose worker blocks forever: main() must still return its exit code (7), because the
// loader abandons the stuck worker instead of joining it. Run by test_faults.
#include <cstdio>

#include "ferry/ferry.h"

namespace {
struct BlocksForever {
  std::size_t size() const { return 16; }
  std::int64_t get(std::size_t i) const {
    if (i == 2) {
      std::mutex m;
      std::condition_variable cv;
      std::unique_lock l(m);
      cv.wait(l, [] { return false; });
    }
    return static_cast<std::int64_t>(i);
  }
};
}  // namespace

int main() {
  ferry::DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  o.timeout = std::chrono::milliseconds(100);
  ferry::DataLoader loader(BlocksForever{}, o);
  try {
    for (auto& b : loader) (void)b;
  } catch (const ferry::TimeoutError& e) {
    std::printf("%s\n", e.what());
    return 7;  // the loader is destroyed on the way out; the blocked worker is left behind
  }
  return 1;
}
