// ferry/pinning/device.h — host-to-device copies on a side stream that overlap compute.
//
// Note [Device stage]
// For each batch the stage leases one device buffer sized to the whole batch (small batches of
// the device gather share one, begun `shared`), makes its copy stream wait (on the device, not
// the host) until the consumer's stream has passed the event recorded when that buffer was last
// released, issues cudaMemcpyAsync for the batch's tensors (with `pack`, tensors adjacent in one
// pinned slab go as one copy), records an event E and attaches E as a fence to every pinned block
// it read (the pool will not reuse them before E). When the batch is handed to the consumer
// (deliver), the consumer's stream waits on E: its kernels are ordered after the copy, the host
// never blocks, and copies issued ahead for later batches never delay the batch being computed
// (the wait is per batch, at hand-over). When the consumer drops the last batch of a buffer, an
// event is recorded on the consumer stream and the buffer returns to the stage's pool, to be
// reused only behind that event.
//
//   ferry::DeviceStage stage({.device = 0});
//   ferry::Tensor on_gpu = stage.to_device(pinned_tensor);      // async; ordered on stage.consumer_stream()
//   my_kernel<<<..., (cudaStream_t)stage.consumer_stream().native()>>>(on_gpu.raw());
//
//   ferry::HostCopy back = ferry::to_host(on_gpu, stage.consumer_stream());
//   ferry::Tensor result = back.get();                          // synchronizes before it returns
//
// Thread safety: batches are begun, moved and ended by one thread (the loader's consumer, or its
// pin thread for GPU decode); deliver() and stats() may run on another (the consumer); device
// batches may be dropped on any thread. GPU decode's own threads issue the decodes that end()
// queues, and record the fence end() returned (deferred: deliver() waits for the record).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ferry/core/rows.h"
#include "ferry/core/tensor.h"
#include "ferry/pinning/cuda.h"
#include "ferry/pinning/fence.h"
#include "ferry/pinning/pool.h"

namespace ferry {

struct DeviceStageOptions {
  int device = 0;
  /// Coalesce adjacent tensors of one pinned slab into a single cudaMemcpyAsync.
  bool pack = true;
  /// The stream the consumer computes on (a cudaStream_t, borrowed); null: the stage creates one.
  void* consumer_stream = nullptr;
  /// Create the copy stream (copies, GPU decode, the device gather) at the device's highest
  /// priority (DataLoaderOptions::high_priority_copies).
  bool high_priority = false;
  /// GPU decode: threads that issue the batches' decodes, each with its own nvJPEG state, stream
  /// and decode scratch (a batch's decoded images); DataLoaderOptions::gpu_decode_threads (0: chosen
  /// from the hardware at the first decode).
  int decode_threads = 0;
};

struct DeviceStageStats {
  std::uint64_t batches = 0;
  std::uint64_t copies = 0;  ///< cudaMemcpyAsync calls
  std::uint64_t bytes = 0;
  std::uint64_t device_allocations = 0;  ///< cudaMalloc calls (constant after warm-up)
  double copy_ms = 0;                    ///< GPU time of the copies completed so far (timing events)
  /// GPU decode: the decode threads' time decoding (nvJPEG holds its thread for the whole decode) and launching the transform kernel, summed over the threads
  double decode_ms = 0;
  /// GPU decode: the decode threads (DeviceStageOptions::decode_threads, as chosen; 0 before the first decode when chosen from the hardware)
  int decode_threads = 0;
  std::uint64_t images_decoded = 0;      ///< GPU decode: JPEGs decoded on the device
  std::uint64_t decode_allocations = 0;  ///< GPU decode: scratch (re)allocations (constant after warm-up)
  double gather_ms = 0;                  ///< device gather: GPU time of the gather kernels
  std::uint64_t rows_gathered = 0;       ///< device gather: rows read from registered host memory
  /// device gather: kernels launched (fewer than batches when small batches share one: end_held)
  std::uint64_t gather_launches = 0;
};

class DeviceStage {
 public:
  /// `pool`: the pinned pool whose blocks the stage fences (null: pinned sources are kept alive
  /// until their copy completes instead). Throws CudaError without a usable device.
  explicit DeviceStage(DeviceStageOptions options = {}, std::shared_ptr<PinnedPool> pool = nullptr);
  ~DeviceStage();
  DeviceStage(const DeviceStage&) = delete;
  DeviceStage& operator=(const DeviceStage&) = delete;

  const cuda::Stream& copy_stream() const noexcept;
  const cuda::Stream& consumer_stream() const noexcept;
  int device() const noexcept;
  DeviceStageStats stats() const;

  /// One tensor to the device, asynchronously (a batch of one), ordered on consumer_stream().
  Tensor to_device(const Tensor& host);

