// pinning/device_decode.h — the device stage's GPU decode (DeviceStage::decode_images; Note
// [Decode threads] in pinning/gpu_decode.cu). Private to ferry_pinning.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device_buffers.h"
#include "ferry/core/tensor.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/device.h"
#include "ferry/pinning/fence.h"
#include "gpu_decode.h"

namespace ferry::detail {

/// A batch's GPU decodes: placed in the batch's buffer as they are asked for, handed to a decode
/// thread when the batch ends. The decoder (nvJPEG's state, its threads) is made at the first
/// decode. The stage's thread calls everything but the statistics, which may be read on another.
class DecodeStage {
 public:
  DecodeStage(int device, int threads, bool high_priority) noexcept
      : device_(device), threads_(threads), high_priority_(high_priority) {}

  /// DeviceStage::decode_images: checks the arguments, makes the decoder at the first call,
  /// places the decoded images in the batch and returns them.
  Tensor add(DeviceBuffers& buffers, const Tensor& bytes, const Tensor& index, const Tensor& index_dev);
  bool pending() const noexcept { return !decodes_.empty(); }
  /// Before the batch's copies: each image's place in the decode scratch goes into the host index.
  void lay_out();

  struct Submitted {
    std::shared_ptr<EventFence> fence;  ///< deferred: recorded by the decode thread; null where nothing was queued
    std::exception_ptr error;           ///< the submission failed (the fence, if any, carries it too)
    std::vector<Storage> read;          ///< host memory nvJPEG reads in place: the batch's fence must cover it
  };
  /// Queues the batch's decodes to a decode thread, their kernels behind what is queued on `copy`
  /// so far; the thread records `done` after them (moved into the fence returned). The batch's
  /// buffer is marked as written by the fence. Counts the images in `counters`.
  Submitted submit(const cuda::Stream& copy, cuda::Event& done, DeviceBuffers& buffers, DeviceStageStats& counters);
  /// Forgets the batch's decodes (after submit, or when the batch is aborted).
  void clear() noexcept { decodes_.clear(); }

  /// Stops the decode threads once the decodes queued are issued; false when one never came back
  /// (GpuJpegDecoder::stop: then nothing it may write may be freed).
  bool stop() noexcept;
  /// Frees the decoder (after stop()).
  void reset() noexcept;

  std::string backend() const;
  double busy_ms() const;
  /// The decode threads as chosen, or as asked before the first decode.
  int threads() const;
  std::uint64_t allocations() const;

 private:
  struct Pending {
    Tensor bytes, index;
    const std::int64_t* index_dev;
    std::byte* out;
  };
  const int device_, threads_;
  const bool high_priority_;
  mutable std::mutex mu_;                    // decoder_: made on the stage's thread, read for the statistics on any
  std::unique_ptr<GpuJpegDecoder> decoder_;  // its threads issue the decodes (Note [Decode threads])
  std::vector<Pending> decodes_;
};

}  // namespace ferry::detail
