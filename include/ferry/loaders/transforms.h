// ferry/loaders/transforms.h — image transforms, composed and fused into one pass.
//
// An ImageTransform is a list of steps, as torchvision.transforms.Compose, applied to an image
// tensor of uint8 (or float32) in HWC layout ([H, W, C], or [H, W] for grayscale):
//
//   auto train = ferry::ImageTransform()
//                    .random_resized_crop(224, 224)       // scale (0.08, 1), ratio (3/4, 4/3)
//                    .horizontal_flip(0.5)
//                    .to_float()                          // uint8 HWC [0, 255] -> float32 CHW [0, 1]
//                                                         // (to_float(DType::BFloat16) or Float16,
//                                                         // and channels_last() for HWC, as options)
//                    .normalize({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
//   ferry::Tensor out = train(image, ctx.rng());          // [3, 224, 224] float32
//
// Semantics match torchvision on tensors: resize is bilinear with half-pixel centres and no
// antialiasing (torch.nn.functional.interpolate(mode="bilinear", align_corners=False)), rounded to
// the nearest integer when the image is still uint8; crops larger than the image pad with zeros;
// random_resized_crop draws its box exactly as torchvision's RandomResizedCrop.get_params.
//
// Steps are not run one after another over whole images: crops and flips only move the sampling
// grid, so a run of crops, flips and one resize is evaluated as a single bilinear pass from the
// source straight into the output (a second resize starts a new pass over an intermediate image).
// to_float and normalize are folded into that pass's write. apply_into() writes the result into
// caller memory, which is how datasets decode and transform straight into a batch's row.
//
// Randomness comes from the Generator passed in: inside a loader, pass ctx.rng(), which is keyed
// by (seed, epoch, sample index), so a sample gets the same crop whichever worker runs it.
//
// Thread safety: an ImageTransform is immutable once built; apply from any number of threads.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ferry/core/random.h"
#include "ferry/core/rows.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// One sample's transform as a single bilinear pass from a uint8 HWC image: the sampling grid of
/// each axis (Note [Fused transforms] in loaders/transforms.cpp), whether the interpolated value is
/// rounded (a resize of uint8 data before to_float), and the final per-channel a * v + b. What a
/// device kernel needs to reproduce apply_into() exactly; ferry/detail/pass_math.h evaluates it.
struct ImagePassPlan {
  static constexpr int kMaxChannels = 4;
  struct Axis {
    std::int64_t c0 = 0, L0 = 0, R = 0, c1 = 0, N = 0;
    bool resized = false, flip = false;
    /// The source indices the pass reads along this axis, [first, end); first == end when every
    /// output index is padding.
    std::array<std::int64_t, 2> source() const noexcept;
  };
  Axis y, x;
  std::int64_t channels = 3;
  bool round = false;
  bool to_float = false;           ///< output floats (out_dtype), CHW unless channels_last; otherwise uint8 HWC
  DType out_dtype = DType::UInt8;  ///< UInt8, or Float32, Float16 or BFloat16 after to_float
  bool channels_last = false;      ///< float output as HWC
  float a[kMaxChannels] = {1, 1, 1, 1}, b[kMaxChannels] = {0, 0, 0, 0};
};

/// Runs a plan (ImageTransform::plan) over `image` (uint8, host, [H, W, C] with C = plan.channels)
/// into `out` (uint8 [y.N, x.N, C]; after to_float, out_dtype [C, y.N, x.N], or [y.N, x.N, C] when
/// channels_last): the same values
/// apply_into() writes. The image may be a window of the one the plan was drawn for, with each
/// axis's c0 moved by the window's origin (how decode_transformed_into() decodes only the crop);
/// ferry::Error when the plan reads outside it or the shapes do not match.
void apply_plan(const ImagePassPlan& plan, const Tensor& image, const Tensor& out);

