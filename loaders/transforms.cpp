// Note [Fused transforms]
// Each axis of a pass is described by a small state: the source window [c0, c0 + L0) that was
// resized to R samples (or no resize: R == L0), then a crop offset c1 and output length N in the
// resized grid, and a flip flag. Output index k reads resized sample
//     j = c1 + (flip ? N - 1 - k : k)           (zero when j is outside [0, R): padding)
// and resized sample j reads the source at x = (j + 0.5) * L0 / R - 0.5, bilinear, clamped to the
// window. Crops move c1 and N (mirrored when flipped); a flip toggles the flag; a resize folds the
// current window into (c0, L0), which is exact because bilinear resampling with half-pixel centres
// commutes with mirroring. A second resize, or a resize of a zero-padded window, cannot be folded:
// the pass is written to an intermediate image and a new pass starts from it. Values stay in the
// input's scale until the final write, where to_float's 1/255 and normalize's (x - mean) / std
// are applied as one multiply-add per channel.
#include "ferry/loaders/transforms.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "ferry/core/error.h"
#include "ferry/detail/pass_math.h"
#include "image_pass.h"

namespace ferry {

using detail::Axis;
using detail::Image;
using detail::image_of;
using detail::run_pass;

namespace {

constexpr int kMaxSide = 1 << 15;

void check_size(const char* step, int h, int w) {
  if (h <= 0 || w <= 0 || h > kMaxSide || w > kMaxSide)
    throw Error(std::string("ImageTransform::") + step + ": size " + std::to_string(h) + "x" + std::to_string(w) +
                " must be between 1 and " + std::to_string(kMaxSide));
}

std::int64_t py_round(double v) { return static_cast<std::int64_t>(std::nearbyint(v)); }  // half to even, as Python

// torchvision RandomResizedCrop.get_params: {top, left, height, width}.
std::array<std::int64_t, 4> rrc_box(std::int64_t H, std::int64_t W, const ImageTransform::Step& s, Generator& rng) {
  const double area = static_cast<double>(H) * static_cast<double>(W);
  const double lr0 = std::log(s.ratio[0]), lr1 = std::log(s.ratio[1]);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (s.scale[0] + rng.uniform() * (s.scale[1] - s.scale[0]));
    const double aspect = std::exp(lr0 + rng.uniform() * (lr1 - lr0));
    const std::int64_t w = py_round(std::sqrt(target * aspect)), h = py_round(std::sqrt(target / aspect));
    if (w > 0 && w <= W && h > 0 && h <= H) {
      const auto i = static_cast<std::int64_t>(rng.randint(static_cast<std::uint64_t>(H - h + 1)));
      const auto j = static_cast<std::int64_t>(rng.randint(static_cast<std::uint64_t>(W - w + 1)));
      return {i, j, h, w};
    }
  }
  const double in_ratio = static_cast<double>(W) / static_cast<double>(H);
  std::int64_t w = W, h = H;
  if (in_ratio < std::min(s.ratio[0], s.ratio[1]))
    h = py_round(static_cast<double>(w) / std::min(s.ratio[0], s.ratio[1]));
  else if (in_ratio > std::max(s.ratio[0], s.ratio[1]))
    w = py_round(static_cast<double>(h) * std::max(s.ratio[0], s.ratio[1]));
  return {(H - h) / 2, (W - w) / 2, h, w};
}

std::int64_t center_offset(std::int64_t have, std::int64_t want) {
  return want > have ? -((want - have) / 2) : py_round(static_cast<double>(have - want) / 2.0);
}

std::pair<std::int64_t, std::int64_t> shorter_side(std::int64_t H, std::int64_t W, int size) {
  // torchvision: the shorter side becomes `size`, the longer int(size * long / short).
  if (H <= W)
    return {size, static_cast<std::int64_t>(static_cast<double>(size) * static_cast<double>(W) / static_cast<double>(H))};
  return {static_cast<std::int64_t>(static_cast<double>(size) * static_cast<double>(H) / static_cast<double>(W)), size};
}

}  // namespace

