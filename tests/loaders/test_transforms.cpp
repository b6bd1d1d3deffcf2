// Tests that resize, crop and flip match values computed independently with PyTorch
// (make_transform_reference.py), that the fused pass equals the steps run one by one, and that
// random_resized_crop follows torchvision's box rules and the per-sample generator.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>

#include "ferry/ferry.h"

using namespace ferry;

namespace {

// Reference values printed by tests/loaders/make_transform_reference.py (PyTorch 1.13).
// kInput: [4, 6, 3]
const std::vector<int> kInput = {0,   3,   6,   11,  14,  17,  22,  25,  28,  33,  36,  39,  44,  47,  50,  55,  58,  61,
                                 37,  45,  53,  48,  56,  64,  59,  67,  75,  70,  78,  86,  81,  89,  97,  92,  100, 108,
                                 74,  87,  100, 85,  98,  111, 96,  109, 122, 107, 120, 133, 118, 131, 144, 129, 142, 155,
                                 111, 129, 147, 122, 140, 158, 133, 151, 169, 144, 162, 180, 155, 173, 191, 166, 184, 202};
// kResize3x4: [3, 4, 3]
const std::vector<int> kResize3x4 = {9,  13,  17,  25,  29,  33,  42,  46,  50,  58,  62,  66,  58,  69,  79,  75,  85,  96,
                                     91, 102, 112, 108, 118, 129, 108, 125, 142, 124, 141, 158, 141, 158, 175, 157, 174, 191};
// kResize7x9: [7, 9, 3]
const std::vector<int> kResize7x9 = {
    0,   3,   6,   6,   8,   12,  13,  16,  19,  20,  23,  26,  28,  31,  34,  35,  38,  41,  42,  45,  48,  50,  52,  56,
    55,  58,  61,  13,  18,  23,  19,  24,  28,  26,  31,  36,  33,  38,  43,  41,  46,  50,  48,  53,  58,  55,  60,  65,
    63,  68,  72,  68,  73,  78,  34,  42,  50,  40,  48,  55,  47,  55,  62,  55,  62,  70,  62,  70,  77,  69,  77,  84,
    77,  84,  92,  84,  92,  99,  89,  97,  105, 56,  66,  77,  61,  72,  82,  68,  79,  89,  76,  86,  97,  83,  94,  104,
    90,  101, 111, 98,  108, 119, 105, 116, 126, 110, 121, 132, 77,  90,  103, 82,  96,  109, 89,  103, 116, 97,  110, 124,
    104, 118, 131, 111, 125, 138, 119, 132, 146, 126, 140, 153, 132, 145, 158, 98,  114, 130, 103, 120, 136, 111, 127, 143,
    118, 134, 150, 125, 142, 158, 133, 149, 165, 140, 156, 172, 147, 164, 180, 153, 169, 185, 111, 129, 147, 116, 134, 152,
    124, 142, 160, 131, 149, 167, 138, 156, 174, 146, 164, 182, 153, 171, 189, 160, 178, 196, 166, 184, 202};
// kCenterCrop2x3: [2, 3, 3]
const std::vector<int> kCenterCrop2x3 = {59, 67, 75, 70, 78, 86, 81, 89, 97, 96, 109, 122, 107, 120, 133, 118, 131, 144};
// kCropResize: [5, 5, 3]
const std::vector<int> kCropResize = {
    48,  56,  64,  56,  64,  72,  64,  72,  80,  73,  81,  89,  81,  89,  97,  63,  73,  83,  70,  80,  90,  79,  89,  99,  88,
    98,  108, 96,  106, 116, 85,  98,  111, 93,  106, 119, 102, 114, 128, 110, 123, 136, 118, 131, 144, 107, 123, 139, 115, 131,
    147, 124, 140, 156, 132, 148, 164, 140, 156, 172, 122, 140, 158, 130, 148, 166, 138, 156, 174, 147, 165, 183, 155, 173, 191};
// kResizeCrop: [3, 4, 3]
const std::vector<int> kResizeCrop = {45, 52, 59, 52, 59, 65,  59, 65, 72,  65, 72,  79,  64, 73,  82,  70,  80,  89,
                                      77, 86, 96, 84, 93, 102, 82, 94, 106, 89, 101, 112, 96, 107, 119, 102, 114, 126};
// kResizeFlip: [5, 7, 3]
const std::vector<int> kResizeFlip = {55,  58,  61,  46,  49,  52,  37,  40,  43,  28,  30,  34,  18,  21,  24,  9,   12,  15,
                                      0,   3,   6,   81,  87,  94,  72,  79,  85,  63,  69,  76,  53,  60,  66,  44,  50,  57,
                                      35,  41,  48,  26,  32,  39,  110, 121, 132, 102, 112, 123, 92,  103, 113, 83,  94,  104,
                                      74,  84,  95,  64,  75,  85,  56,  66,  76,  140, 155, 169, 131, 146, 160, 122, 137, 151,
                                      113, 127, 142, 103, 118, 132, 94,  108, 123, 85,  100, 114, 166, 184, 202, 157, 175, 193,
                                      148, 166, 184, 138, 156, 174, 129, 147, 165, 120, 138, 156, 111, 129, 147};

Tensor u8(const std::vector<int>& v, Shape shape) {
  Tensor t = Tensor::empty(DType::UInt8, std::move(shape));
  for (std::size_t i = 0; i < v.size(); ++i) t.data<std::uint8_t>()[i] = static_cast<std::uint8_t>(v[i]);
  REQUIRE(static_cast<std::size_t>(t.numel()) == v.size());
  return t;
}

// Largest absolute difference between a uint8 result and reference values.
int max_diff(const Tensor& t, const std::vector<int>& ref) {
  REQUIRE(static_cast<std::size_t>(t.numel()) == ref.size());
  int d = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) d = std::max(d, std::abs(t.data<std::uint8_t>()[i] - ref[i]));
  return d;
}

