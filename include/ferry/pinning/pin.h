// ferry/pinning/pin.h — moving a batch into pinned memory: pin_memory(batch, PinContext&).
//
// The loader's pin thread calls ferry::pin_memory(batch, ctx) on every batch, in order. The
// default walks tensors, std::vector, std::array, std::pair, std::tuple, std::map, std::optional
// and collated user structs (CollateFields); tensors already pinned pass through untouched.
// A custom batch type takes part by a member, as PyTorch's custom batch with a pin_memory()
// method does:
//
//   struct MyBatch {
//     ferry::Tensor inputs, targets;
//     void pin_memory(ferry::PinContext& ctx) { inputs = ctx.pin(inputs); targets = ctx.pin(targets); }
//   };
//
// pin_memory runs twice per batch: first with ctx.measuring() true, when ctx.pin() only counts the
// bytes and returns its argument, then for real, when every tensor is copied into one pinned
// block leased for the whole batch (so the batch is one slab: one fence, one device copy). A
// custom pin_memory should therefore do nothing but call ctx.pin().
//
// The same walk moves a batch to the GPU: ferry::to_device(batch, stage) runs pin_memory with a
// context in device mode, where ctx.pin() returns the device tensor (see ferry/pinning/device.h).
//
// Thread safety: a PinContext belongs to the thread using it (the pin thread, or the consumer).
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/collate/collate.h"
#include "ferry/core/parallel.h"
#include "ferry/core/tensor.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/pool.h"

namespace ferry {

class PinContext {
 public:
  /// `blocks` supplies pinned blocks (a PinnedPool, or the loader's budget-checking wrapper of
  /// one); `copy_pool` (may be null) splits large copies across threads.
  PinContext(BatchAllocator& blocks, const ParallelFor* copy_pool) : pool_(&blocks), copy_pool_(copy_pool) {}
  /// Device mode: pin() hands each host tensor to `stage` and returns its device counterpart.
  explicit PinContext(DeviceStage& stage) : stage_(&stage) {}

  /// The pinned version of `t`: `t` itself when already pinned, else a copy in the batch's block.
  Tensor pin(const Tensor& t);
  /// Device mode only: decodes a batch of JPEGs on the device (GPU decode; see
  /// DeviceStage::decode_images). `bytes` and `index` are the host tensors of an encoded
  /// LabeledBatch, `index_on_device` the index already moved with pin(). Returns the decoded,
  /// transformed images (an undefined tensor while measuring).
  Tensor decode_images(const Tensor& bytes, const Tensor& index, const Tensor& index_on_device);
  bool measuring() const noexcept { return measuring_; }
  /// True when moving to the device rather than pinning.
  bool to_device() const noexcept { return stage_ != nullptr; }

  /// Used by ferry::pin_memory: counts, leases one block, then copies.
  void begin_measure() noexcept;
  void begin_copy();
  void finish();
  void abort() noexcept;
  /// Bytes copied into pinned memory by this context so far (not counting pass-through).
  std::size_t bytes_copied() const noexcept { return copied_; }
  /// The pinned block the last batch was copied into, or, when it was already pinned (direct
  /// mode), the block of its first tensor; null when it has no tensors.
  const void* block() const noexcept { return last_block_; }
  /// Device mode: the completion event of the last batch's copies.
  const std::shared_ptr<const EventFence>& device_copy() const noexcept { return device_copy_; }