ImageTransform& ImageTransform::resize(int height, int width) {
  check_size("resize", height, width);
  steps_.push_back({Step::Kind::Resize, height, width, {}, {}, 0, {}, {}});
  return *this;
}
ImageTransform& ImageTransform::resize_shorter(int size) {
  check_size("resize_shorter", size, size);
  steps_.push_back({Step::Kind::ResizeShorter, size, size, {}, {}, 0, {}, {}});
  return *this;
}
ImageTransform& ImageTransform::center_crop(int height, int width) {
  check_size("center_crop", height, width);
  steps_.push_back({Step::Kind::CenterCrop, height, width, {}, {}, 0, {}, {}});
  return *this;
}
ImageTransform& ImageTransform::random_resized_crop(int height, int width, std::array<double, 2> scale,
                                                    std::array<double, 2> ratio) {
  check_size("random_resized_crop", height, width);
  if (!(scale[0] > 0 && scale[0] <= scale[1] && scale[1] <= 1))
    throw Error("ImageTransform::random_resized_crop: scale must satisfy 0 < min <= max <= 1, got (" + std::to_string(scale[0]) +
                ", " + std::to_string(scale[1]) + ")");
  if (!(ratio[0] > 0 && ratio[0] <= ratio[1]))
    throw Error("ImageTransform::random_resized_crop: ratio must satisfy 0 < min <= max, got (" + std::to_string(ratio[0]) +
                ", " + std::to_string(ratio[1]) + ")");
  steps_.push_back({Step::Kind::RandomResizedCrop, height, width, scale, ratio, 0, {}, {}});
  return *this;
}
ImageTransform& ImageTransform::horizontal_flip(double p) {
  if (!(p >= 0 && p <= 1)) throw Error("ImageTransform::horizontal_flip: p must be in [0, 1], got " + std::to_string(p));
  steps_.push_back({Step::Kind::Flip, 0, 0, {}, {}, p, {}, {}});
  return *this;
}
ImageTransform& ImageTransform::to_float(DType dtype) {
  if (float_) throw Error("ImageTransform::to_float: called twice");
  if (dtype != DType::Float32 && dtype != DType::Float16 && dtype != DType::BFloat16)
    throw Error(std::string("ImageTransform::to_float: the dtype must be float32, float16 or bfloat16, got ") +
                dtype_name(dtype));
  float_ = true;
  float_dtype_ = dtype;
  steps_.push_back({Step::Kind::ToFloat, 0, 0, {}, {}, 0, {}, {}});
  return *this;
}
ImageTransform& ImageTransform::channels_last() {
  if (!float_) throw Error("ImageTransform::channels_last: must follow to_float() (uint8 output is HWC already)");
  channels_last_ = true;
  return *this;
}
ImageTransform& ImageTransform::normalize(std::vector<float> mean, std::vector<float> std) {
  if (!float_) throw Error("ImageTransform::normalize: must follow to_float()");
  if (mean.empty() || mean.size() != std.size())
    throw Error("ImageTransform::normalize: mean and std need the same, non-zero length (got " + std::to_string(mean.size()) +
                " and " + std::to_string(std.size()) + ")");
  for (float s : std)
    if (!(s > 0) || !std::isfinite(s))
      throw Error("ImageTransform::normalize: every std must be positive, got " + std::to_string(s));
  steps_.push_back({Step::Kind::Normalize, 0, 0, {}, {}, 0, std::move(mean), std::move(std)});
  return *this;
}

DType ImageTransform::output_dtype(DType input) const noexcept { return float_ ? float_dtype_ : input; }

std::optional<Shape> ImageTransform::fixed_output_shape(std::int64_t channels) const {
  std::optional<std::pair<std::int64_t, std::int64_t>> hw;
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::Kind::Resize:
      case Step::Kind::CenterCrop:
      case Step::Kind::RandomResizedCrop: hw = {s.height, s.width}; break;
      case Step::Kind::ResizeShorter: hw.reset(); break;
      default: break;
    }
  }
  if (!hw) return std::nullopt;
  return output_shape(hw->first, hw->second, channels);  // the last sizing step fixes the size
}