const Tensor& input() {
  static const Tensor t = u8(kInput, {4, 6, 3});
  return t;
}

}  // namespace

TEST_CASE("resize and crops match PyTorch's bilinear interpolation", "[unit][transforms]") {
  Generator g(1);
  // Float rounding may differ from ATen's by one unit where a value lands on .5.
  CHECK(max_diff(ImageTransform().resize(3, 4)(input(), g), kResize3x4) <= 1);
  CHECK(max_diff(ImageTransform().resize(7, 9)(input(), g), kResize7x9) <= 1);
  CHECK(max_diff(ImageTransform().center_crop(2, 3)(input(), g), kCenterCrop2x3) == 0);
  CHECK(max_diff(ImageTransform().resize(8, 10).center_crop(3, 4)(input(), g), kResizeCrop) <= 1);
  CHECK(max_diff(ImageTransform().resize(5, 7).horizontal_flip(1.0)(input(), g), kResizeFlip) <= 1);
  // A flip before the resize gives the same image: bilinear resampling commutes with mirroring.
  CHECK(max_diff(ImageTransform().horizontal_flip(1.0).resize(5, 7)(input(), g), kResizeFlip) <= 1);
}

TEST_CASE("random_resized_crop is a crop then a resize, with torchvision's box", "[unit][transforms]") {
  // With scale (1, 1) and ratio (1.5, 1.5) the only box is the whole 4x6 image: an identity.
  Generator g(3);
  CHECK(max_diff(ImageTransform().random_resized_crop(4, 6, {1.0, 1.0}, {1.5, 1.5})(input(), g), kInput) == 0);
  // The reference crop (top 1, left 1, 3x4) then resize to 5x5.
  Tensor cropped = Tensor::empty(DType::UInt8, {3, 4, 3});
  for (int y = 0; y < 3; ++y)
    for (int x = 0; x < 4; ++x)
      for (int c = 0; c < 3; ++c)
        cropped.data<std::uint8_t>()[(y * 4 + x) * 3 + c] = input().data<std::uint8_t>()[((y + 1) * 6 + x + 1) * 3 + c];
  CHECK(max_diff(ImageTransform().resize(5, 5)(cropped, g), kCropResize) <= 1);
  // Boxes stay inside the image and cover at least `scale` of it, over many draws.
  Tensor big = Tensor::zeros(DType::UInt8, {375, 500, 3});
  for (std::uint64_t i = 0; i < 200; ++i) {
    Generator r(7, 0, i);
    Tensor out = ImageTransform().random_resized_crop(224, 224)(big, r);
    CHECK(out.shape() == Shape{224, 224, 3});
  }
  // A 1x100 strip never fits ratio (3/4, 4/3) at scale >= 0.08 of its area: the fallback is the
  // central crop of ratio 4/3 (h = 1, w = round(4/3) = 1), resized.
  Tensor strip = Tensor::empty(DType::UInt8, {1, 100, 1});
  for (int x = 0; x < 100; ++x) strip.data<std::uint8_t>()[x] = static_cast<std::uint8_t>(x);
  Generator r(5);
  Tensor out = ImageTransform().random_resized_crop(2, 2)(strip, r);
  for (int k = 0; k < 4; ++k) CHECK(out.data<std::uint8_t>()[k] == 49);  // column (100 - 1) / 2
}

