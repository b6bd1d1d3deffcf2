// The image pass's kernels: see loaders/image_pass.h.
#include "image_pass.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#define FERRY_PASS_SSE2 1
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FERRY_PASS_AVX2 1  // compiled with target("avx2"), run where the CPU has it
#endif

#include <atomic>

#include "ferry/core/error.h"
#include "ferry/detail/pass_math.h"
#include "ferry/detail/pass_paths.h"
#include "ferry/loaders/transforms.h"

namespace ferry::detail {

std::vector<Tap> taps(const Axis& a) {
  std::vector<Tap> out(static_cast<std::size_t>(a.N));
  const float scale = static_cast<float>(a.L0) / static_cast<float>(a.R);
  for (std::int64_t k = 0; k < a.N; ++k) {
    const std::int64_t j = a.c1 + (a.flip ? a.N - 1 - k : k);
    Tap& t = out[static_cast<std::size_t>(k)];
    if (j < 0 || j >= a.R) {
      t = {-1, -1, 0.f};
    } else if (!a.resized) {
      t = {a.c0 + j, a.c0 + j, 0.f};
    } else {
      // As ATen's area_pixel_compute_source_index with align_corners=false.
      float x = scale * (static_cast<float>(j) + 0.5f) - 0.5f;
      if (x < 0) x = 0;
      const auto i0 = static_cast<std::int64_t>(x);
      const std::int64_t i1 = i0 + (i0 < a.L0 - 1 ? 1 : 0);
      t = {a.c0 + i0, a.c0 + i1, x - static_cast<float>(i0)};
    }
  }
  return out;
}

namespace {

// Round half to even, as std::nearbyint in the default rounding mode, for 0 <= |v| < 2^22:
// adding and subtracting 1.5 * 2^23 leaves the integer part (no libm call, so loops vectorize).
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;  // 0x1.8p23
  const float t = v + kMagic;            // not folded: without -ffast-math the compiler keeps both roundings
  return t - kMagic;
}

// The value written for an element of type Out (to_float's 16-bit types round to nearest even).
template <class Out>
inline Out store_as(float v) {
  if constexpr (std::is_same_v<Out, float>)
    return v;
  else if constexpr (std::is_same_v<Out, Half>)
    return Half{detail::pass_f16_bits(v)};
  else if constexpr (std::is_same_v<Out, BFloat16>)
    return BFloat16{detail::pass_bf16_bits(v)};
  else
    return static_cast<std::uint8_t>(std::clamp(v, 0.f, 255.f));
}

// The pass's inner loops, with the channel count fixed at compile time when kC > 0 (1 and 3:
// gray and RGB, nearly every image) and the row pointers, taps and padding hoisted out.
template <class In, class Out, int kC, bool kRound>
void run_pass_c(const Image& in, const std::vector<Tap>& ty, const std::vector<Tap>& tx, Out* out, bool chw, const float* a,
                const float* b) {
  const auto* src = static_cast<const In*>(in.data);
  const std::int64_t C = kC > 0 ? kC : in.c, H = static_cast<std::int64_t>(ty.size()), W = static_cast<std::int64_t>(tx.size());
  auto store = [&](std::int64_t y, std::int64_t x, std::int64_t c, float v) {
    v = a[c] * v + b[c];
    const std::int64_t o = chw ? (c * H + y) * W + x : (y * W + x) * C + c;
    out[o] = store_as<Out>(v);
  };
  for (std::int64_t y = 0; y < H; ++y) {
    const Tap& r = ty[static_cast<std::size_t>(y)];
    if (r.i0 < 0) {  // a padded row
      for (std::int64_t x = 0; x < W; ++x)
        for (std::int64_t c = 0; c < C; ++c) store(y, x, c, 0.f);
      continue;
    }
    const In* row0 = src + r.i0 * in.w * C;
    const In* row1 = src + r.i1 * in.w * C;
    const float wy = r.w;
    for (std::int64_t x = 0; x < W; ++x) {
      const Tap& t = tx[static_cast<std::size_t>(x)];
      if (t.i0 < 0) {
        for (std::int64_t c = 0; c < C; ++c) store(y, x, c, 0.f);
        continue;
      }
      const In *p0 = row0 + t.i0 * C, *p1 = row0 + t.i1 * C, *q0 = row1 + t.i0 * C, *q1 = row1 + t.i1 * C;
      const float wx = t.w;
      for (std::int64_t c = 0; c < C; ++c) {
        const float p00 = static_cast<float>(p0[c]), p01 = static_cast<float>(p1[c]);
        const float p10 = static_cast<float>(q0[c]), p11 = static_cast<float>(q1[c]);
        const float top = p00 + (p01 - p00) * wx, bottom = p10 + (p11 - p10) * wx;
        float v = top + (bottom - top) * wy;
        if constexpr (kRound) v = round_even(v);
        store(y, x, c, v);
      }
    }
  }
}

// The source columns [first, end) the taps read; {0, 0} when every tap is padding.
std::pair<std::int64_t, std::int64_t> tap_span(const std::vector<Tap>& taps, std::int64_t width) {
  std::int64_t first = width, end = 0;
  for (const Tap& t : taps)
    if (t.i0 >= 0) {
      first = std::min({first, t.i0, t.i1});
      end = std::max({end, t.i0 + 1, t.i1 + 1});
    }
  return end <= first ? std::pair<std::int64_t, std::int64_t>{0, 0} : std::pair{first, end};
}

// A row pass's buffers, kept per thread: the two cached rows, one source row as floats, and each
// output column's taps as offsets into it and a weight.
struct RowScratch {
  std::vector<float> cache, row, w;
  std::vector<std::int32_t> o0, o1;
};

// Each output pixel's taps for a 3-channel row converted to floats from source column xa: offsets
// of the two pixels (a padded tap reads the zeros at `span`) and the weight.
void pixel_taps(const std::vector<Tap>& tx, std::int64_t xa, std::int64_t span, RowScratch& sc) {
  const std::size_t W = tx.size();
  sc.w.resize(W);
  sc.o0.resize(W);
  sc.o1.resize(W);
  for (std::size_t x = 0; x < W; ++x) {
    const Tap& t = tx[x];
    const bool pad = t.i0 < 0;
    sc.o0[x] = static_cast<std::int32_t>(pad ? span : (t.i0 - xa) * 3);
    sc.o1[x] = static_cast<std::int32_t>(pad ? span : (t.i1 - xa) * 3);
    sc.w[x] = pad ? 0.f : t.w;
  }
}

// The two source rows a separable pass keeps interpolated along x (an upscale reuses them).
struct TwoRows {
  float* slot[2];
  std::int64_t held[2] = {-1, -1};  // the source row in each slot
  // The slot holding row r, filling (fill(r, slot)) one that is not `avoid` when neither does.
  template <class Fill>
  int fetch(std::int64_t r, int avoid, Fill&& fill) {
    if (held[0] == r) return 0;
    if (held[1] == r) return 1;
    const int s = avoid == 0 ? 1 : 0;
    fill(r, slot[s]);
    held[s] = r;
    return s;
  }
};

// The same pass for uint8 sources of 1 or 3 channels (decoded images), separated: each source row
// the output needs is interpolated along x once, into a planar float row (two rows cached, so
// an upscale reuses them), then each output row is one vectorizable lerp between two such rows.
// The horizontal step converts the columns the pass reads to float first (one vectorized loop),
// then runs one flat loop over the planar row, reading through precomputed offsets: no byte
// loads or integer conversions in it, and a padded tap reads a zero kept past the row's end.
// The float operations are the ones run_pass_c does, in the same order, so the values are the
// same bit for bit (tests/loaders/test_transforms.cpp checks against pass_math.h).
template <class Out, int kC, bool kRound>
void run_pass_rows(const Image& in, const std::vector<Tap>& ty, const std::vector<Tap>& tx, Out* out, bool chw, const float* a,
                   const float* b) {
  const auto* src = static_cast<const std::uint8_t*>(in.data);
  const std::int64_t H = static_cast<std::int64_t>(ty.size()), W = static_cast<std::int64_t>(tx.size());
  const std::pair<std::int64_t, std::int64_t> cols = tap_span(tx, in.w);  // the source columns the taps read
  const std::int64_t xa = cols.first, xb = cols.second;                   // plain variables: lambdas capture them
  const std::int64_t span = (xb - xa) * kC;                               // floats of a converted row; index `span` holds 0
  thread_local RowScratch sc;
  sc.cache.resize(static_cast<std::size_t>(2 * kC * W));
  sc.row.resize(static_cast<std::size_t>(span + 1));
  sc.w.resize(static_cast<std::size_t>(kC * W));
  sc.o0.resize(static_cast<std::size_t>(kC * W));
  sc.o1.resize(static_cast<std::size_t>(kC * W));
  for (int c = 0; c < kC; ++c)
    for (std::int64_t x = 0; x < W; ++x) {
      const Tap& t = tx[static_cast<std::size_t>(x)];
      const auto j = static_cast<std::size_t>(c * W + x);
      const bool pad = t.i0 < 0;
      sc.o0[j] = static_cast<std::int32_t>(pad ? span : (t.i0 - xa) * kC + c);
      sc.o1[j] = static_cast<std::int32_t>(pad ? span : (t.i1 - xa) * kC + c);
      sc.w[j] = pad ? 0.f : t.w;
    }
  sc.row[static_cast<std::size_t>(span)] = 0.f;
  TwoRows rows{{sc.cache.data(), sc.cache.data() + kC * W}};
  auto horizontal = [&](std::int64_t r, float* __restrict dst) {
    const std::uint8_t* __restrict row = src + (r * in.w + xa) * kC;
    float* __restrict f = sc.row.data();
    for (std::int64_t k = 0; k < span; ++k) f[k] = static_cast<float>(row[k]);
    const std::int32_t* __restrict o0 = sc.o0.data();
    const std::int32_t* __restrict o1 = sc.o1.data();
    const float* __restrict w = sc.w.data();
    for (std::int64_t j = 0; j < kC * W; ++j) {
      const float v0 = f[o0[j]], v1 = f[o1[j]];
      dst[j] = v0 + (v1 - v0) * w[j];
    }
  };
  for (std::int64_t y = 0; y < H; ++y) {
    const Tap& r = ty[static_cast<std::size_t>(y)];
    const float* top = nullptr;
    const float* bottom = nullptr;
    if (r.i0 >= 0) {
      const int s0 = rows.fetch(r.i0, -1, horizontal);
      const int s1 = rows.fetch(r.i1, s0, horizontal);
      top = rows.slot[s0];
      bottom = rows.slot[s1];
    }
    const float wy = r.w;
    for (int c = 0; c < kC; ++c) {
      const float ac = a[c], bc = b[c];
      const float* __restrict t = top ? top + c * W : nullptr;
      const float* __restrict u = top ? bottom + c * W : nullptr;
      if constexpr (!std::is_same_v<Out, std::uint8_t>) {
        if (chw) {
          Out* __restrict o = out + (c * H + y) * W;
          if (!t) {
            for (std::int64_t x = 0; x < W; ++x) o[x] = store_as<Out>(ac * 0.f + bc);
            continue;
          }
          for (std::int64_t x = 0; x < W; ++x) {
            float v = t[x] + (u[x] - t[x]) * wy;
            if constexpr (kRound) v = round_even(v);
            o[x] = store_as<Out>(ac * v + bc);
          }
          continue;
        }
      }
      Out* o = out + y * W * kC + c;
      for (std::int64_t x = 0; x < W; ++x) {
        float v = 0.f;
        if (t) {
          v = t[x] + (u[x] - t[x]) * wy;
          if constexpr (kRound) v = round_even(v);
        }
        o[x * kC] = store_as<Out>(ac * v + bc);
      }
    }
  }
}

#ifdef FERRY_PASS_SSE2
// Four floats to Out: one store for float, else each value through store_as.
template <class Out>
inline void store4(Out* p, __m128 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm_storeu_ps(p, v);
  } else {
    alignas(16) float t[4];
    _mm_store_ps(t, v);
    for (int i = 0; i < 4; ++i) p[i] = store_as<Out>(t[i]);
  }
}

