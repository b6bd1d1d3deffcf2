// Main of the GPU suite: without a usable CUDA device it reports the suite skipped (exit 77, CTest's
// SKIP_RETURN_CODE), unless FERRY_REQUIRE_GPU=1, when a missing GPU is a failure.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "ferry/pinning/cuda.h"

int main(int argc, char** argv) {
  if (!ferry::cuda::available()) {
    const char* req = std::getenv("FERRY_REQUIRE_GPU");
    const bool required = req && std::string(req) == "1";
    std::printf("GPU suite %s: %s\n", required ? "FAILED (FERRY_REQUIRE_GPU=1)" : "skipped",
                ferry::cuda::unavailable_reason().c_str());
    return required ? 1 : 77;
  }
  return Catch::Session().run(argc, argv);
}
