// pinning/device_buffers.h — where the device stage places a batch (Note [Device stage],
// ferry/pinning/device.h). Private to ferry_pinning.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/core/tensor.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/fence.h"

namespace ferry::detail {

/// The device stage's buffers: one a batch, or small batches carved one after another from a
/// shared one; a buffer is reused only behind the consumer's release of it and behind the last GPU
/// decode that writes into it. One thread begins, places and finishes batches (the stage's); a
/// batch's tensors may be dropped on any thread. Frees its buffers when destroyed, unless leak().
class DeviceBuffers {
 public:
  /// `copy` waits for a buffer's release before the buffer is written again; the release is
  /// recorded on `consumer`. Both outlive this object.
  DeviceBuffers(int device, const cuda::Stream& copy, const cuda::Stream& consumer) noexcept
      : device_(device), copy_(copy), consumer_(consumer) {}
  ~DeviceBuffers();
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;

  /// Begins placing a batch of `bytes`: a buffer of its own, or with `share` a place in the shared
  /// buffer for a batch of kHeldBytes / 2 or less. Every tensor placed holds `keep` (the stage,
  /// whose streams must outlive its batches) and the buffer until the tensor is dropped.
  void begin(std::size_t bytes, bool share, const std::shared_ptr<void>& keep);
  bool begun() const noexcept { return cur_ != nullptr; }
  /// Reserves `bytes` (64-byte aligned) of the batch and returns a tensor of `dtype` and `shape` at
  /// the start of them; an Error naming `what` when the batch has not that much left of what
  /// begin() reserved.
  Tensor place(std::size_t bytes, DType dtype, const Shape& shape, const std::string& what);
  /// The bytes placed so far in the batch, and those begin() reserved that are left.
  std::size_t placed() const noexcept { return used_ - cur_begin_; }
  std::size_t left() const noexcept { return cur_end_ - used_; }
  /// The batch's buffer is written by a GPU decode behind `fence`: not reused before that decode
  /// is issued, and then only behind it.
  void set_writer(std::shared_ptr<const EventFence> fence);
  /// The batch is placed: the stage lets go of its buffer (it returns once its tensors are gone).
  void finish() noexcept;
  /// The stage lets go of the shared buffer it was carving.
  void close_shared() noexcept;
  /// Device allocations so far (cudaMalloc calls; constant after warm-up).
  std::uint64_t allocations() const;
  /// A decode that never returned may still write a buffer: the destructor frees none.
  void leak() noexcept { leak_ = true; }

  /// A buffer holds at most this much of shared batches (and the device gather holds no batch of more).
  static constexpr std::size_t kHeldBytes = std::size_t{16} << 20;
  /// Shared batches a buffer holds at most.
  static constexpr std::size_t kSharedBatches = 8;

 private:
  struct Buffer {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    cuda::Event released;      // recorded on the consumer stream when its last tensor was dropped
    bool has_release = false;  // guarded by mu_
    bool free = true;          // guarded by mu_
    // Guarded by mu_: the fence of the last GPU decode that writes into it, until a lease has put
    // the copy stream behind it. A batch dropped before its hand-over (an epoch left early) frees
    // its buffer while its decode may still be queued: the buffer is reused only once that decode
    // is issued, and behind it (lease).
    std::shared_ptr<const EventFence> writer;
  };
  Buffer* lease(std::size_t want);
  std::shared_ptr<void> owner_of(Buffer* b, const std::shared_ptr<void>& keep);
  void release(Buffer* b) noexcept;

  const int device_;
  const cuda::Stream& copy_;
  const cuda::Stream& consumer_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Buffer>> buffers_;  // guarded by mu_
  std::uint64_t allocations_ = 0;                 // guarded by mu_
  bool leak_ = false;
  // The batch being placed: its buffer, held from cur_begin_ to cur_end_, and the end of what is
  // placed so far.
  Buffer* cur_ = nullptr;
  std::size_t cur_begin_ = 0, cur_end_ = 0, used_ = 0;
  std::shared_ptr<void> cur_owner_;
  // Shared batches: carved one after another from one buffer of up to kSharedBatches of them,
  // which the stage holds while it carves and which returns, behind one release event, once the
  // stage has moved on and its last batch is dropped. Small batches then cost one buffer lease, one
  // copy-stream wait and one release a buffer, not a batch.
  Buffer* shared_ = nullptr;
  std::shared_ptr<void> shared_owner_;
  std::size_t shared_used_ = 0;
};

}  // namespace ferry::detail
