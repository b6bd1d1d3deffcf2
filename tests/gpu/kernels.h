// Test kernels (tests/gpu/kernels.cu), behind a plain C++ interface; streams are cudaStream_t as void*.
#pragma once

#include <chrono>
#include <cstdint>

namespace ferry::test {
/// The value of word `col` of sample `index` in the corruption test's dataset.
inline std::uint32_t pattern(std::int64_t index, std::int64_t col) {
  return static_cast<std::uint32_t>(index) * 2654435761u ^ (static_cast<std::uint32_t>(col) * 40503u + 0x9E37u);
}
/// A fixed amount of arithmetic (`iters` dependent FMAs a thread, `blocks_per_sm` blocks of 256 a
/// SM; 8 fill an SM's threads) on every SM of the current device: a step whose time grows when
/// other kernels share the SMs.
void launch_work(void* stream, long long iters, int blocks_per_sm = 4);
/// Occupies one SM for about `microseconds` on `stream`.
void launch_spin(void* stream, double microseconds);
/// A CUDA event recorded on `stream` now (a cudaEvent_t as void*; destroy_event() frees it).
void* record_event(void* stream);
/// Milliseconds from event `a` to event `b` on the GPU's clock, negative when `b` came first
/// (waits for both).
double event_ms(void* a, void* b);
void destroy_event(void* event);
/// A training step's baseline: the mean wall time in ms of `steps` spins of `step_ms` on
/// `stream`, each followed by a stream synchronize (after 3 unmeasured ones).
double step_alone_ms(void* stream, double step_ms, int steps);
/// A training loop's wall time in ms: `steps` steps (after 10 unmeasured ones) of one spin of
/// `step_ms` on the loader's stream per batch, then a stream synchronize, across as many epochs
/// as it takes. With step_alone_ms() this gives the GPU's waiting share: 1 - steps x alone / wall.
template <class Loader>
double training_loop_ms(Loader& loader, double step_ms, int steps) {
  int step = 0;
  auto t0 = std::chrono::steady_clock::now();
  while (step < steps + 10) {
    for (auto& b : loader) {
      if (step == 10) t0 = std::chrono::steady_clock::now();  // 10 warm-up steps
      if (step == steps + 10) break;
      (void)b;
      launch_spin(loader.stream()->native(), step_ms * 1000);
      loader.stream()->synchronize();
      ++step;
    }
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
/// Counts words of data[rows][cols] that differ from pattern(index[r], c) into *bad (device memory).
void launch_check(void* stream, const std::uint32_t* data, const std::int64_t* index, int rows, int cols,
                  unsigned long long* bad);
/// Counts positions where got[i] != want[i], i < n (both device memory), into *bad.
void launch_count_differences(void* stream, const std::int64_t* got, const std::int64_t* want, int n, unsigned long long* bad);
/// Device memory helpers for the counter.
unsigned long long* alloc_counter();
unsigned long long read_counter(unsigned long long* counter);  // synchronizes the device
void free_counter(unsigned long long* counter);
}  // namespace ferry::test
