// src/random_bulk.h — random draws by the million (a sampler's epoch), private to ferry_core.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/core/random.h"

namespace ferry::detail {

/// The vector instructions the bulk paths below may use; each path gives the same words and draws.
enum class Simd { None, Avx2, Avx512 };
/// The widest this CPU has (None off x86-64).
Simd cpu_simd() noexcept;

/// Blocks of Philox4x32-10 computed at a time (Generator::fill).
constexpr int kPhiloxLanes = 16;
/// kPhiloxLanes consecutive blocks of (key, counter), counter[0] counting up (wrapping) from
/// `counter`'s, into `out` (4 words a block, in order), with `simd`'s instructions: Avx512 16
/// blocks in one register a word, Avx2 8 at a time, None one at a time. `simd` no wider than
/// cpu_simd().
void philox_lanes(Simd simd, const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
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

/// Up to `draws` draws of lemire() side by side, each from two words of `words` (the high half
/// first, as next_u64 takes them): draw k from words[2k] and words[2k + 1], its bound n - k where
/// `descending`, else n. Every bound must lie in [1, 2^32). Stops before the first group of draws
/// where one might need lemire()'s second look (its low product word below 2^32, about one draw
/// in 4 billion) and returns how many it wrote; those are lemire()'s values.
std::size_t lemire_run(Simd simd, const std::uint32_t* words, std::size_t draws, std::uint64_t n, bool descending,
                       std::size_t* out) noexcept;

/// The draws of a Generator `g`, the same values in the same order as g.randint() gives, with its
/// words computed ahead, kWords at a time (Generator::fill). It takes words from `g` past the last
/// one it hands out: `g` is not to be used after it.
class BulkDraws {
 public:
  explicit BulkDraws(Generator& g) noexcept : g_(g), simd_(cpu_simd()) {}
  std::uint64_t randint(std::uint64_t n) noexcept {
    return lemire(n, [this] {
      const std::uint64_t hi = next();
      return (hi << 32) | next();
    });
  }
  /// out[k] = randint(n - k) where `descending` (Fisher-Yates' draws; n >= out.size() then), else
  /// randint(n), for k = 0, 1, ... in order: the same draws, computed several at a time where the
  /// bounds allow (all below 2^32).
  void randints(std::uint64_t n, bool descending, std::span<std::size_t> out) noexcept;

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
  Simd simd_;
  std::array<std::uint32_t, kWords> words_;
  std::size_t pos_ = kWords;
};

}  // namespace ferry::detail
