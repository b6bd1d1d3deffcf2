// A training step made of matrix products: `count` cuBLAS bfloat16 products of n x n matrices
// (float accumulation), calibrated to a wall time. Unlike WorkStep's arithmetic kernel, whose
// blocks hold every SM for the whole step, these are what most of a model's step is: kernels of
// short blocks, each filling an SM's registers and shared memory, one after another.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "ferry/ferry.h"

namespace ferry::bench {

class MatmulStep {
 public:
  int n = 4096;
  int count = 1;             ///< products a step
  double alone_gpu_ms = 0;   ///< one step alone: GPU time (events)
  double alone_wall_ms = 0;  ///< one step alone, then a synchronize: wall time

  MatmulStep(const MatmulStep&) = delete;
  MatmulStep& operator=(const MatmulStep&) = delete;
  ~MatmulStep() {
    if (handle_) cublasDestroy(handle_);
    cudaFree(a_);
    cudaFree(b_);
    cudaFree(c_);
  }

  void launch(const cuda::Stream& s) const {
    check(cublasSetStream(handle_, static_cast<cudaStream_t>(s.native())), "cublasSetStream");
    const float one = 1.f, zero = 0.f;
    for (int k = 0; k < count; ++k)
      check(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a_, CUDA_R_16BF, n, b_, CUDA_R_16BF, n, &zero, c_,
                         CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
  }

  /// About `step_ms` of products on `s`, then 30 steps timed alone.
  static std::unique_ptr<MatmulStep> calibrate(const cuda::Stream& s, double step_ms, int n = 4096) {
    std::unique_ptr<MatmulStep> m(new MatmulStep(n));
    cuda::Event e0 = cuda::Event::create(s.device(), true), e1 = cuda::Event::create(s.device(), true);
    for (int k = 0; k < 3; ++k) m->launch(s);  // cuBLAS picks and loads its kernel
    s.synchronize();
    m->count = 10;
    e0.record(s);
    m->launch(s);
    e1.record(s);
    e1.synchronize();
    const double one_ms = cuda::Event::elapsed_ms(e0, e1) / 10;
    m->count = std::max(1, static_cast<int>(step_ms / one_ms + 0.5));
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 30; ++k) {
      e0.record(s);
      m->launch(s);
      e1.record(s);
      s.synchronize();
      m->alone_gpu_ms += cuda::Event::elapsed_ms(e0, e1);
    }
    m->alone_wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 30;
    m->alone_gpu_ms /= 30;
    return m;
  }

 private:
  explicit MatmulStep(int size) : n(size) {
    const std::size_t bytes = static_cast<std::size_t>(n) * n * 2;
    check(cublasCreate(&handle_), "cublasCreate");
    for (void** p : {&a_, &b_, &c_}) {
      if (cudaMalloc(p, bytes) != cudaSuccess) throw std::runtime_error("MatmulStep: cudaMalloc failed");
      cudaMemset(*p, 0x3c, bytes);  // every element 0x3c3c (about 0.0115): not zeros, which run cooler
    }
  }
  static void check(cublasStatus_t st, const char* what) {
    if (st != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(std::string("MatmulStep: ") + what + " failed (" + std::to_string(st) + ")");
  }
  cublasHandle_t handle_ = nullptr;
  void *a_ = nullptr, *b_ = nullptr, *c_ = nullptr;
};

}  // namespace ferry::bench
