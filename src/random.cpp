#include "ferry/core/random.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics start some results from a self-initialized value, which -Wall
// reports where they are inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include "random_bulk.h"

namespace ferry {
namespace {
constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;    // Philox4x32 multipliers
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
constexpr int kLanes = detail::kPhiloxLanes;
// kLanes consecutive blocks of (key, counter), counter[0] counting up from `counter`'s, into
// `out` (4 words a block, in order), one block at a time: where the CPU has no AVX2.
void philox_lanes_base(const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
                       std::uint32_t* out) noexcept {
  std::array<std::uint32_t, 4> c = counter;
  for (int l = 0; l < kLanes; ++l, ++c[0]) {
    const std::array<std::uint32_t, 4> block = philox_block(c, key);
    std::copy(block.begin(), block.end(), out + 4 * l);
  }
}
#if defined(__x86_64__)
// The vector paths keep word j of each lane's block in register cj, one lane a 32-bit element.
// The multiplies take the even elements of a register, so the odd ones are shifted down for a
// second multiply and the halves blended back. A round is a chain of dependent instructions;
// the transposition back to blocks is in registers.

// (hi, lo) of m * c for the 8 words of c (m: a multiplier in each 64-bit half).
[[gnu::target("avx2"), gnu::always_inline]] inline void mul_avx2(__m256i m, __m256i c, __m256i& hi, __m256i& lo) noexcept {
  const __m256i even = _mm256_mul_epu32(m, c), odd = _mm256_mul_epu32(m, _mm256_srli_epi64(c, 32));
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
// 8 blocks, counter[0] counting up from `first`.
[[gnu::target("avx2")]] void philox8_avx2(const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
                                          std::uint32_t first, std::uint32_t* out) noexcept {
  const __m256i m0 = _mm256_set1_epi64x(kMul0), m1 = _mm256_set1_epi64x(kMul1);
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
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
  // Lanes to blocks. Per 128-bit half h: t0 = (c0, c1) of lanes 4h, 4h + 1; t1 of 4h + 2, 4h + 3;
  // t2, t3 the same of (c2, c3); then u_i = block 4h + i; then the halves paired into blocks.
  const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
  const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  __m256i* o = reinterpret_cast<__m256i*>(out);
  _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(u0, u1, 0x20));  // blocks 0, 1
  _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(u2, u3, 0x20));  // 2, 3
  _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(u0, u1, 0x31));  // 4, 5
  _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(u2, u3, 0x31));  // 6, 7
}
[[gnu::target("avx2")]] void philox_lanes_avx2(const std::array<std::uint32_t, 2>& key,
                                               const std::array<std::uint32_t, 4>& counter, std::uint32_t* out) noexcept {
  static_assert(kLanes == 16);
  philox8_avx2(key, counter, counter[0], out);
  philox8_avx2(key, counter, counter[0] + 8, out + 32);
}

// The same, 16 lanes in one register a word.
[[gnu::target("avx512f"), gnu::always_inline]] inline void mul_avx512(__m512i m, __m512i c, __m512i& hi, __m512i& lo) noexcept {
  const __m512i even = _mm512_mul_epu32(m, c), odd = _mm512_mul_epu32(m, _mm512_srli_epi64(c, 32));
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}
[[gnu::target("avx512f")]] void philox_lanes_avx512(const std::array<std::uint32_t, 2>& key,
                                                    const std::array<std::uint32_t, 4>& counter, std::uint32_t* out) noexcept {
  static_assert(kLanes == 16);
  const __m512i m0 = _mm512_set1_epi64(kMul0), m1 = _mm512_set1_epi64(kMul1);
  __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(counter[0])),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i c1 = _mm512_set1_epi32(static_cast<int>(counter[1])), c2 = _mm512_set1_epi32(static_cast<int>(counter[2])),
          c3 = _mm512_set1_epi32(static_cast<int>(counter[3]));
  std::uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    __m512i hi0, lo0, hi1, lo1;
    mul_avx512(m0, c0, hi0, lo0);
    mul_avx512(m1, c2, hi1, lo1);
    c0 = _mm512_ternarylogic_epi32(hi1, c1, _mm512_set1_epi32(static_cast<int>(k0)), 0x96);  // a ^ b ^ c
    c1 = lo1;
    c2 = _mm512_ternarylogic_epi32(hi0, c3, _mm512_set1_epi32(static_cast<int>(k1)), 0x96);
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  // As the AVX2 path, per 128-bit quarter q: u_i = block 4q + i. Then a, b take quarters
  // (0, 2) and (1, 3) of u0 and u1, c, d the same of u2 and u3, and each output register
  // takes one quarter of each of u0..u3: blocks 4q..4q + 3.
  const __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
  const __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
  const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
  const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
  const __m512i a = _mm512_shuffle_i64x2(u0, u1, 0x88), b = _mm512_shuffle_i64x2(u0, u1, 0xDD);
  const __m512i c = _mm512_shuffle_i64x2(u2, u3, 0x88), d = _mm512_shuffle_i64x2(u2, u3, 0xDD);
  _mm512_storeu_si512(out + 0, _mm512_shuffle_i64x2(a, c, 0x88));   // blocks 0-3
  _mm512_storeu_si512(out + 16, _mm512_shuffle_i64x2(b, d, 0x88));  // 4-7
  _mm512_storeu_si512(out + 32, _mm512_shuffle_i64x2(a, c, 0xDD));  // 8-11
  _mm512_storeu_si512(out + 48, _mm512_shuffle_i64x2(b, d, 0xDD));  // 12-15
}