// As round_even, four lanes.
inline __m128 round_even4(__m128 v) {
  const __m128 magic = _mm_set1_ps(12582912.0f);
  return _mm_sub_ps(_mm_add_ps(v, magic), magic);
}

// run_pass_rows for 3-channel images on SSE2 (every x86-64), a pixel a vector: rows stay
// interleaved (RGB RGB ...) as floats, a horizontal tap is two unaligned 4-float loads (the pixel
// and the next one's first channel, which is ignored: a row keeps one float of slack, and a
// padded tap reads four zeros past the converted row), and the vertical lerp and multiply-add
// run on 12 floats (4 pixels) at a time, then are split into planes for CHW output. Each value
// goes through the same float operations as run_pass_c, in the same order.
template <class Out, bool kRound>
void run_pass_rgb(const Image& in, const std::vector<Tap>& ty, const std::vector<Tap>& tx, Out* out, bool chw, const float* a,
                  const float* b) {
  constexpr int kC = 3;
  const auto* src = static_cast<const std::uint8_t*>(in.data);
  const std::int64_t H = static_cast<std::int64_t>(ty.size()), W = static_cast<std::int64_t>(tx.size());
  const std::pair<std::int64_t, std::int64_t> cols = tap_span(tx, in.w);  // the source columns the taps read
  const std::int64_t xa = cols.first, xb = cols.second;                   // plain variables: lambdas capture them
  const std::int64_t span = (xb - xa) * kC;
  thread_local RowScratch sc;
  const std::int64_t pitch = kC * W + 4;  // a cached row, with slack for the last pixel's 4-float store
  sc.cache.resize(static_cast<std::size_t>(2 * pitch));
  sc.row.resize(static_cast<std::size_t>(span + 4));
  std::fill(sc.row.begin() + span, sc.row.end(), 0.f);  // what a padded tap and the last pixel's 4th lane read
  pixel_taps(tx, xa, span, sc);
  TwoRows rows{{sc.cache.data(), sc.cache.data() + pitch}};
  auto horizontal = [&](std::int64_t r, float* __restrict dst) {
    const std::uint8_t* __restrict row = src + (r * in.w + xa) * kC;
    float* __restrict f = sc.row.data();
    for (std::int64_t k = 0; k < span; ++k) f[k] = static_cast<float>(row[k]);
    const std::int32_t* o0 = sc.o0.data();
    const std::int32_t* o1 = sc.o1.data();
    const float* w = sc.w.data();
    for (std::int64_t x = 0; x < W; ++x) {
      const __m128 v0 = _mm_loadu_ps(f + o0[x]), v1 = _mm_loadu_ps(f + o1[x]);
      _mm_storeu_ps(dst + kC * x, _mm_add_ps(v0, _mm_mul_ps(_mm_sub_ps(v1, v0), _mm_set1_ps(w[x]))));
    }
  };
  // a and b over 4 pixels' 12 lanes: channel (i + lane) % 3 in vector i.
  __m128 A[3], B[3];
  for (int i = 0; i < 3; ++i) {
    A[i] = _mm_setr_ps(a[(4 * i) % 3], a[(4 * i + 1) % 3], a[(4 * i + 2) % 3], a[(4 * i + 3) % 3]);
    B[i] = _mm_setr_ps(b[(4 * i) % 3], b[(4 * i + 1) % 3], b[(4 * i + 2) % 3], b[(4 * i + 3) % 3]);
  }
  const std::int64_t W4 = W / 4 * 4;
  for (std::int64_t y = 0; y < H; ++y) {
    const Tap& r = ty[static_cast<std::size_t>(y)];
    Out* planes[3] = {out + y * W, out + (H + y) * W, out + (2 * H + y) * W};  // chw
    Out* hwc = out + y * W * kC;
    auto put = [&](std::int64_t x, int c, float v) {  // one value, as run_pass_c writes it
      const float o = a[c] * v + b[c];
      if (chw)
        planes[c][x] = store_as<Out>(o);
      else
        hwc[x * kC + c] = store_as<Out>(o);
    };
    if (r.i0 < 0) {  // a padded row
      for (std::int64_t x = 0; x < W; ++x)
        for (int c = 0; c < kC; ++c) put(x, c, 0.f);
      continue;
    }
    const int s0 = rows.fetch(r.i0, -1, horizontal);
    const int s1 = rows.fetch(r.i1, s0, horizontal);
    const float* t = rows.slot[s0];
    const float* u = rows.slot[s1];
    const __m128 wy = _mm_set1_ps(r.w);
    for (std::int64_t x = 0; x < W4; x += 4) {
      __m128 v[3];
      for (int i = 0; i < 3; ++i) {
        const __m128 t4 = _mm_loadu_ps(t + kC * x + 4 * i), u4 = _mm_loadu_ps(u + kC * x + 4 * i);
        __m128 e = _mm_add_ps(t4, _mm_mul_ps(_mm_sub_ps(u4, t4), wy));
        if constexpr (kRound) e = round_even4(e);
        v[i] = _mm_add_ps(_mm_mul_ps(A[i], e), B[i]);
      }
      if (!chw) {
        for (int i = 0; i < 3; ++i) store4(hwc + kC * x + 4 * i, v[i]);
        continue;
      }
      // v: r0 g0 b0 r1 | g1 b1 r2 g2 | b2 r3 g3 b3  ->  r0 r1 r2 r3 | g0 g1 g2 g3 | b0 b1 b2 b3
      const __m128 p = _mm_shuffle_ps(v[0], v[0], _MM_SHUFFLE(2, 1, 3, 0));    // r0 r1 g0 b0
      const __m128 q = _mm_shuffle_ps(v[1], v[2], _MM_SHUFFLE(0, 1, 3, 2));    // r2 g2 r3 b2
      const __m128 R = _mm_shuffle_ps(p, q, _MM_SHUFFLE(2, 0, 1, 0));          // r0 r1 r2 r3
      const __m128 g01 = _mm_shuffle_ps(v[0], v[1], _MM_SHUFFLE(0, 0, 1, 1));  // g0 g0 g1 g1
      const __m128 g23 = _mm_shuffle_ps(v[1], v[2], _MM_SHUFFLE(2, 2, 3, 3));  // g2 g2 g3 g3
      const __m128 G = _mm_shuffle_ps(g01, g23, _MM_SHUFFLE(2, 0, 2, 0));      // g0 g1 g2 g3
      const __m128 b01 = _mm_shuffle_ps(v[0], v[1], _MM_SHUFFLE(1, 1, 2, 2));  // b0 b0 b1 b1
      const __m128 b23 = _mm_shuffle_ps(v[2], v[2], _MM_SHUFFLE(3, 3, 0, 0));  // b2 b2 b3 b3
      const __m128 Bv = _mm_shuffle_ps(b01, b23, _MM_SHUFFLE(2, 0, 2, 0));     // b0 b1 b2 b3
      store4(planes[0] + x, R);
      store4(planes[1] + x, G);
      store4(planes[2] + x, Bv);
    }
    for (std::int64_t x = W4; x < W; ++x)
      for (int c = 0; c < kC; ++c) {
        float e = t[kC * x + c] + (u[kC * x + c] - t[kC * x + c]) * r.w;
        if constexpr (kRound) e = round_even(e);
        put(x, c, e);
      }
  }
}
#endif