TEST_CASE("the same sample draws the same crop whichever worker runs it", "[unit][transforms]") {
  Tensor big = Tensor::empty(DType::UInt8, {64, 80, 3});
  for (std::int64_t i = 0; i < big.numel(); ++i) big.data<std::uint8_t>()[i] = static_cast<std::uint8_t>(i * 31 % 251);
  auto t = ImageTransform().random_resized_crop(16, 16).horizontal_flip();
  Generator a(11, 2, 5), b(11, 2, 5), c(11, 2, 6);
  CHECK(t(big, a).equal(t(big, b)));
  CHECK_FALSE(t(big, a).equal(t(big, c)));
}

TEST_CASE("to_float and normalize are folded into the write", "[unit][transforms]") {
  Generator g(1);
  Tensor out = ImageTransform().center_crop(2, 3).to_float().normalize({0.5f, 0.25f, 0.f}, {0.5f, 0.5f, 1.f})(input(), g);
  REQUIRE(out.shape() == Shape{3, 2, 3});  // CHW
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 2; ++y)
      for (int x = 0; x < 3; ++x) {
        const float v = static_cast<float>(kCenterCrop2x3[static_cast<std::size_t>((y * 3 + x) * 3 + c)]) / 255.f;
        const float mean[] = {0.5f, 0.25f, 0.f}, sd[] = {0.5f, 0.5f, 1.f};
        CHECK(out.data<float>()[(c * 2 + y) * 3 + x] == Approx((v - mean[c]) / sd[c]).margin(1e-5));
      }
  // Resizing after to_float works in float, without rounding: equals the float interpolation.
  Tensor f = ImageTransform().to_float().resize(7, 9)(input(), g);
  Tensor r = ImageTransform().resize(7, 9).to_float()(input(), g);
  double worst_f = 0, worst_r = 0;
  for (std::size_t i = 0; i < kResize7x9.size(); ++i) {
    const std::size_t y = i / 27, x = i / 3 % 9, c = i % 3;
    worst_f = std::max(worst_f, std::abs(f.data<float>()[(c * 7 + y) * 9 + x] * 255.0 - kResize7x9[i]));
    worst_r = std::max(worst_r, std::abs(r.data<float>()[(c * 7 + y) * 9 + x] * 255.0 - kResize7x9[i]));
  }
  CHECK(worst_f <= 0.5 + 1e-3);  // unrounded
  CHECK(worst_r <= 1.0 + 1e-3);  // rounded uint8 values, as the reference
}