Shape ImageTransform::output_shape(std::int64_t H, std::int64_t W, std::int64_t channels) const {
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::Kind::Resize:
      case Step::Kind::CenterCrop:
      case Step::Kind::RandomResizedCrop: H = s.height, W = s.width; break;
      case Step::Kind::ResizeShorter: std::tie(H, W) = shorter_side(H, W, s.height); break;
      default: break;
    }
  }
  if (float_ && channels_last_) return {H, W, std::max<std::int64_t>(channels, 1)};
  if (float_) return {std::max<std::int64_t>(channels, 1), H, W};
  return channels == 0 ? Shape{H, W} : Shape{H, W, channels};
}

std::string ImageTransform::str() const {
  std::ostringstream os;
  for (std::size_t k = 0; k < steps_.size(); ++k) {
    const Step& s = steps_[k];
    if (k) os << " -> ";
    switch (s.kind) {
      case Step::Kind::Resize: os << "resize(" << s.height << "x" << s.width << ")"; break;
      case Step::Kind::ResizeShorter: os << "resize_shorter(" << s.height << ")"; break;
      case Step::Kind::CenterCrop: os << "center_crop(" << s.height << "x" << s.width << ")"; break;
      case Step::Kind::RandomResizedCrop: os << "random_resized_crop(" << s.height << "x" << s.width << ")"; break;
      case Step::Kind::Flip: os << "horizontal_flip(" << s.p << ")"; break;
      case Step::Kind::ToFloat:
        os << "to_float";
        if (float_dtype_ != DType::Float32) os << "(" << dtype_name(float_dtype_) << ")";
        if (channels_last_) os << " -> channels_last";
        break;
      case Step::Kind::Normalize: os << "normalize"; break;
    }
  }
  return steps_.empty() ? "identity" : os.str();
}

Tensor ImageTransform::operator()(const Tensor& image, Generator& rng) const {
  const Image in = image_of(image);
  // The output shape can depend on random draws only through sizes fixed by the steps, so it is
  // known before the pass runs.
  Tensor out = Tensor::empty(output_dtype(image.dtype()), output_shape(in.h, in.w, image.dim() == 3 ? in.c : 0));
  apply_into(image, out, rng);
  return out;
}

namespace {

// The sampling grid, scales and rounding of the pass being built; see Note [Fused transforms].
struct PassState {
  Axis ay, ax;
  std::vector<float> a, b;  // the final write: a[c] * v + b[c]
  bool seen_float = false;
  bool round = false;  // resampling uint8 data rounds (until to_float)
};

// Runs the steps over `st`. A second resize (or one of a padded window) cannot be folded into the
// pass: then `materialize(st)` must write the pass so far to an intermediate image and reset the
// axes to it, or return false to give up (walk_steps then returns false).
template <class Materialize>
bool walk_steps(const std::vector<ImageTransform::Step>& steps, PassState& st, std::int64_t C, bool uint8_input, Generator& rng,
                Materialize&& materialize) {
  using Step = ImageTransform::Step;
  auto resize = [&](std::int64_t h, std::int64_t w) {
    if (st.ay.resized || st.ax.resized || st.ay.padded || st.ax.padded)
      if (!materialize(st)) return false;
    st.ay.resize(h);
    st.ax.resize(w);
    return true;
  };
  for (const Step& s : steps) {
    switch (s.kind) {
      case Step::Kind::Resize:
        if (!resize(s.height, s.width)) return false;
        break;
      case Step::Kind::ResizeShorter: {
        auto [h, w] = shorter_side(st.ay.N, st.ax.N, s.height);
        if (!resize(h, w)) return false;
        break;
      }
      case Step::Kind::CenterCrop:
        st.ay.crop(center_offset(st.ay.N, s.height), s.height);
        st.ax.crop(center_offset(st.ax.N, s.width), s.width);
        break;
      case Step::Kind::RandomResizedCrop: {
        auto [top, left, h, w] = rrc_box(st.ay.N, st.ax.N, s, rng);
        st.ay.crop(top, h);
        st.ax.crop(left, w);
        if (!resize(s.height, s.width)) return false;
        break;
      }
      case Step::Kind::Flip:
        if (rng.bernoulli(s.p)) st.ax.flip = !st.ax.flip;
        break;
      case Step::Kind::ToFloat:
        // A resize already in this pass happened on uint8 data and keeps its rounding; a later one
        // in a new pass works in float.
        if (uint8_input) std::fill(st.a.begin(), st.a.end(), 1.f / 255.f);
        st.seen_float = true;
        if (!st.ay.resized && !st.ax.resized) st.round = false;
        break;
      case Step::Kind::Normalize:
        if (s.mean.size() != 1 && static_cast<std::int64_t>(s.mean.size()) != C)
          throw Error("ImageTransform::normalize: " + std::to_string(s.mean.size()) + " means for an image of " +
                      std::to_string(C) + " channels");
        for (std::int64_t c = 0; c < C; ++c) {
          const std::size_t k = s.mean.size() == 1 ? 0 : static_cast<std::size_t>(c);
          st.a[static_cast<std::size_t>(c)] /= s.std[k];
          st.b[static_cast<std::size_t>(c)] = (st.b[static_cast<std::size_t>(c)] - s.mean[k]) / s.std[k];
        }
        break;
    }
  }
  return true;
}

ImagePassPlan::Axis plan_axis(const Axis& a) { return {a.c0, a.L0, a.R, a.c1, a.N, a.resized, a.flip}; }

}  // namespace