 private:
  BatchAllocator* pool_ = nullptr;
  DeviceStage* stage_ = nullptr;
  std::shared_ptr<const EventFence> device_copy_;
  const ParallelFor* copy_pool_ = nullptr;
  bool measuring_ = false;
  std::size_t need_ = 0, used_ = 0, copied_ = 0;
  Storage block_;
  const void* last_block_ = nullptr;
};

/// How a type is pinned. Specialize for types you cannot give a pin_memory member.
template <class T, class = void>
struct PinMemory {
  static constexpr bool supported = requires(T & v, PinContext& c) { v.pin_memory(c); }
  || std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, std::string>;
  static void apply(T& value, PinContext& ctx) {
    if constexpr (requires { value.pin_memory(ctx); }) {
      value.pin_memory(ctx);
    } else if constexpr (std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, std::string>) {
      (void)value;
      (void)ctx;
    } else {
      static_assert(sizeof(T) == 0,
                    "ferry: this batch type cannot be pinned: give it a member `void pin_memory(ferry::PinContext&)` "
                    "or specialize ferry::PinMemory<T>");
    }
  }
};
template <>
struct PinMemory<Tensor> {
  static constexpr bool supported = true;
  static void apply(Tensor& t, PinContext& ctx) { t = ctx.pin(t); }
};
template <class T>
struct PinMemory<std::vector<T>> {
  static constexpr bool supported = PinMemory<T>::supported;
  static void apply(std::vector<T>& v, PinContext& ctx) {
    for (auto& x : v) PinMemory<T>::apply(x, ctx);
  }
};
template <class T, std::size_t N>
struct PinMemory<std::array<T, N>> {
  static constexpr bool supported = PinMemory<T>::supported;
  static void apply(std::array<T, N>& v, PinContext& ctx) {
    for (auto& x : v) PinMemory<T>::apply(x, ctx);
  }
};
template <class A, class B>
struct PinMemory<std::pair<A, B>> {
  static constexpr bool supported = PinMemory<A>::supported && PinMemory<B>::supported;
  static void apply(std::pair<A, B>& p, PinContext& ctx) {
    PinMemory<A>::apply(p.first, ctx);
    PinMemory<B>::apply(p.second, ctx);
  }
};
template <class... Ts>
struct PinMemory<std::tuple<Ts...>> {
  static constexpr bool supported = (PinMemory<Ts>::supported && ...);
  static void apply(std::tuple<Ts...>& t, PinContext& ctx) {
    std::apply([&](auto&... x) { (PinMemory<std::remove_cvref_t<decltype(x)>>::apply(x, ctx), ...); }, t);
  }
};
template <class K, class T>
struct PinMemory<std::map<K, T>> {
  static constexpr bool supported = PinMemory<T>::supported;
  static void apply(std::map<K, T>& m, PinContext& ctx) {
    for (auto& kv : m) PinMemory<T>::apply(kv.second, ctx);
  }
};
template <class T>
struct PinMemory<std::optional<T>> {
  static constexpr bool supported = PinMemory<T>::supported;
  static void apply(std::optional<T>& o, PinContext& ctx) {
    if (o) PinMemory<T>::apply(*o, ctx);
  }
};

/// Runs `walk(ctx)` twice: once measuring, once copying into one block (or one device buffer).
template <class Walk>
void run_pin_passes(PinContext& ctx, Walk&& walk) {
  ctx.begin_measure();
  walk();
  ctx.begin_copy();
  try {
    walk();
    ctx.finish();
  } catch (...) {
    ctx.abort();
    throw;
  }
}

/// Pins every tensor of `batch` into one block leased from ctx's pool (two passes; see above).
template <class Batch>
void pin_memory(Batch& batch, PinContext& ctx) {
  run_pin_passes(ctx, [&] { PinMemory<Batch>::apply(batch, ctx); });
}

/// Moves every tensor of a (pinned) batch to the stage's device: asynchronous, ordered before
/// anything later queued on stage.consumer_stream().
template <class Batch>
void to_device(Batch& batch, DeviceStage& stage) {
  PinContext ctx(stage);
  pin_memory(batch, ctx);
  if (ctx.device_copy()) stage.deliver(*ctx.device_copy());
}

/// The batch struct of a sample type collated through CollateFields<Sample>: its fields are
/// walked one by one (the loader uses this when it knows the sample type).
template <class Sample, class Batch>
void pin_collated_fields(Batch& batch, PinContext& ctx) {
  run_pin_passes(ctx, [&] {
    std::apply(
        [&](const auto&... f) {
          ((PinMemory<std::remove_cvref_t<decltype(batch.*(f.second))>>::apply(batch.*(f.second), ctx)), ...);
        },
        CollateFields<Sample>::fields);
  });
}

}  // namespace ferry
