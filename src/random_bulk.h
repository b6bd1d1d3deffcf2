// src/random_bulk.h — random draws by the million (a sampler's epoch), private to ferry_core.
#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "ferry/core/random.h"

namespace ferry::detail {

/// Blocks of Philox4x32-10 computed side by side (Generator::fill).
constexpr int kPhiloxLanes = 8;
/// Whether this CPU takes the AVX2 path of philox_lanes.
bool philox_avx2() noexcept;
/// kPhiloxLanes consecutive blocks of (key, counter), counter[0] counting up (wrapping) from
/// `counter`'s, into `out` (4 words a block, in order), with AVX2 (x86-64 CPUs that have it) or
/// without (any CPU); `avx2` only where philox_avx2() says so.
void philox_lanes(bool avx2, const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
                  std::uint32_t* out) noexcept;

/// A uniform integer in [0, n) from next() (64 random bits a call) without modulo bias: Lemire,
/// "Fast random integer generation in an interval" (2019). n must be > 0.
template <class Next>
inline std::uint64_t lemire(std::uint64_t n, Next&& next) noexcept {
  std::uint64_t x = next();
  __uint128_t m = static_cast<__uint128_t>(x) * n;
  std::uint64_t low = static_cast<std::uint64_t>(m);
  if (low < n) {
    const std::uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      x = next();
      m = static_cast<__uint128_t>(x) * n;
      low = static_cast<std::uint64_t>(m);
    }
  }
  return static_cast<std::uint64_t>(m >> 64);
}

/// The draws of a Generator `g`, the same values in the same order as g.randint() gives, with its
/// words computed ahead, kWords at a time (Generator::fill). It takes words from `g` past the last
/// one it hands out: `g` is not to be used after it.
class BulkDraws {
 public:
  explicit BulkDraws(Generator& g) noexcept : g_(g) {}
  std::uint64_t randint(std::uint64_t n) noexcept {
    return lemire(n, [this] {
      const std::uint64_t hi = next();
      return (hi << 32) | next();
    });
  }

 private:
  static constexpr std::size_t kWords = 1024;
  std::uint32_t next() noexcept {
    if (pos_ == kWords) {
      g_.fill(words_);
      pos_ = 0;
    }
    return words_[pos_++];
  }
  Generator& g_;
  std::array<std::uint32_t, kWords> words_;
  std::size_t pos_ = kWords;
};

}  // namespace ferry::detail