class ImageTransform {
 public:
  /// Resizes to exactly height x width.
  ImageTransform& resize(int height, int width);
  /// Resizes so the shorter side is `size`, keeping the aspect ratio (torchvision Resize(size)).
  ImageTransform& resize_shorter(int size);
  /// Crops height x width from the centre (zero padding where the image is smaller).
  ImageTransform& center_crop(int height, int width);
  /// A random box of `scale` of the area and `ratio` aspect, resized to height x width.
  ImageTransform& random_resized_crop(int height, int width, std::array<double, 2> scale = {0.08, 1.0},
                                      std::array<double, 2> ratio = {3.0 / 4.0, 4.0 / 3.0});
  /// Mirrors left-right with probability p.
  ImageTransform& horizontal_flip(double p = 0.5);
  /// uint8 HWC in [0, 255] becomes float32 CHW in [0, 1] (torchvision ToTensor).
  /// With `dtype` Float16 or BFloat16, values are computed in float32 and rounded to nearest even
  /// at the write (torch's .to(torch.bfloat16) gives the same bits).
  ImageTransform& to_float(DType dtype = DType::Float32);
  /// Float output stays [H, W, C] (NHWC batches, torch.channels_last) instead of [C, H, W]. Must
  /// follow to_float.
  ImageTransform& channels_last();
  /// (x - mean[c]) / std[c] per channel; one value applies to all channels. Must follow to_float.
  ImageTransform& normalize(std::vector<float> mean, std::vector<float> std);

  /// The output's dtype: to_float's (float32 unless given) after it, else the input's.
  DType output_dtype(DType input) const noexcept;
  /// The output shape for an input of height x width x channels.
  Shape output_shape(std::int64_t height, std::int64_t width, std::int64_t channels) const;
  /// The output shape when it does not depend on the input's height and width (a fixed-size
  /// resize or crop comes after any size-dependent step), else nullopt.
  std::optional<Shape> fixed_output_shape(std::int64_t channels) const;
  /// True when there are no steps.
  bool empty() const noexcept { return steps_.empty(); }
  /// "random_resized_crop(224x224) -> horizontal_flip(0.5) -> to_float".
  std::string str() const;

  /// The single-pass plan of one uint8 image of height x width x channels, drawing the random
  /// choices (crop box, flip) from `rng` exactly as apply_into() does; nullopt when the steps need
  /// more than one pass (two resizes, or a resize after a padding crop).
  std::optional<ImagePassPlan> plan(std::int64_t height, std::int64_t width, std::int64_t channels, Generator& rng) const;
  /// The same steps as the device gather's RowTransform (ferry/core/rows.h) for uint8 images of
  /// height x width x channels (channels 0: [H, W] grayscale, as output_shape() takes it), or
  /// nullopt, with `why` set, when the steps do more than one horizontal flip, to_float,
  /// channels_last and normalize (crops and resizes run on the CPU).
  std::optional<RowTransform> row_transform(std::int64_t height, std::int64_t width, std::int64_t channels,
                                            std::string& why) const;
  /// Applies the steps to `image` ([H, W, C] or [H, W], uint8 or float32, host memory).
  Tensor operator()(const Tensor& image, Generator& rng) const;
  /// The same, written into `out` (host memory, output_shape() and output_dtype() of the input;
  /// ferry::Error names the mismatch otherwise).
  void apply_into(const Tensor& image, const Tensor& out, Generator& rng) const;

  /// One step (public so the implementation can be a free function; build through the methods).
  struct Step {
    enum class Kind : std::uint8_t { Resize, ResizeShorter, CenterCrop, RandomResizedCrop, Flip, ToFloat, Normalize };
    Kind kind;
    int height = 0, width = 0;
    std::array<double, 2> scale{}, ratio{};
    double p = 0;
    std::vector<float> mean, std;
  };
  const std::vector<Step>& steps() const noexcept { return steps_; }

 private:
  std::vector<Step> steps_;
  bool float_ = false, channels_last_ = false;
  DType float_dtype_ = DType::Float32;
};

}  // namespace ferry
