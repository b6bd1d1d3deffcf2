#include "ferry/pinning/pin.h"

#include "ferry/collate/collate.h"

namespace ferry {

void PinContext::begin_measure() noexcept {
  measuring_ = true;
  last_block_ = nullptr;
  need_ = used_ = 0;
  block_ = Storage();
}

void PinContext::begin_copy() {
  measuring_ = false;
  if (stage_)
    stage_->begin(need_);
  else if (need_ > 0)
    block_ = pool_->allocate(need_);
  if (block_.data()) last_block_ = block_.data();
}

void PinContext::finish() {
  block_ = Storage();
  need_ = used_ = 0;
  if (stage_) device_copy_ = stage_->end();
}

void PinContext::abort() noexcept {
  block_ = Storage();
  need_ = used_ = 0;
  if (stage_) stage_->abort();
}

Tensor PinContext::pin(const Tensor& t) {
  if (stage_) {
    if (!t.defined() || t.device().kind == MemoryKind::Device) return t;
    if (measuring_) {
      need_ += align_up(t.nbytes());
      return t;
    }
    copied_ += t.nbytes();
    return stage_->move(t);
  }
  if (!t.defined()) return t;
  if (t.is_pinned()) {
    if (!last_block_) last_block_ = t.storage().data();  // already pinned (direct mode): its block
    return t;
  }
  if (!t.device().is_host()) throw Error("pin_memory: " + t.str() + " is not in host memory");
  const std::size_t bytes = align_up(t.nbytes());
  if (measuring_) {
    need_ += bytes;
    return t;
  }
  if (used_ + bytes > need_)
    throw Error(
        "pin_memory: the batch's pin_memory pinned more tensors in its second pass than in its first; "
        "a custom pin_memory must only call ctx.pin()");
  Tensor out(block_, t.dtype(), t.shape(), used_);
  used_ += bytes;
  parallel_memcpy(out.raw(), t.raw(), t.nbytes(), copy_pool_);
  copied_ += t.nbytes();
  return out;
}

Tensor PinContext::decode_images(const Tensor& bytes, const Tensor& index, const Tensor& index_on_device) {
  if (!stage_) throw Error("PinContext::decode_images: only the device stage decodes images (set DataLoaderOptions::device)");
  if (measuring_) {
    need_ += align_up(DeviceStage::decoded_bytes(index));
    return Tensor();
  }
  return stage_->decode_images(bytes, index, index_on_device);
}

}  // namespace ferry
