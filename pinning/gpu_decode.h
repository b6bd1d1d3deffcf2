// pinning/gpu_decode.h — nvJPEG batched decode plus the fused transform kernel (GPU decode).
// Private to ferry_pinning; built only where CMake finds nvJPEG (FERRY_HAVE_NVJPEG).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/pinning/cuda.h"
#include "ferry/pinning/fence.h"

namespace ferry::detail {

/// Host side, before the index is copied to the device: gives each image its place in a decode
/// scratch (index word 29); returns the scratch's bytes for the batch.
std::size_t lay_out_decode_scratch(std::int64_t* index, int rows);

/// One decode_images call of a batch: the images of `bytes` (pinned host bytes, read in place by
/// nvJPEG) decoded and transformed by the `rows` plans of `index` (pinned host; `index_dev` its
/// device copy) into `out` (device). `keep` holds the host memory until the decode is issued.
/// (Plain pointers: this header is compiled as CUDA C++17, without ferry's C++20 tensor header.)
struct DecodeWork {
  std::shared_ptr<const void> keep;
  const std::byte* bytes = nullptr;
  const std::int64_t* index = nullptr;
  int rows = 0;
  const std::int64_t* index_dev = nullptr;
  void* out = nullptr;
};

/// A batch's decodes, as DeviceStage::end() hands them over.
struct DecodeJob {
  std::vector<DecodeWork> work;
  cuda::Event inputs;                 ///< on the copy stream: the indexes are copied and `out` is free
  void* done = nullptr;               ///< the cudaEvent_t inside `fence`, recorded after the last kernel
  std::shared_ptr<EventFence> fence;  ///< deferred; recorded() once issued, with the error if one failed
};

class GpuJpegDecoder {
 public:
  virtual ~GpuJpegDecoder() = default;
  /// Queues a batch's decodes and returns at once; one of the decoder's threads issues them
  /// (Note [Decode threads]). Jobs run in the order given, several at once.
  virtual void submit(DecodeJob job) = 0;
  virtual std::string backend() const = 0;
  /// Milliseconds the decode threads spent issuing decodes so far, summed over the threads
  /// (nvJPEG's hardware backend holds its thread for the whole decode).
  virtual double busy_ms() const = 0;
  /// Scratch and pinned allocations so far (constant after warm-up).
  virtual std::uint64_t allocations() const = 0;
  /// Its decode threads (as asked, or as chosen from the hardware), less any that could not start.
  virtual int threads() const = 0;
  /// Stops the decode threads once the jobs queued are issued, and frees the decoder. False when a
  /// thread has been inside one decode longer than kStuckDecodeSeconds (nvJPEG's call has not come
  /// back): that thread, the decoder and the batch's host memory are then left as they are, never
  /// freed; the batch's fence and those of the jobs still queued carry an error; and the device
  /// may still be working for that decode, so the caller frees none of its device memory either
  /// (Note [A decode that never returns]). The destructor calls it once.
  virtual bool stop() noexcept = 0;
  /// How long one decode may take before stop() leaves its thread (a batch of 256 500x375 images
  /// takes 8-40 ms on an H100).
  static constexpr double kStuckDecodeSeconds = 10;
};

/// Whether this build has nvJPEG.
bool gpu_decode_built() noexcept;
/// A decoder on `device` with `threads` decode threads (each with its own nvJPEG state, stream
/// and scratch; 0: decode_threads_for the device's JPEG engines and this machine's CPUs), its streams at the device's highest priority with `high_priority`; CudaError
/// without nvJPEG or when nvJPEG cannot start. Destroying it waits for the jobs queued.
std::unique_ptr<GpuJpegDecoder> make_gpu_jpeg_decoder(int device, int threads, bool high_priority);

}  // namespace ferry::detail