TEST_CASE("a second resize starts a new pass and equals the steps run one by one", "[unit][transforms]") {
  Generator g(1);
  Tensor two = ImageTransform().resize(7, 9).center_crop(5, 5).resize(3, 3).horizontal_flip(1.0)(input(), g);
  Tensor first = ImageTransform().resize(7, 9).center_crop(5, 5)(input(), g);
  Tensor second = ImageTransform().resize(3, 3).horizontal_flip(1.0)(first, g);
  CHECK(two.equal(second));
  // A crop folded into the following resize samples exactly the cropped window.
  for (bool flip : {false, true}) {
    Tensor fused = ImageTransform().center_crop(3, 4).horizontal_flip(flip ? 1.0 : 0.0).resize(5, 6)(input(), g);
    Tensor crop = ImageTransform().center_crop(3, 4)(input(), g);
    Tensor apart = ImageTransform().resize(5, 6).horizontal_flip(flip ? 1.0 : 0.0)(crop, g);
    CHECK(fused.equal(apart));
  }
  // A crop larger than the image pads with zeros, as torchvision's center_crop.
  Tensor padded = ImageTransform().center_crop(6, 6)(input(), g);
  CHECK(padded.data<std::uint8_t>()[0] == 0);                        // row 0 is padding ((6 - 4) / 2 = 1 row)
  CHECK(padded.data<std::uint8_t>()[(1 * 6 + 0) * 3] == kInput[0]);  // then the image, columns unchanged
}

TEST_CASE("transform shapes and errors", "[errors][transforms]") {
  CHECK(ImageTransform().random_resized_crop(224, 224).to_float().fixed_output_shape(3) == Shape{3, 224, 224});
  CHECK(ImageTransform().resize_shorter(256).fixed_output_shape(3) == std::nullopt);
  CHECK(ImageTransform().resize_shorter(256).center_crop(224, 224).fixed_output_shape(0) == Shape{224, 224});
  CHECK(ImageTransform().resize_shorter(2).output_shape(4, 6, 3) == Shape{2, 3, 3});
  CHECK_THROWS_WITH(ImageTransform().normalize({0.5f}, {0.5f}), Catch::Contains("must follow to_float"));
  CHECK_THROWS_WITH(ImageTransform().to_float().normalize({0.5f}, {0.f}), Catch::Contains("std must be positive"));
  CHECK_THROWS_WITH(ImageTransform().resize(0, 5), Catch::Contains("between 1 and"));
  CHECK_THROWS_WITH(ImageTransform().random_resized_crop(5, 5, {0.5, 0.1}), Catch::Contains("scale"));
  CHECK_THROWS_WITH(ImageTransform().horizontal_flip(2.0), Catch::Contains("p must be in [0, 1]"));
  Generator g(1);
  CHECK_THROWS_WITH(ImageTransform().to_float().normalize({0.1f, 0.2f}, {1.f, 1.f})(input(), g),
                    Catch::Contains("2 means for an image of 3 channels"));
  Tensor wrong = Tensor::empty(DType::UInt8, {3, 3, 3});
  CHECK_THROWS_WITH(ImageTransform().resize(2, 2).apply_into(input(), wrong, g), Catch::Contains("does not match"));
  CHECK_THROWS_WITH(ImageTransform().resize(2, 2)(Tensor::empty(DType::Int32, {2, 2}), g), Catch::Contains("uint8 or float32"));
}

#include "ferry/detail/pass_math.h"
#include "ferry/detail/pass_paths.h"

namespace {
detail::PassAxis pass_axis(const ImagePassPlan::Axis& a) {
  return {a.c0, a.L0, a.R, a.c1, a.N, a.resized ? 1 : 0, a.flip ? 1 : 0};
}
}  // namespace

