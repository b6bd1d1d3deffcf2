#include "ferry/core/random.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "random_bulk.h"

namespace ferry {
namespace {
constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;  // Philox4x32 multipliers
constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule constants

inline void mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  lo = static_cast<std::uint32_t>(p);
}

// One Philox4x32-10 block of (key, counter).
std::array<std::uint32_t, 4> philox_block(std::array<std::uint32_t, 4> c, std::array<std::uint32_t, 2> k) noexcept {
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], hi0, lo0);
    mulhilo(kMul1, c[2], hi1, lo1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}
}  // namespace

void Generator::refill() noexcept {
  block_ = philox_block(counter_, key_);
  used_ = 0;
  // The first word counts blocks drawn from this (stream, substream).
  ++counter_[0];
}

namespace {
// kLanes consecutive blocks of (key, counter), counter[0] counting up from `counter`'s, into
// `out` (4 words a block, in order), one block at a time: Generator::fill where the CPU lacks AVX2.
constexpr int kLanes = detail::kPhiloxLanes;
void philox_lanes_base(const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
                       std::uint32_t* out) noexcept {
  std::array<std::uint32_t, 4> c = counter;
  for (int l = 0; l < kLanes; ++l, ++c[0]) {
    const std::array<std::uint32_t, 4> block = philox_block(c, key);
    std::copy(block.begin(), block.end(), out + 4 * l);
  }
}
#if defined(__x86_64__)
// (hi, lo) of m * c for the 8 words of c (m: a multiplier in each 64-bit half).
[[gnu::target("avx2"), gnu::always_inline]] inline void mul_avx2(__m256i m, __m256i c, __m256i& hi, __m256i& lo) noexcept {
  const __m256i even = _mm256_mul_epu32(m, c), odd = _mm256_mul_epu32(m, _mm256_srli_epi64(c, 32));
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
// The same with AVX2, the kLanes lanes in one register a word. The multiplies take the even
// words of a register, so the odd ones are shifted down for a second multiply and the halves
// blended back.
[[gnu::target("avx2")]] void philox_lanes_avx2(const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
                                               std::uint32_t* out) noexcept {
  static_assert(kLanes == 8);
  const __m256i m0 = _mm256_set1_epi64x(kMul0), m1 = _mm256_set1_epi64x(kMul1);
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(counter[0])), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(static_cast<int>(counter[1])), c2 = _mm256_set1_epi32(static_cast<int>(counter[2])),
          c3 = _mm256_set1_epi32(static_cast<int>(counter[3]));
  std::uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    __m256i hi0, lo0, hi1, lo1;
    mul_avx2(m0, c0, hi0, lo0);
    mul_avx2(m1, c2, hi1, lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  // Lanes to blocks: word j of block l at out[4 * l + j].
  alignas(32) std::uint32_t w[4][kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w[0]), c0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(w[1]), c1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(w[2]), c2);
  _mm256_store_si256(reinterpret_cast<__m256i*>(w[3]), c3);
  for (int l = 0; l < kLanes; ++l)
    for (int j = 0; j < 4; ++j) out[4 * l + j] = w[j][l];
}
#endif
}  // namespace

namespace detail {
bool philox_avx2() noexcept {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
#else
  return false;
#endif
}
void philox_lanes(bool avx2, const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
                  std::uint32_t* out) noexcept {
#if defined(__x86_64__)
  if (avx2) return philox_lanes_avx2(key, counter, out);
#else
  (void)avx2;
#endif
  philox_lanes_base(key, counter, out);
}
}  // namespace detail

void Generator::fill(std::span<std::uint32_t> words) noexcept {
  const bool avx2 = detail::philox_avx2();
  std::size_t i = 0;
  while (i < words.size() && used_ < 4) words[i++] = block_[used_++];
  for (; words.size() - i >= 4 * kLanes; i += 4 * kLanes) {
    detail::philox_lanes(avx2, key_, counter_, words.data() + i);
    counter_[0] += kLanes;
  }
  while (i < words.size()) words[i++] = (*this)();
}

std::uint64_t Generator::randint(std::uint64_t n) noexcept {
  return detail::lemire(n, [this] { return next_u64(); });
}

double Generator::normal() noexcept {
  double u1 = uniform();
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b, std::uint64_t c) noexcept {
  auto mix = [](std::uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  return mix(mix(mix(a) ^ b) ^ c);
}

}  // namespace ferry