#ifdef FERRY_PASS_AVX2
#define FERRY_AVX2 __attribute__((target("avx2")))

// run_pass_rgb on AVX2, eight pixels a step, the cached rows planar (R, G and B planes of W
// floats each) where run_pass_rgb keeps them interleaved:
//   * the source row's columns become floats eight bytes at a time (vpmovzxbd, vcvtdq2ps);
//   * the horizontal step lerps two pixels a vector (pixel x + j in the low half, x + 4 + j in
//     the high half, each tap an unaligned 4-float load whose 4th lane is ignored), and four such
//     vectors are transposed into eight R, eight G and eight B values (4 unpacks, 3 shuffles);
//   * the vertical lerp and the multiply-add then run on each plane's contiguous floats, which
//     CHW output stores as they are.
// No FMA (the target is avx2 alone), and each value goes through run_pass_c's float operations in
// the same order, so the output is the same bit for bit (the tests run both paths).
struct PlanarScratch : RowScratch {
  std::vector<float> w8;  // the weights as the horizontal step's vectors take them
};

// What the horizontal step reads: the source, the columns it converts, the output's width.
struct PlanarRows {
  const std::uint8_t* src;
  std::int64_t src_w, xa, span, W, W8;
  PlanarScratch* sc;
};

// Source row r, interpolated along x, into the three planes at `dst`.
FERRY_AVX2 void horizontal_avx2(const PlanarRows& p, std::int64_t r, float* __restrict dst) {
  const std::uint8_t* __restrict row = p.src + (r * p.src_w + p.xa) * 3;
  float* __restrict f = p.sc->row.data();
  const std::int64_t span = p.span;  // a local: the stores below could alias p
  std::int64_t k = 0;
  for (; k + 16 <= span; k += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    _mm256_storeu_ps(f + k, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    _mm256_storeu_ps(f + k + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes))));
  }
  for (; k < span; ++k) f[k] = static_cast<float>(row[k]);
  const std::int32_t* __restrict o0 = p.sc->o0.data();
  const std::int32_t* __restrict o1 = p.sc->o1.data();
  const float* __restrict w8 = p.sc->w8.data();
  const std::int64_t W = p.W, W8 = p.W8;
  float* __restrict R = dst;
  float* __restrict G = dst + W;
  float* __restrict B = dst + 2 * W;
  for (std::int64_t x = 0; x < W8; x += 8) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 v0 =
          _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(f + o0[x + j])), _mm_loadu_ps(f + o0[x + 4 + j]), 1);
      const __m256 v1 =
          _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(f + o1[x + j])), _mm_loadu_ps(f + o1[x + 4 + j]), 1);
      const __m256 w = _mm256_loadu_ps(w8 + 4 * x + 8 * j);
      v[j] = _mm256_add_ps(v0, _mm256_mul_ps(_mm256_sub_ps(v1, v0), w));
    }
    // v[j] = pixel x+j | pixel x+4+j, each r g b (and one ignored lane)
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]);  // r0 r1 g0 g1 | r4 r5 g4 g5
    const __m256 t1 = _mm256_unpackhi_ps(v[0], v[1]);  // b0 b1 .. .. | b4 b5 .. ..
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]);  // r2 r3 g2 g3 | r6 r7 g6 g7
    const __m256 t3 = _mm256_unpackhi_ps(v[2], v[3]);  // b2 b3 .. .. | b6 b7 .. ..
    _mm256_storeu_ps(R + x, _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(G + x, _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_storeu_ps(B + x, _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  const float* __restrict w = p.sc->w.data();
  for (std::int64_t x = W8; x < W; ++x)
    for (int c = 0; c < 3; ++c) {
      const float v0 = f[o0[x] + c], v1 = f[o1[x] + c];
      dst[c * W + x] = v0 + (v1 - v0) * w[x];
    }
}

template <class Out, bool kRound>
FERRY_AVX2 void run_pass_rgb_avx2(const Image& in, const std::vector<Tap>& ty, const std::vector<Tap>& tx, Out* out, bool chw,
                                  const float* a, const float* b) {
  constexpr int kC = 3;
  const std::int64_t H = static_cast<std::int64_t>(ty.size()), W = static_cast<std::int64_t>(tx.size());
  const std::pair<std::int64_t, std::int64_t> cols = tap_span(tx, in.w);
  const std::int64_t xa = cols.first, span = (cols.second - cols.first) * kC, W8 = W / 8 * 8;
  thread_local PlanarScratch sc;
  sc.cache.resize(static_cast<std::size_t>(2 * kC * W));
  sc.row.resize(static_cast<std::size_t>(span + 4));
  std::fill(sc.row.begin() + span, sc.row.end(), 0.f);  // what a padded tap reads
  pixel_taps(tx, xa, span, sc);
  sc.w8.resize(static_cast<std::size_t>(4 * W8));
  // Eight pixels' weights as the horizontal step's four vectors take them: vector j holds pixel
  // x + j's weight in its low four lanes and pixel x + 4 + j's in its high four.
  for (std::int64_t x = 0; x < W8; x += 8)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 4; ++l) {
        sc.w8[static_cast<std::size_t>(4 * x + 8 * j + l)] = sc.w[static_cast<std::size_t>(x + j)];
        sc.w8[static_cast<std::size_t>(4 * x + 8 * j + 4 + l)] = sc.w[static_cast<std::size_t>(x + 4 + j)];
      }
  const PlanarRows planar{static_cast<const std::uint8_t*>(in.data), in.w, xa, span, W, W8, &sc};
  // A call, not inlined: the lambda is not compiled for AVX2, horizontal_avx2 is.
  auto horizontal = [&planar](std::int64_t r, float* dst) { horizontal_avx2(planar, r, dst); };
  TwoRows rows{{sc.cache.data(), sc.cache.data() + kC * W}};
  alignas(32) float vals[8];
  for (std::int64_t y = 0; y < H; ++y) {
    const Tap& r = ty[static_cast<std::size_t>(y)];
    if (r.i0 < 0) {  // a padded row
      for (std::int64_t x = 0; x < W; ++x)
        for (int c = 0; c < kC; ++c) {
          const float o = a[c] * 0.f + b[c];
          if (chw)
            out[(c * H + y) * W + x] = store_as<Out>(o);
          else
            out[(y * W + x) * kC + c] = store_as<Out>(o);
        }
      continue;
    }
    const int s0 = rows.fetch(r.i0, -1, horizontal);
    const int s1 = rows.fetch(r.i1, s0, horizontal);
    const __m256 wy = _mm256_set1_ps(r.w);
    for (int c = 0; c < kC; ++c) {
      const float* __restrict t = rows.slot[s0] + c * W;
      const float* __restrict u = rows.slot[s1] + c * W;
      const __m256 A = _mm256_set1_ps(a[c]), Bc = _mm256_set1_ps(b[c]);
      Out* plane = out + (c * H + y) * W;  // chw
      Out* hwc = out + y * W * kC + c;
      for (std::int64_t x = 0; x < W8; x += 8) {
        const __m256 t8 = _mm256_loadu_ps(t + x), u8 = _mm256_loadu_ps(u + x);
        __m256 e = _mm256_add_ps(t8, _mm256_mul_ps(_mm256_sub_ps(u8, t8), wy));
        if constexpr (kRound) {
          const __m256 magic = _mm256_set1_ps(12582912.0f);
          e = _mm256_sub_ps(_mm256_add_ps(e, magic), magic);
        }
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(A, e), Bc);
        if constexpr (std::is_same_v<Out, float>) {
          if (chw) {
            _mm256_storeu_ps(plane + x, v);
            continue;
          }
        }
        _mm256_store_ps(vals, v);
        if (chw)
          for (int i = 0; i < 8; ++i) plane[x + i] = store_as<Out>(vals[i]);
        else
          for (int i = 0; i < 8; ++i) hwc[(x + i) * kC] = store_as<Out>(vals[i]);
      }
      for (std::int64_t x = W8; x < W; ++x) {
        float e = t[x] + (u[x] - t[x]) * r.w;
        if constexpr (kRound) e = round_even(e);
        const float o = a[c] * e + b[c];
        if (chw)
          plane[x] = store_as<Out>(o);
        else
          hwc[x * kC] = store_as<Out>(o);
      }
    }
  }
}
#undef FERRY_AVX2