std::optional<ImagePassPlan> ImageTransform::plan(std::int64_t height, std::int64_t width, std::int64_t channels,
                                                  Generator& rng) const {
  if (height <= 0 || width <= 0 || channels < 1 || channels > ImagePassPlan::kMaxChannels)
    throw Error("ImageTransform::plan: bad image size " + std::to_string(height) + "x" + std::to_string(width) + "x" +
                std::to_string(channels));
  PassState st{Axis::identity(height),
               Axis::identity(width),
               std::vector<float>(static_cast<std::size_t>(channels), 1.f),
               std::vector<float>(static_cast<std::size_t>(channels), 0.f),
               false,
               true};
  if (!walk_steps(steps_, st, channels, true, rng, [](PassState&) { return false; })) return std::nullopt;
  ImagePassPlan p;
  p.y = plan_axis(st.ay);
  p.x = plan_axis(st.ax);
  p.channels = channels;
  p.round = st.round;
  p.to_float = float_;
  p.out_dtype = float_ ? float_dtype_ : DType::UInt8;
  p.channels_last = channels_last_;
  for (std::int64_t c = 0; c < channels; ++c) {
    p.a[c] = st.a[static_cast<std::size_t>(c)];
    p.b[c] = st.b[static_cast<std::size_t>(c)];
  }
  return p;
}

std::optional<RowTransform> ImageTransform::row_transform(std::int64_t height, std::int64_t width, std::int64_t channels,
                                                          std::string& why) const {
  const std::int64_t C = std::max<std::int64_t>(channels, 1);
  if (height <= 0 || width <= 0 || C > RowTransform::kMaxChannels) {
    why = "images of " + std::to_string(height) + "x" + std::to_string(width) + "x" + std::to_string(channels) +
          " are not rows the device gather transforms";
    return std::nullopt;
  }
  RowTransform t;
  int flips = 0;
  for (const Step& s : steps_) {
    if (s.kind == Step::Kind::Flip) {
      ++flips;
      t.flip_p = s.p;
    } else if (s.kind != Step::Kind::ToFloat && s.kind != Step::Kind::Normalize) {
      why = "the transform (" + str() + ") crops or resizes, which the device gather does not";
      return std::nullopt;
    }
  }
  if (flips > 1) {
    why = "the transform (" + str() + ") flips more than once";
    return std::nullopt;
  }
  // The pass's own plan gives the write's a and b; the geometry is the identity (no crop or resize).
  Generator any;
  const std::optional<ImagePassPlan> p = plan(height, width, C, any);
  if (!p) {
    why = "the transform (" + str() + ") is not one pass";
    return std::nullopt;
  }
  t.height = height;
  t.width = width;
  t.channels = C;
  t.dtype = p->out_dtype;
  t.channels_last = p->channels_last;
  for (std::int64_t c = 0; c < C; ++c) {
    t.a[c] = p->a[c];
    t.b[c] = p->b[c];
  }
  t.shape = output_shape(height, width, channels);
  return t;
}

