// ferry/detail/pass_math.h — one output value of an ImagePassPlan, for host and device code.
//
// The same arithmetic as the CPU pass in loaders/image_pass.cpp (taps with half-pixel centres
// as ATen's area_pixel_compute_source_index, two lerps, round half to even, one multiply-add),
// written per output pixel so a CUDA kernel can evaluate it. Compiled for the device without
// fused multiply-add contraction (-fmad=false), it gives the CPU pass's values bit for bit on the
// same decoded pixels (tests/loaders/test_transforms.cpp checks the host side against
// apply_into). Plain C++17 and CUDA: no ferry header.. Not for direct use.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FERRY_HD __host__ __device__
#else
#define FERRY_HD
#endif

namespace ferry::detail {

/// Plain-old-data copy of ImagePassPlan::Axis for device code.
struct PassAxis {
  std::int64_t c0, L0, R, c1, N;
  int resized, flip;
};

/// Source taps of output index k: i0 < 0 means padding (the value is 0).
struct PassTap {
  std::int64_t i0, i1;
  float w;
};

FERRY_HD inline PassTap pass_tap(const PassAxis& a, std::int64_t k) {
  const std::int64_t j = a.c1 + (a.flip ? a.N - 1 - k : k);
  if (j < 0 || j >= a.R) return {-1, -1, 0.f};
  if (!a.resized) return {a.c0 + j, a.c0 + j, 0.f};
  const float scale = static_cast<float>(a.L0) / static_cast<float>(a.R);
  float x = scale * (static_cast<float>(j) + 0.5f) - 0.5f;
  if (x < 0) x = 0;
  const auto i0 = static_cast<std::int64_t>(x);
  const std::int64_t i1 = i0 + (i0 < a.L0 - 1 ? 1 : 0);
  return {a.c0 + i0, a.c0 + i1, x - static_cast<float>(i0)};
}

/// The value before the final multiply-add at output (ty, tx), channel c, of an HWC uint8 image
/// `src` with row pitch `pitch` bytes and C channels.
FERRY_HD inline float pass_value(const std::uint8_t* src, std::int64_t pitch, int C, const PassTap& ty, const PassTap& tx, int c,
                                 bool round) {
  if (ty.i0 < 0 || tx.i0 < 0) return 0.f;
  const std::uint8_t* row0 = src + ty.i0 * pitch;
  const std::uint8_t* row1 = src + ty.i1 * pitch;
  const float p00 = row0[tx.i0 * C + c], p01 = row0[tx.i1 * C + c];
  const float p10 = row1[tx.i0 * C + c], p11 = row1[tx.i1 * C + c];
  const float top = p00 + (p01 - p00) * tx.w, bottom = p10 + (p11 - p10) * tx.w;
  float v = top + (bottom - top) * ty.w;
#if defined(__CUDA_ARCH__)
  if (round) v = rintf(v);
#else
  if (round) v = std::nearbyint(v);
#endif
  return v;
}

/// The stored uint8 value (HWC output without to_float).
FERRY_HD inline std::uint8_t pass_store_u8(float v, float a, float b) {
  v = a * v + b;
  v = v < 0.f ? 0.f : (v > 255.f ? 255.f : v);
  return static_cast<std::uint8_t>(v);
}

FERRY_HD inline std::uint32_t pass_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  return x;
#endif
}