std::atomic<bool> g_avx2_allowed{true};

bool use_avx2() noexcept {
  static const bool has = __builtin_cpu_supports("avx2");
  return has && g_avx2_allowed.load(std::memory_order_relaxed);
}
#endif

}  // namespace

bool allow_avx2_pass(bool allowed) noexcept {
#ifdef FERRY_PASS_AVX2
  g_avx2_allowed.store(allowed, std::memory_order_relaxed);
  return use_avx2();
#else
  (void)allowed;
  return false;
#endif
}

// One bilinear pass from `in` into `out`. Output is HWC, or CHW when `chw`; `round` rounds the
// interpolated value (uint8 semantics); the value written is a[c] * v + b[c].
template <class In, class Out>
void run_pass(const Image& in, const Axis& ay, const Axis& ax, Out* out, bool chw, bool round, const float* a, const float* b) {
  const std::vector<Tap> ty = taps(ay), tx = taps(ax);
  auto with = [&]<bool kRound>() {
    if constexpr (std::is_same_v<In, std::uint8_t>) {
#ifdef FERRY_PASS_AVX2
      if (in.c == 3 && use_avx2()) return run_pass_rgb_avx2<Out, kRound>(in, ty, tx, out, chw, a, b);
#endif
#ifdef FERRY_PASS_SSE2
      if (in.c == 3) return run_pass_rgb<Out, kRound>(in, ty, tx, out, chw, a, b);
#else
      if (in.c == 3) return run_pass_rows<Out, 3, kRound>(in, ty, tx, out, chw, a, b);
#endif
      if (in.c == 1) return run_pass_rows<Out, 1, kRound>(in, ty, tx, out, chw, a, b);
    }
    switch (in.c) {
      case 1: return run_pass_c<In, Out, 1, kRound>(in, ty, tx, out, chw, a, b);
      case 3: return run_pass_c<In, Out, 3, kRound>(in, ty, tx, out, chw, a, b);
      default: return run_pass_c<In, Out, 0, kRound>(in, ty, tx, out, chw, a, b);
    }
  };
  if (round)
    with.template operator()<true>();
  else
    with.template operator()<false>();
}

