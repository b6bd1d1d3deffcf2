// The GPU benchmarks' training step: a fixed amount of arithmetic on every SM (tests/gpu/kernels.h),
// whose time grows when other kernels share the SMs, calibrated to a wall time and timed alone.
#pragma once

#include <algorithm>
#include <chrono>

#include "ferry/ferry.h"
#include "kernels.h"

namespace ferry::bench {

struct WorkStep {
  long long iters = 100000;  ///< dependent FMAs a thread, per launch
  int kernels = 1;           ///< launches a step
  int blocks_per_sm = 4;     ///< blocks of 256 threads a SM, a launch (8 fill an SM's threads)
  double alone_gpu_ms = 0;   ///< one step alone: GPU time (events)
  double alone_wall_ms = 0;  ///< one step alone, then a synchronize: wall time

  void launch(const cuda::Stream& s) const {
    for (int k = 0; k < kernels; ++k) test::launch_work(s.native(), iters, blocks_per_sm);
  }

  /// `kernels` launches of about `step_ms` in all on `s` (3 rounds of calibration), then 30 steps
  /// timed alone.
  static WorkStep calibrate(const cuda::Stream& s, double step_ms, int kernels = 1, int blocks_per_sm = 4) {
    WorkStep w;
    w.kernels = kernels;
    w.blocks_per_sm = blocks_per_sm;
    cuda::Event e0 = cuda::Event::create(s.device(), true), e1 = cuda::Event::create(s.device(), true);
    for (int k = 0; k < 3; ++k) {
      e0.record(s);
      test::launch_work(s.native(), w.iters, blocks_per_sm);
      e1.record(s);
      e1.synchronize();
      w.iters = static_cast<long long>(static_cast<double>(w.iters) * step_ms / kernels /
                                       std::max(cuda::Event::elapsed_ms(e0, e1), 1e-3));
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 30; ++k) {
      e0.record(s);
      w.launch(s);
      e1.record(s);
      s.synchronize();
      w.alone_gpu_ms += cuda::Event::elapsed_ms(e0, e1);
    }
    w.alone_wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 30;
    w.alone_gpu_ms /= 30;
    return w;
  }
};

}  // namespace ferry::bench