  /// Batch protocol (used by ferry::to_device through PinContext): begin with the batch's total
  /// bytes (64-byte aligned per tensor), move() each tensor, then end() issues the copies and
  /// returns their completion event; deliver(event) orders the consumer stream after it (once a
  /// fence: delivering the fence it delivered last again does nothing). `shared`: a small batch
  /// (8 MiB or less) is placed in one device buffer after the shared batches begun before it,
  /// up to 8 of them a buffer, which returns to the pool once the stage has moved on to another and
  /// every batch in it is dropped (one lease and one release a buffer, not a batch; a batch kept
  /// keeps its buffer's neighbours' memory too). Else each batch has a buffer of its own.
  void begin(std::size_t bytes, bool shared = false);
  Tensor move(const Tensor& host);
  std::shared_ptr<const EventFence> end();
  void deliver(const EventFence& copied);
  /// Several small batches in one launch (the loader's pin thread, with the device gather): ends
  /// the batch without issuing it. Its gathers join the held launch, which issue_held() issues
  /// with every batch held before it. False, the batch still begun and nothing changed, when it
  /// cannot join: it copies or decodes, an index is on the device, it writes more than 16 MiB,
  /// or the held launch has no room left (32 fields, 32 MiB of output, and 6,144 rows, or
  /// gather_index_in_launch where a row is 2^31 or more); then issue_held(), and end_held() again
  /// or end().
  bool end_held();
  /// Issues the held batches' gathers, one kernel for all, and returns their fences in the order
  /// they were held (empty when none was): one fence, shared, as one event follows the kernel
  /// (deliver() has the consumer's stream wait on it once). A held batch's tensors must not be
  /// used before its fence is delivered; a batch dropped meanwhile is still written, and its buffer
  /// reused only after. Throws CudaError on a failed launch (the held batches are then dropped).
  std::vector<std::shared_ptr<const EventFence>> issue_held();
  /// Drops a batch begun but not ended (after an exception mid-batch); issues nothing.
  void abort() noexcept;

  /// GPU decode, within a batch (between begin and end): reserves the decoded images' place in
  /// the batch's device buffer and returns them ([B, C, H, W] float32 after to_float, else
  /// [B, H, W, C] uint8). end() queues the decode to one of the stage's decode threads
  /// (DeviceStageOptions::decode_threads), which has nvJPEG decode the JPEGs of `bytes` (a pinned
  /// host block, read by nvJPEG in place: the batch's fence covers it) with the hardware backend
  /// where the GPU has JPEG engines (else the GPU hybrid one), then, on its own stream and after
  /// the batch's copies, runs one fused kernel that applies each image's crop, bilinear resize,
  /// flip and normalize from `index_on_device` (rows of detail::kEncodedIndexWords,
  /// ferry/detail/pass_math.h). Throws CudaError when ferry was built without nvJPEG; a JPEG
  /// nvJPEG refuses is a DataError from deliver(), the batch's hand-over.
  Tensor decode_images(const Tensor& bytes, const Tensor& index, const Tensor& index_on_device);
  /// Device gather, within a batch (Note [Device gather], ferry/pinning/gather.h): reserves
  /// [B, row_shape...] of `dtype` in the batch's device buffer and returns it; at end(), after the
  /// batch's copies, one kernel on the copy stream (one for all the fields that share `index`)
  /// copies row index[i] of the host array mapped at `device_rows` (RowRegistration) into row i.
  /// `index` is int64 [B]: on the host (read at end(), B <= gather_index_in_launch: the indices
  /// travel in the launch itself) or on this device (moved earlier in the batch). Throws CudaError
  /// when ferry was built without a CUDA compiler (can_gather()). With a `transform`, the rows are
  /// uint8 images the kernel transforms on the way (ferry/core/rows.h): the result is
  /// [B, transform->shape...] of transform->dtype, row i mirrored when index[i] carries
  /// `gather_flip_bit`; an Error names what does not fit (a row that is not the image's bytes).
  Tensor gather_rows(const Tensor& index, const void* device_rows, std::size_t row_bytes, DType dtype, const Shape& row_shape,
                     const RowTransform* transform = nullptr);
  /// Device gather of windows (RowWindow, ferry/core/rows.h), within a batch: reserves [B,
  /// window.length] of window.dtype in the batch's buffer and returns it; at end(), in the same
  /// launch as the batch's other gathers, row i is elements index[i] + window.shift onward of the
  /// host array of `elements` integers of `dtype` mapped at `device_elements` (RowRegistration),
  /// widened. `index` as gather_rows', its words window starts; an Error names a window that does
  /// not fit the array.
  Tensor gather_windows(const Tensor& index, const void* device_elements, DType dtype, std::int64_t elements,
                        const RowWindow& window);
  /// Set in an index word of gather_rows: that sample's row is mirrored (the rest is the row).
  static constexpr std::int64_t gather_flip_bit = detail::kRowFlipBit;
  /// The most rows a host index of gather_rows may have.
  static constexpr std::int64_t gather_index_in_launch = 3072;
  static bool can_gather() noexcept;
  /// Bytes of decode_images()'s output for an index of B rows.
  static std::size_t decoded_bytes(const Tensor& index);
  /// Whether this build can decode on the device (nvJPEG was found), and the backend in use
  /// ("hardware", "GPU hybrid", "default"; empty before the first decode).
  static bool can_decode_images() noexcept;
  std::string decode_backend() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

/// A device-to-host copy in flight: the data can only be reached through get(), which waits for
/// the copy first.
class HostCopy {
 public:
  HostCopy(Tensor host, cuda::Event done) : host_(std::move(host)), done_(std::make_shared<cuda::Event>(std::move(done))) {}
  /// True when the copy has finished (no blocking).
  bool ready() const { return done_->ready(); }
  /// Waits for the copy, then returns the host tensor.
  Tensor get() const {
    done_->synchronize();
    return host_;
  }

 private:
  Tensor host_;
  std::shared_ptr<cuda::Event> done_;
};

/// Copies a device tensor to (pinned) host memory on `stream`, non_blocking.
HostCopy to_host(const Tensor& device_tensor, const cuda::Stream& stream);

}  // namespace ferry
