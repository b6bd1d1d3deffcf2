// ferry/core/rows.h — datasets whose samples are rows of host arrays, for the device gather
// (Note [Device gather] in ferry/pinning/gather.h).
#pragma once

#include <concepts>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ferry/core/allocator.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// How the loader makes device batches of row datasets (Note [Device gather]).
enum class Gather {
  Auto,    ///< the device gather where it applies (device set, a RowGatherDataset, no collate_fn)
  Host,    ///< workers copy rows into pinned blocks, the copy engine moves them (the general path)
  Device,  ///< the device gather, or an Error saying why it cannot apply
};

/// What the device gather does to each row of a field on its way into the batch: the transforms
/// image rows usually need, run inside the gather kernel (Note [Device gather], "row transforms").
/// The rows are uint8 images, height x width x channels (HWC). A row is mirrored left-right when
/// the sample draws a flip: Generator(seed, epoch, index).bernoulli(flip_p), the draw
/// ImageTransform::horizontal_flip makes from SampleContext::rng(). Each value v is then written
/// as a[c] * v + b[c] in `dtype` (uint8 values are clamped to [0, 255]), CHW for float outputs
/// unless `channels_last`, HWC for uint8: the values and layout ImageTransform's pass writes.
/// ImageTransform::row_transform() makes one from a transform that only flips, converts and
/// normalizes.
struct RowTransform {
  static constexpr int kMaxChannels = 4;
  std::int64_t height = 0, width = 0, channels = 1;
  double flip_p = 0;           ///< 0: never mirrored
  DType dtype = DType::UInt8;  ///< UInt8, Float32, Float16 or BFloat16
  bool channels_last = false;  ///< float outputs as HWC
  float a[kMaxChannels] = {1, 1, 1, 1}, b[kMaxChannels] = {0, 0, 0, 0};
  Shape shape;  ///< a sample's field in the batch (the host path's shape)
};

/// A field whose rows are windows of one host array of integers, not its rows: sample i's field is
/// the `length` elements from element start(i) + `shift`, written as `dtype` (an integer type at
/// least as wide as the array's; values of an `is_unsigned` array zero-extended, else
/// sign-extended). start(i) is `start(i, seed, epoch)`, the same function for every window field of
/// a dataset (token windows: input_ids at shift 0, labels at shift 1; Note [Token windows on the
/// GPU] in ferry/loaders/tokens.h).
struct RowWindow {
  std::int64_t length = 0;
  std::int64_t shift = 0;
  DType dtype = DType::Int64;
  bool is_unsigned = false;
  /// The first element of sample `index`'s window (before `shift`); it must leave the window
  /// inside the array. Called on the thread that writes a batch's indices.
  std::function<std::uint64_t(std::size_t index, std::uint64_t seed, std::uint64_t epoch)> start;
};

/// One field of a dataset as rows of one host array: sample i's field is the `row_bytes` bytes at
/// `data + i * row_bytes`, of type `dtype` and shape `row_shape` (with a `transform`, the batch's
/// field is transform->shape of transform->dtype instead; with a `window`, `rows` counts the
/// array's elements, `row_bytes` is an element's, and the field is [window->length] of
/// window->dtype).
struct HostRows {
  const void* data = nullptr;
  std::int64_t rows = 0;
  std::size_t row_bytes = 0;
  DType dtype = DType::UInt8;
  Shape row_shape;
  std::string name;  ///< for errors: "tensor 1", "features.npy"
  /// The rows are a memory-mapped file (a .npy). Gather::Auto leaves such rows to the host path
  /// (Note [Device gather], "mapped files"); Gather::Device gathers them.
  bool mapped_file = false;
  /// Run on each row by the gather kernel (uint8 rows of height * width * channels bytes), or none.
  std::optional<RowTransform> transform;
  /// The field is windows of the array (RowWindow), not its rows; no `transform` with it.
  std::optional<RowWindow> window;
};

/// A dataset whose batch fields are rows of host arrays (see the Note). host_rows() gives one
/// HostRows per field of the batch, in order (or none, with `why` set, to decline). The batch is a
/// Tensor (one field), a std::vector<Tensor>, or a FieldsBatch.
template <class D>
concept RowGatherDataset = requires(const D& d, std::string& why) {
  { d.host_rows(why) } -> std::same_as<std::vector<HostRows>>;
};

/// A batch type the device gather can assemble from its fields' device tensors, in host_rows()
/// order (LabeledBatch: image, label).
template <class B>
concept FieldsBatch = requires(std::vector<Tensor>&& fields) {
  { B::from_fields(std::move(fields)) } -> std::same_as<B>;
  { B::kGatheredFields } -> std::convertible_to<std::size_t>;
};

/// The batch types the device gather makes: a Tensor (one field), a std::vector<Tensor>, or a
/// FieldsBatch.
template <class B>
concept GatheredBatch = std::same_as<B, Tensor> || std::same_as<B, std::vector<Tensor>> || FieldsBatch<B>;

namespace detail {
/// Set in a row's index word when its sample draws a flip (RowTransform::flip_p).
inline constexpr std::int64_t kRowFlipBit = std::int64_t{1} << 62;
/// The flip each sample of a batch draws for the row transforms: Generator(seed, epoch,
/// index).bernoulli(p), as SampleContext::rng() would give it; p = 0 draws nothing.
struct RowFlips {
  double p = 0;
  std::uint64_t seed = 0, epoch = 0;
};
/// The indices of a batch as an int64 tensor from `allocator`, with kRowFlipBit set where the
/// sample draws a flip; an Error for an index past `n` (the same message as the host path's).
Tensor gather_index(std::span<const std::size_t> indices, std::size_t n, BatchAllocator& allocator, const RowFlips& flips = {});
/// Why `rows`' transform cannot run in the gather kernel ("" when it can, or has none).
std::string row_transform_problem(const HostRows& rows);
/// The same for transform `t` over rows of `row_bytes` bytes of `dtype`, named `name` in the answer
/// (which is built only when there is a problem: DeviceStage checks every batch).
std::string row_transform_problem(const RowTransform& t, DType dtype, std::size_t row_bytes, const std::string& name);
/// The kernels' output kind (ferry/detail/pass_math.h's PassOutput) of a uint8, float32, float16 or
/// bfloat16 output: what the gather kernel and the GPU decode's encoded index carry.
int pass_output_of(DType dtype) noexcept;
/// Bytes one sample of `rows` takes in a gathered batch (its transform's or window's output).
std::size_t gathered_row_bytes(const HostRows& rows) noexcept;
/// Why `rows`' window cannot be gathered ("" when it can, or has none).
std::string row_window_problem(const HostRows& rows);
/// The same for window `w` over an array of `elements` integers of `dtype` (`row_bytes` each),
/// named `name` in the answer; the window's start function is not asked for (DeviceStage checks
/// every batch, its index holding the starts).
std::string row_window_problem(const RowWindow& w, DType dtype, std::size_t row_bytes, std::int64_t elements,
                               const std::string& name);
}  // namespace detail

}  // namespace ferry
