// ferry/core/random.h — counter-based random numbers keyed by (seed, epoch, sample index).
//
// ferry never draws augmentation randomness from a shared, stateful generator: that would make the
// batches depend on which worker ran which sample. Instead each sample gets its own Generator,
// built from (seed, epoch, sample index) with Philox4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11). The same key always yields the same stream, so the batch
// stream is bitwise identical for any num_workers, and an epoch can be resumed exactly.
//
//   ferry::Generator g(seed, epoch, sample_index);
//   bool flip = g.bernoulli(0.5);
//   float scale = g.uniform(0.08f, 1.0f);
//   std::int64_t k = g.randint(10);             // 0..9
//
// Generator satisfies std::uniform_random_bit_generator, so std::shuffle works with it; the
// members above are implemented by ferry and give the same values on every platform, which the
// <random> distributions do not promise.
//
// Thread safety: a Generator is a small value; use one per thread (ferry hands each sample its own).
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <span>

namespace ferry {

/// Philox4x32-10 stream keyed by (seed, stream, substream).
class Generator {
 public:
  using result_type = std::uint32_t;

  /// `seed` keys the generator; `stream` and `substream` pick independent streams under it
  /// (ferry uses epoch and sample index).
  explicit Generator(std::uint64_t seed = 0, std::uint64_t stream = 0, std::uint64_t substream = 0) noexcept
      : key_{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)},
        counter_{0, 0, static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(stream >> 32)} {
    counter_[1] = static_cast<std::uint32_t>(substream);
    // The high half of the substream is folded into the key so 64-bit sample indices stay distinct.
    key_[0] ^= static_cast<std::uint32_t>(substream >> 32) * 0x9E3779B9u;
  }

  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return std::numeric_limits<result_type>::max(); }

  /// Next 32 random bits.
  result_type operator()() noexcept {
    if (used_ == 4) refill();
    return block_[used_++];
  }
  /// Next 64 random bits.
  std::uint64_t next_u64() noexcept {
    std::uint64_t hi = (*this)();
    return (hi << 32) | (*this)();
  }
  /// Uniform double in [0, 1) with 53 random bits.
  double uniform() noexcept { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  /// Uniform float in [lo, hi).
  float uniform(float lo, float hi) noexcept { return lo + static_cast<float>(uniform()) * (hi - lo); }
  /// The next words.size() words, the same as that many calls of operator() give, computed
  /// several blocks at a time (for draws by the million: a sampler's epoch).
  void fill(std::span<std::uint32_t> words) noexcept;
  /// Uniform integer in [0, n) without modulo bias (Lemire's method); n must be > 0.
  std::uint64_t randint(std::uint64_t n) noexcept;
  /// True with probability p.
  bool bernoulli(double p) noexcept { return uniform() < p; }
  /// Standard normal (Box–Muller).
  double normal() noexcept;

 private:
  void refill() noexcept;
  std::array<std::uint32_t, 2> key_;
  std::array<std::uint32_t, 4> counter_;
  std::array<std::uint32_t, 4> block_{};
  int used_ = 4;
};

/// Mixes words into one well-spread 64-bit seed (SplitMix64 finalizer); used to derive sub-seeds.
std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b = 0, std::uint64_t c = 0) noexcept;

}  // namespace ferry