void ImageTransform::apply_into(const Tensor& image, const Tensor& out, Generator& rng) const {
  Image in = image_of(image);
  const Shape want = output_shape(in.h, in.w, image.dim() == 3 ? in.c : 0);
  if (!out.defined() || !out.device().is_host() || out.dtype() != output_dtype(image.dtype()) || out.shape() != want)
    throw Error("ImageTransform(" + str() + "): output " + out.str() + " does not match " +
                dtype_name(output_dtype(image.dtype())) + " " + shape_str(want) + " for input " + image.str());
  const std::int64_t C = in.c;
  // Final per-channel multiply-add; values keep the input's scale until then.
  PassState st{Axis::identity(in.h),
               Axis::identity(in.w),
               std::vector<float>(static_cast<std::size_t>(C), 1.f),
               std::vector<float>(static_cast<std::size_t>(C), 0.f),
               false,
               in.dtype == DType::UInt8};
  std::vector<std::byte> scratch[2];
  int which = 0;
  auto materialize = [&](PassState& p) {
    // Write the pass so far to an intermediate HWC image and continue from it.
    const bool as_float = in.dtype == DType::Float32 || !p.round;
    std::vector<std::byte>& buf = scratch[which ^= 1];
    buf.resize(static_cast<std::size_t>(p.ay.N * p.ax.N * C) * (as_float ? 4 : 1));
    const std::vector<float> one(static_cast<std::size_t>(C), 1.f), zero(static_cast<std::size_t>(C), 0.f);
    if (in.dtype == DType::UInt8) {
      if (as_float)
        run_pass<std::uint8_t, float>(in, p.ay, p.ax, reinterpret_cast<float*>(buf.data()), false, p.round, one.data(),
                                      zero.data());
      else
        run_pass<std::uint8_t, std::uint8_t>(in, p.ay, p.ax, reinterpret_cast<std::uint8_t*>(buf.data()), false, p.round,
                                             one.data(), zero.data());
    } else {
      run_pass<float, float>(in, p.ay, p.ax, reinterpret_cast<float*>(buf.data()), false, false, one.data(), zero.data());
    }
    in = {buf.data(), as_float ? DType::Float32 : DType::UInt8, p.ay.N, p.ax.N, C};
    p.round = in.dtype == DType::UInt8 && !p.seen_float;
    p.ay = Axis::identity(in.h);
    p.ax = Axis::identity(in.w);
    return true;
  };
  walk_steps(steps_, st, C, image.dtype() == DType::UInt8, rng, materialize);
  const float* a = st.a.data();
  const float* b = st.b.data();
  if (float_) {
    const bool chw = !channels_last_;
    auto write = [&]<class Out>(Out* o) {
      if (in.dtype == DType::UInt8)
        run_pass<std::uint8_t, Out>(in, st.ay, st.ax, o, chw, st.round, a, b);
      else
        run_pass<float, Out>(in, st.ay, st.ax, o, chw, false, a, b);
    };
    if (float_dtype_ == DType::Float16)
      write(out.data<Half>());
    else if (float_dtype_ == DType::BFloat16)
      write(out.data<BFloat16>());
    else
      write(out.data<float>());
  } else if (in.dtype == DType::UInt8) {
    run_pass<std::uint8_t, std::uint8_t>(in, st.ay, st.ax, out.data<std::uint8_t>(), false, true, a, b);
  } else {
    run_pass<float, float>(in, st.ay, st.ax, out.data<float>(), false, false, a, b);
  }
}

}  // namespace ferry