TEST_CASE("a transform's single-pass plan, evaluated per pixel, equals apply_into bit for bit", "[unit][transforms][plan]") {
  // The device kernel of GPU decode evaluates the plan with ferry/detail/pass_math.h; on the same
  // decoded pixels it must give what the CPU path gives, with the same random crop and flip.
  std::vector<std::pair<std::string, ImageTransform>> transforms;
  transforms.emplace_back("train",
                          ImageTransform().random_resized_crop(24, 20).horizontal_flip().to_float().normalize({0.45f}, {0.226f}));
  transforms.emplace_back("train uint8", ImageTransform().random_resized_crop(16, 16).horizontal_flip());
  transforms.emplace_back("eval", ImageTransform().resize_shorter(18).center_crop(16, 16).to_float());
  transforms.emplace_back("upscale + pad", ImageTransform().center_crop(40, 44).horizontal_flip(1.0).to_float());
  // Every output the 3-channel fast path writes: HWC floats, 16-bit floats, widths that are not
  // a multiple of its 4 pixels, padding on both axes.
  transforms.emplace_back(
      "train channels_last",
      ImageTransform().random_resized_crop(23, 21).horizontal_flip().to_float().channels_last().normalize({0.485f}, {0.229f}));
  transforms.emplace_back(
      "train bfloat16",
      ImageTransform().random_resized_crop(22, 19).horizontal_flip().to_float(DType::BFloat16).normalize({0.5f}, {0.25f}));
  transforms.emplace_back("eval float16 + pad", ImageTransform().resize_shorter(17).center_crop(21, 27).to_float(DType::Float16));
  // Narrower than one AVX2 step of eight pixels: the tail alone.
  transforms.emplace_back("train narrow", ImageTransform().random_resized_crop(5, 7).horizontal_flip().to_float());
  // Per-channel means and stds (3 channels only): each channel's own multiply-add.
  transforms.emplace_back("train rgb", ImageTransform().random_resized_crop(25, 22).horizontal_flip().to_float().normalize(
                                           {0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}));
  transforms.emplace_back("train rgb channels_last",
                          ImageTransform().random_resized_crop(21, 26).horizontal_flip().to_float().channels_last().normalize(
                              {0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}));
  // Both 3-channel kernels where the CPU has AVX2: the AVX2 one, then the SSE2 one.
  const bool avx2 = detail::allow_avx2_pass(true);
  struct AllowAvx2Again {
    ~AllowAvx2Again() { detail::allow_avx2_pass(true); }
  } again;
  for (const bool use_avx2 : {true, false}) {
    if (use_avx2 && !avx2) continue;
    detail::allow_avx2_pass(use_avx2);
    for (auto& [name, t] : transforms) {
      for (int channels : {1, 3}) {
        if (channels == 1 && name.starts_with("train rgb")) continue;
        for (std::uint64_t seed = 0; seed < 40; ++seed) {
          INFO(name << ", channels " << channels << ", seed " << seed << (use_avx2 ? ", AVX2" : ""));
          Generator shape_rng(seed, 99);
          const std::int64_t H = 20 + static_cast<std::int64_t>(shape_rng.randint(40)),
                             W = 20 + static_cast<std::int64_t>(shape_rng.randint(40));
          Tensor img = Tensor::empty(DType::UInt8, {H, W, channels});
          for (std::int64_t k = 0; k < img.numel(); ++k)
            img.data<std::uint8_t>()[k] = static_cast<std::uint8_t>(shape_rng.randint(256));
          Generator g1(seed, 1, 2), g2(seed, 1, 2);
          const Tensor want = t(img, g1);
          const std::optional<ImagePassPlan> plan = t.plan(H, W, channels, g2);
          REQUIRE(plan);
          const detail::PassAxis ay = pass_axis(plan->y), ax = pass_axis(plan->x);
          const std::int64_t OH = ay.N, OW = ax.N;
          REQUIRE(want.numel() == OH * OW * channels);
          std::size_t mismatches = 0;
          for (std::int64_t y = 0; y < OH; ++y)
            for (std::int64_t x = 0; x < OW; ++x)
              for (int c = 0; c < channels; ++c) {
                const float v = detail::pass_value(img.data<std::uint8_t>(), W * channels, channels, detail::pass_tap(ay, y),
                                                   detail::pass_tap(ax, x), c, plan->round);
                if (plan->to_float) {
                  const float got = plan->a[c] * v + plan->b[c];
                  const std::int64_t at = plan->channels_last ? (y * OW + x) * channels + c : (c * OH + y) * OW + x;
                  if (plan->out_dtype == DType::Float16)
                    mismatches += detail::pass_f16_bits(got) != want.data<Half>()[at].bits;
                  else if (plan->out_dtype == DType::BFloat16)
                    mismatches += detail::pass_bf16_bits(got) != want.data<BFloat16>()[at].bits;
                  else
                    mismatches += got != want.data<float>()[at];
                } else {
                  mismatches +=
                      detail::pass_store_u8(v, plan->a[c], plan->b[c]) != want.data<std::uint8_t>()[(y * OW + x) * channels + c];
                }
              }
          REQUIRE(mismatches == 0);
        }
      }
    }
  }
  // Two resizes cannot be one pass: no plan.
  Generator g(0);
  CHECK_FALSE(ImageTransform().resize(30, 30).resize(10, 10).plan(40, 40, 3, g));
}