template void run_pass<std::uint8_t, std::uint8_t>(const Image&, const Axis&, const Axis&, std::uint8_t*, bool, bool,
                                                   const float*, const float*);
template void run_pass<std::uint8_t, float>(const Image&, const Axis&, const Axis&, float*, bool, bool, const float*,
                                            const float*);
template void run_pass<std::uint8_t, Half>(const Image&, const Axis&, const Axis&, Half*, bool, bool, const float*, const float*);
template void run_pass<std::uint8_t, BFloat16>(const Image&, const Axis&, const Axis&, BFloat16*, bool, bool, const float*,
                                               const float*);
template void run_pass<float, float>(const Image&, const Axis&, const Axis&, float*, bool, bool, const float*, const float*);
template void run_pass<float, Half>(const Image&, const Axis&, const Axis&, Half*, bool, bool, const float*, const float*);
template void run_pass<float, BFloat16>(const Image&, const Axis&, const Axis&, BFloat16*, bool, bool, const float*,
                                        const float*);

Image image_of(const Tensor& t) {
  if (!t.defined() || !t.device().is_host()) throw Error("ImageTransform: the image must be a host tensor, got " + t.str());
  if (t.dtype() != DType::UInt8 && t.dtype() != DType::Float32)
    throw Error("ImageTransform: images must be uint8 or float32, got " + t.str());
  if (t.dim() != 2 && t.dim() != 3) throw Error("ImageTransform: images must be [H, W] or [H, W, C], got " + t.str());
  const std::int64_t c = t.dim() == 3 ? t.size(2) : 1;
  if (t.size(0) <= 0 || t.size(1) <= 0 || c <= 0) throw Error("ImageTransform: empty image " + t.str());
  return {t.raw(), t.dtype(), t.size(0), t.size(1), c};
}

}  // namespace ferry::detail

