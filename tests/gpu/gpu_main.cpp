// Main of the GPU suite: without a usable CUDA device it reports the suite skipped (exit 77, CTest's
// SKIP_RETURN_CODE), unless FERRY_REQUIRE_GPU=1, when a missing GPU is a failure.
// `--needs-gpus N` (first argument; CTest's test_gpu_multi passes 2 with "[multi]") reports the
// selected cases skipped on a host of fewer than N devices, unless FERRY_REQUIRE_GPUS >= N, when
// that is a failure; the cases themselves fail without their devices, so a skip is never a pass.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ferry/pinning/cuda.h"

namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  int needs = 1;
  if (args.size() >= 3 && std::string(args[1]) == "--needs-gpus") {
    needs = std::atoi(args[2]);
    args.erase(args.begin() + 1, args.begin() + 3);
  }
  if (!ferry::cuda::available()) {
    const bool required = env_int("FERRY_REQUIRE_GPU") == 1 || env_int("FERRY_REQUIRE_GPUS") >= 1;
    std::printf("GPU suite %s: %s\n", required ? "FAILED (FERRY_REQUIRE_GPU=1)" : "skipped",
                ferry::cuda::unavailable_reason().c_str());
    return required ? 1 : 77;
  }
  if (ferry::cuda::device_count() < needs) {
    const bool required = env_int("FERRY_REQUIRE_GPUS") >= needs;
    std::printf("GPU cases %s: they need %d CUDA devices, this host has %d\n",
                required ? "FAILED (FERRY_REQUIRE_GPUS)" : "skipped", needs, ferry::cuda::device_count());
    return required ? 1 : 77;
  }
  return Catch::Session().run(static_cast<int>(args.size()), args.data());
}