TEST_CASE("16-bit float conversions round to nearest even, as the compiler's _Float16 and torch's bfloat16",
          "[unit][transforms]") {
  auto bits_of = [](float f) {
    std::uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    return x;
  };
  auto from_bits = [](std::uint32_t x) {
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
  };
  std::vector<float> values = {0.f,
                               -0.f,
                               1.f,
                               -2.5f,
                               65504.f,
                               65519.99f,
                               65520.f,
                               -70000.f,
                               1e-8f,
                               std::ldexp(1.f, -25),
                               std::ldexp(1.5f, -25),
                               std::ldexp(1.f, -24),
                               std::ldexp(3.f, -25),
                               std::ldexp(1.f, -14),
                               std::ldexp(1023.f, -24),
                               std::ldexp(2047.f, -25),
                               INFINITY,
                               -INFINITY,
                               0.1f,
                               1.0009765625f,
                               1.00048828125f,
                               1.00146484375f};
  Generator g(7);
  for (int k = 0; k < 200000; ++k) values.push_back(from_bits(g()));  // every exponent, NaNs included
  std::size_t bad_half = 0, bad_bf16 = 0;
  for (float f : values) {
    const _Float16 h = static_cast<_Float16>(f);
    std::uint16_t hb;
    std::memcpy(&hb, &h, sizeof hb);
    if (std::isnan(f))
      bad_half += (detail::pass_f16_bits(f) & 0x7c00u) != 0x7c00u || (detail::pass_f16_bits(f) & 0x3ffu) == 0;
    else
      bad_half += detail::pass_f16_bits(f) != hb;
    // bfloat16 is float32's top half: the nearest of the two candidates, ties to the even one.
    const std::uint16_t b = detail::pass_bf16_bits(f);
    if (std::isnan(f)) {
      bad_bf16 += !std::isnan(from_bits(static_cast<std::uint32_t>(b) << 16));
    } else if (!std::isinf(f)) {
      const std::uint32_t x = bits_of(f);
      const float lo = from_bits(x & 0xffff0000u), hi = from_bits((x & 0xffff0000u) + 0x10000u);
      // Past the largest finite value the next candidate is infinity, which IEEE rounding treats
      // as 2^128 for the distance.
      const double hi_d = std::isinf(hi) ? std::copysign(std::ldexp(1.0, 128), hi) : hi;
      const double dlo = std::abs(static_cast<double>(f) - lo), dhi = std::abs(static_cast<double>(f) - hi_d);
      const std::uint16_t want = dlo < dhi   ? static_cast<std::uint16_t>(x >> 16)
                                 : dhi < dlo ? static_cast<std::uint16_t>((x >> 16) + 1)
                                             : static_cast<std::uint16_t>((x >> 16) + ((x >> 16) & 1u));
      bad_bf16 += b != want;
    }
  }
  CHECK(bad_half == 0);
  CHECK(bad_bf16 == 0);
}