// lemire_run with AVX2, 4 draws a step. A draw's 64 bits x = (hi word, lo word) load as one
// 64-bit element with hi in its low half; with n < 2^32, x * n = hi*n * 2^32 + lo*n, so with
// s = hi*n + (lo*n >> 32): the draw is s >> 32, and the product's low 64 bits are
// (s mod 2^32) * 2^32 + (lo*n mod 2^32), below n (lemire's second look) only where s mod 2^32 = 0.
[[gnu::target("avx2")]] std::size_t lemire_run_avx2(const std::uint32_t* words, std::size_t draws, std::uint64_t n,
                                                    bool descending, std::size_t* out) noexcept {
  static_assert(sizeof(std::size_t) == 8);
  const __m256i step = descending ? _mm256_set1_epi64x(4) : _mm256_setzero_si256();
  __m256i bound = _mm256_sub_epi64(_mm256_set1_epi64x(static_cast<long long>(n)),
                                   descending ? _mm256_setr_epi64x(0, 1, 2, 3) : _mm256_setzero_si256());
  const __m256i low32 = _mm256_set1_epi64x(0xFFFFFFFFll), zero = _mm256_setzero_si256();
  std::size_t k = 0;
  for (; k + 4 <= draws; k += 4) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 2 * k));
    const __m256i hi = _mm256_mul_epu32(x, bound), lo = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), bound);
    const __m256i s = _mm256_add_epi64(hi, _mm256_srli_epi64(lo, 32));
    const __m256i second = _mm256_cmpeq_epi64(_mm256_and_si256(s, low32), zero);
    if (!_mm256_testz_si256(second, second)) break;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_srli_epi64(s, 32));
    bound = _mm256_sub_epi64(bound, step);
  }
  return k;
}
#endif

// The same one draw at a time.
std::size_t lemire_run_base(const std::uint32_t* words, std::size_t draws, std::uint64_t n, bool descending,
                            std::size_t* out) noexcept {
  for (std::size_t k = 0; k < draws; ++k) {
    const std::uint64_t bound = descending ? n - k : n;
    const std::uint64_t s = words[2 * k] * bound + ((words[2 * k + 1] * bound) >> 32);
    if (static_cast<std::uint32_t>(s) == 0) return k;
    out[k] = static_cast<std::size_t>(s >> 32);
  }
  return draws;
}
}  // namespace

namespace detail {
Simd cpu_simd() noexcept {
#if defined(__x86_64__)
  static const Simd simd = __builtin_cpu_supports("avx512f") ? Simd::Avx512
                           : __builtin_cpu_supports("avx2")  ? Simd::Avx2
                                                             : Simd::None;
  return simd;
#else
  return Simd::None;
#endif
}
void philox_lanes(Simd simd, const std::array<std::uint32_t, 2>& key, const std::array<std::uint32_t, 4>& counter,
                  std::uint32_t* out) noexcept {
#if defined(__x86_64__)
  if (simd == Simd::Avx512) return philox_lanes_avx512(key, counter, out);
  if (simd == Simd::Avx2) return philox_lanes_avx2(key, counter, out);
#else
  (void)simd;
#endif
  philox_lanes_base(key, counter, out);
}
std::size_t lemire_run(Simd simd, const std::uint32_t* words, std::size_t draws, std::uint64_t n, bool descending,
                       std::size_t* out) noexcept {
#if defined(__x86_64__)
  if (simd != Simd::None) {
    const std::size_t k = lemire_run_avx2(words, draws, n, descending, out);
    if (draws - k >= 4) return k;  // stopped at a group that may need a second look
    return k + lemire_run_base(words + 2 * k, draws - k, descending ? n - k : n, descending, out + k);
  }
#else
  (void)simd;
#endif
  return lemire_run_base(words, draws, n, descending, out);
}

void BulkDraws::randints(std::uint64_t n, bool descending, std::span<std::size_t> out) noexcept {
  std::size_t k = 0;
  const bool side_by_side = n < (std::uint64_t{1} << 32) && (!descending || n >= out.size());
  while (k < out.size()) {
    if (side_by_side) {
      const std::size_t room = (kWords - pos_) / 2, want = std::min(out.size() - k, room);
      const std::size_t done = lemire_run(simd_, words_.data() + pos_, want, descending ? n - k : n, descending, out.data() + k);
      pos_ += 2 * done;
      k += done;
      if (k == out.size()) break;
    }
    // One draw the usual way: where the words ran out (it computes more) or run out inside it,
    // where it may need a second look, or where the bounds are too large to draw side by side.
    out[k] = static_cast<std::size_t>(randint(descending ? n - k : n));
    ++k;
  }
}
}  // namespace detail

void Generator::fill(std::span<std::uint32_t> words) noexcept {
  const detail::Simd simd = detail::cpu_simd();
  std::size_t i = 0;
  while (i < words.size() && used_ < 4) words[i++] = block_[used_++];
  for (; words.size() - i >= 4 * kLanes; i += 4 * kLanes) {
    detail::philox_lanes(simd, key_, counter_, words.data() + i);
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