/// float -> IEEE half (binary16) bits, rounding to nearest even (subnormals, infinities and NaN
/// included): integer operations only, so host and device give the same bits.
FERRY_HD inline std::uint16_t pass_f16_bits(float f) {
  std::uint32_t x = pass_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<std::uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // 65520 and up round to infinity
  if (x < 0x38800000u) {                                                    // below 2^-14: subnormal or zero
    if (x < 0x33000000u) return static_cast<std::uint16_t>(sign);           // 2^-25 and below: zero (ties to even)
    const std::uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(x >> 23);
    std::uint32_t r = m >> shift;
    const std::uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = (x >> 13) - (112u << 10);  // rebias the exponent (127 -> 15)
  const std::uint32_t rest = x & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;  // a carry moves into the exponent, as it should
  return static_cast<std::uint16_t>(sign | r);
}

/// float -> bfloat16 bits, rounding to nearest even (NaN stays NaN).
FERRY_HD inline std::uint16_t pass_bf16_bits(float f) {
  std::uint32_t x = pass_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

/// The device gather's row transform (ferry::RowTransform): walks the elements of a uint8 HWC row
/// of H x W x C (H * W * C < 2^31) in order from element p, and `o` is where the current one lands
/// in the output row, mirrored left-right when `flip`, CHW when `chw`. `o` is stepped, not worked
/// out again: the next channel is a plane (CHW) or one element (HWC) on; after the last channel,
/// the next pixel's first is one pixel on or back; only a new image row computes it afresh. So the
/// kernel divides once a word, and the CPU check of its values (test_idx) walks the same way.
struct RowCursor {
  int H, W, C, c, x, y;
  bool flip, chw;
  int c_step, wrap;  // o's step to the next channel, and from the last channel to the next pixel's first
  int o;
  FERRY_HD RowCursor(int p, int h, int w, int ch, bool mirror, bool planes)
      : H(h),
        W(w),
        C(ch),
        c(p % ch),
        x((p / ch) % w),
        y(p / ch / w),
        flip(mirror),
        chw(planes),
        c_step(planes ? h * w : 1),
        wrap((planes ? 1 : ch) * (mirror ? -1 : 1) - (ch - 1) * c_step),
        o(out()) {}
  FERRY_HD int out() const {
    const int xx = flip ? W - 1 - x : x;
    return chw ? (c * H + y) * W + xx : (y * W + xx) * C + c;
  }
  FERRY_HD void next() {
    if (++c < C) {
      o += c_step;
      return;
    }
    c = 0;
    if (++x < W) {
      o += wrap;
      return;
    }
    x = 0;
    ++y;
    o = out();
  }
};

/// Output kinds of an ImagePassPlan (ImagePassPlan::out_dtype), as the encoded index stores them.
enum PassOutput : int { kPassUInt8 = 0, kPassFloat32 = 1, kPassFloat16 = 2, kPassBFloat16 = 3 };

/// Writes a * v + b as output kind `kind` (PassOutput) at element o of `out`: the value the CPU
/// pass stores (uint8 clamped to [0, 255] and truncated; 16-bit floats rounded to nearest even).
FERRY_HD inline void pass_store(void* out, std::int64_t o, int kind, float v, float a, float b) {
  v = a * v + b;
  switch (kind) {
    case kPassFloat32: static_cast<float*>(out)[o] = v; break;
    case kPassFloat16: static_cast<std::uint16_t*>(out)[o] = pass_f16_bits(v); break;
    case kPassBFloat16: static_cast<std::uint16_t*>(out)[o] = pass_bf16_bits(v); break;
    default: static_cast<std::uint8_t*>(out)[o] = static_cast<std::uint8_t>(v < 0.f ? 0.f : (v > 255.f ? 255.f : v)); break;
  }
}

/// Words (int64) per image in an encoded batch's index (LabeledBatch::encoded_index), written by
/// the worker (ImageFolder, TarImages) and read by the device stage and the decode kernel; the
/// word of each value is named in EncodedRow.
inline constexpr std::int64_t kEncodedIndexWords = 32;

/// Where each value sits in an encoded batch's index row.
struct EncodedRow {
  static constexpr int kOffset = 0;    ///< the file's first byte in the batch's pinned block
  static constexpr int kBytes = 1;     ///< the file's size
  static constexpr int kHeight = 2;    ///< the decoded image's height
  static constexpr int kWidth = 3;     ///< and width
  static constexpr int kAxisY = 4;     ///< the y axis's 7 words: c0, L0, R, c1, N, resized, flip (PassAxis)
  static constexpr int kAxisX = 11;    ///< the x axis's 7 words
  static constexpr int kAxisSize = 4;  ///< N within an axis: the output's size along it
  static constexpr int kOutHeight = kAxisY + kAxisSize;
  static constexpr int kOutWidth = kAxisX + kAxisSize;
  static constexpr int kChannels = 18;
  static constexpr int kRound = 19;
  static constexpr int kOutput = 20;        ///< the output kind (PassOutput)
  static constexpr int kScale = 21;         ///< a[0..3], float bits
  static constexpr int kShift = 25;         ///< b[0..3], float bits
  static constexpr int kScratch = 29;       ///< the decoded image's place in the device scratch (set by the device stage)
  static constexpr int kChannelsLast = 30;  ///< float outputs: HWC instead of CHW
};
static_assert(EncodedRow::kChannelsLast < kEncodedIndexWords);

}  // namespace ferry::detail