TEST_CASE("to_float to float16 or bfloat16, and channels_last, write the float32 values rounded and laid out as asked",
          "[unit][transforms]") {
  Generator shape_rng(3);
  Tensor img = Tensor::empty(DType::UInt8, {37, 45, 3});
  for (std::int64_t k = 0; k < img.numel(); ++k) img.data<std::uint8_t>()[k] = static_cast<std::uint8_t>(shape_rng.randint(256));
  auto base = [] { return ImageTransform().random_resized_crop(12, 10).horizontal_flip(); };
  const std::vector<float> mean{0.485f, 0.456f, 0.406f}, stdev{0.229f, 0.224f, 0.225f};
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    INFO("seed " << seed);
    Generator g0(seed), g1(seed), g2(seed), g3(seed), g4(seed);
    const Tensor f32 = base().to_float().normalize(mean, stdev)(img, g0);
    const Tensor f16 = base().to_float(DType::Float16).normalize(mean, stdev)(img, g1);
    const Tensor bf16 = base().to_float(DType::BFloat16).normalize(mean, stdev)(img, g2);
    const ImageTransform nhwc = base().to_float(DType::BFloat16).channels_last().normalize(mean, stdev);
    const Tensor last = nhwc(img, g3);
    REQUIRE(f16.dtype() == DType::Float16);
    REQUIRE(bf16.shape() == Shape{3, 12, 10});
    REQUIRE(last.shape() == Shape{12, 10, 3});
    std::size_t bad = 0;
    for (std::int64_t c = 0; c < 3; ++c)
      for (std::int64_t y = 0; y < 12; ++y)
        for (std::int64_t x = 0; x < 10; ++x) {
          const std::int64_t chw = (c * 12 + y) * 10 + x, hwc = (y * 10 + x) * 3 + c;
          const float v = f32.data<float>()[chw];
          bad += f16.data<Half>()[chw].bits != detail::pass_f16_bits(v);
          bad += bf16.data<BFloat16>()[chw].bits != detail::pass_bf16_bits(v);
          bad += last.data<BFloat16>()[hwc].bits != detail::pass_bf16_bits(v);
        }
    CHECK(bad == 0);
    // The plan carries dtype and layout; apply_plan writes the same.
    const std::optional<ImagePassPlan> plan = nhwc.plan(37, 45, 3, g4);
    REQUIRE(plan);
    CHECK(plan->out_dtype == DType::BFloat16);
    CHECK(plan->channels_last);
    Tensor again = Tensor::empty(DType::BFloat16, {12, 10, 3});
    apply_plan(*plan, img, again);
    CHECK(std::memcmp(again.raw(), last.raw(), static_cast<std::size_t>(last.nbytes())) == 0);
  }
  CHECK(base().to_float(DType::Float16).channels_last().output_dtype(DType::UInt8) == DType::Float16);
  CHECK(base().to_float().channels_last().fixed_output_shape(3) == Shape{12, 10, 3});
  CHECK(base().to_float(DType::BFloat16).channels_last().str().find("to_float(bfloat16) -> channels_last") != std::string::npos);
  CHECK_THROWS_WITH(ImageTransform().to_float(DType::Int32), Catch::Contains("float32, float16 or bfloat16"));
  CHECK_THROWS_WITH(ImageTransform().channels_last(), Catch::Contains("must follow to_float"));
}