namespace ferry {

using detail::Axis;
using detail::Image;
using detail::image_of;
using detail::run_pass;
using detail::Tap;
using detail::taps;

std::array<std::int64_t, 2> ImagePassPlan::Axis::source() const noexcept {
  const std::int64_t first = std::max<std::int64_t>(c1, 0), last = std::min(c1 + N, R) - 1;  // output-side j
  if (first > last) return {0, 0};
  if (!resized) return {c0 + first, c0 + last + 1};
  // Taps move monotonically with j; the first tap of `first` and the second of `last` bound them.
  const Tap lo = taps({c0, L0, R, first, 1, true, false, false})[0];
  const Tap hi = taps({c0, L0, R, last, 1, true, false, false})[0];
  return {lo.i0, hi.i1 + 1};
}

void apply_plan(const ImagePassPlan& plan, const Tensor& image, const Tensor& out) {
  const Image in = image_of(image);
  const std::int64_t C = plan.channels;
  if (in.dtype != DType::UInt8 || in.c != C)
    throw Error("apply_plan: the image must be uint8 with " + std::to_string(C) + " channels, got " + image.str());
  const DType dtype = plan.to_float ? plan.out_dtype : DType::UInt8;
  const bool chw = plan.to_float && !plan.channels_last;
  const Shape want = chw ? Shape{C, plan.y.N, plan.x.N} : Shape{plan.y.N, plan.x.N, C};
  if (!out.defined() || !out.device().is_host() || out.dtype() != dtype || out.shape() != want)
    throw Error("apply_plan: output " + out.str() + " does not match the plan's " + shape_str(want));
  const auto [y0, y1] = plan.y.source();
  const auto [x0, x1] = plan.x.source();
  if ((y0 < y1 && (y0 < 0 || y1 > in.h)) || (x0 < x1 && (x0 < 0 || x1 > in.w)))
    throw Error("apply_plan: the plan reads rows [" + std::to_string(y0) + ", " + std::to_string(y1) + ") and columns [" +
                std::to_string(x0) + ", " + std::to_string(x1) + ") of a " + image.str());
  const Axis ay{plan.y.c0, plan.y.L0, plan.y.R, plan.y.c1, plan.y.N, plan.y.resized, plan.y.flip, false};
  const Axis ax{plan.x.c0, plan.x.L0, plan.x.R, plan.x.c1, plan.x.N, plan.x.resized, plan.x.flip, false};
  switch (dtype) {
    case DType::Float32: return run_pass<std::uint8_t, float>(in, ay, ax, out.data<float>(), chw, plan.round, plan.a, plan.b);
    case DType::Float16: return run_pass<std::uint8_t, Half>(in, ay, ax, out.data<Half>(), chw, plan.round, plan.a, plan.b);
    case DType::BFloat16:
      return run_pass<std::uint8_t, BFloat16>(in, ay, ax, out.data<BFloat16>(), chw, plan.round, plan.a, plan.b);
    case DType::UInt8:
      return run_pass<std::uint8_t, std::uint8_t>(in, ay, ax, out.data<std::uint8_t>(), false, true, plan.a, plan.b);
    default: throw Error(std::string("apply_plan: the plan's output dtype ") + dtype_name(dtype) + " is not an image output");
  }
}

}  // namespace ferry
