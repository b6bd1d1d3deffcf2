// The device stage's GPU decode: see pinning/device_decode.h.
#include "device_decode.h"

#include <cstdlib>

#include "ferry/detail/engine.h"
#include "ferry/detail/pass_math.h"

namespace ferry::detail {
namespace {
// nvJPEG's hardware decode runs a kernel an image on streams of its own (14 a decoder thread on
// an H100), and CUDA maps every stream onto one of CUDA_DEVICE_MAX_CONNECTIONS hardware queues, 8
// by default: those kernels then share the consumer stream's queue and wait behind its kernels
// (Note [Decode threads]). The variable counts only when set before the process's first CUDA call.
void warn_if_few_hardware_queues() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (v && std::atoi(v) >= 32) return;
  warn_once("gpu-decode-connections",
            std::string("GPU decode: CUDA_DEVICE_MAX_CONNECTIONS is ") + (v ? v : "unset (8 hardware queues)") +
                ". nvJPEG's kernels run on streams of their own that then share the training stream's hardware "
                "queues and wait behind its kernels, and the GPU waits for data (bench/RESULTS.md). Set "
                "CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before the process's first CUDA call.");
}
}  // namespace

Tensor DecodeStage::add(DeviceBuffers& buffers, const Tensor& bytes, const Tensor& index, const Tensor& index_dev) {
  if (!buffers.begun()) throw Error("DeviceStage::decode_images: no batch begun");
  if (!gpu_decode_built())
    throw CudaError(
        "DeviceStage: GPU decode needs nvJPEG, and this build of ferry was made without it (CMake did not find "
        "nvjpeg.h and libnvjpeg: scripts/install-deps.sh installs them where the CUDA Toolkit lacks them)");
  if (!bytes.defined() || bytes.dtype() != DType::UInt8 || !bytes.is_pinned() || !index.defined() ||
      index.dtype() != DType::Int64 || index.dim() != 2 || index.size(1) != kEncodedIndexWords || !index.is_pinned() ||
      !index_dev.defined() || index_dev.device().kind != MemoryKind::Device)
    throw Error("DeviceStage::decode_images: expected pinned uint8 bytes, a pinned int64 [B, " +
                std::to_string(kEncodedIndexWords) + "] index and its device copy; got " + bytes.str() + ", " + index.str() +
                ", " + index_dev.str());
  if (!decoder_) {
    warn_if_few_hardware_queues();
    auto made = make_gpu_jpeg_decoder(device_, threads_, high_priority_);
    std::lock_guard l(mu_);  // the statistics read it on the consumer's thread
    decoder_ = std::move(made);
  }
  const std::int64_t* row = index.data<std::int64_t>();
  const std::int64_t rows = index.size(0), OH = row[EncodedRow::kOutHeight], OW = row[EncodedRow::kOutWidth],
                     C = row[EncodedRow::kChannels];
  const std::int64_t kind = row[EncodedRow::kOutput];
  const DType dtype = kind == kPassFloat32    ? DType::Float32
                      : kind == kPassFloat16  ? DType::Float16
                      : kind == kPassBFloat16 ? DType::BFloat16
                                              : DType::UInt8;
  const bool chw = kind != kPassUInt8 && row[EncodedRow::kChannelsLast] == 0;
  const Shape shape = chw ? Shape{rows, C, OH, OW} : Shape{rows, OH, OW, C};
  Tensor out = buffers.place(DeviceStage::decoded_bytes(index), dtype, shape, "decode_images");
  decodes_.push_back({bytes, index, index_dev.data<std::int64_t>(), static_cast<std::byte*>(out.raw())});
  return out;
}

void DecodeStage::lay_out() {
  for (Pending& d : decodes_) lay_out_decode_scratch(d.index.data<std::int64_t>(), static_cast<int>(d.index.size(0)));
}

DecodeStage::Submitted DecodeStage::submit(const cuda::Stream& copy, cuda::Event& done, DeviceBuffers& buffers,
                                           DeviceStageStats& counters) {
  // A decode thread issues the batch's decodes and records `done` after them (Note [Decode
  // threads]); their kernels wait on the device for what was queued on the copy stream so far.
  Submitted s;
  DecodeJob job;
  try {
    job.inputs = cuda::Event::create(device_);
    job.inputs.record(copy);
    for (Pending& d : decodes_) {
      job.work.push_back({std::make_shared<const std::pair<Tensor, Tensor>>(d.bytes, d.index),
                          static_cast<const std::byte*>(d.bytes.raw()), d.index.data<std::int64_t>(),
                          static_cast<int>(d.index.size(0)), d.index_dev, d.out});
      counters.images_decoded += static_cast<std::uint64_t>(d.index.size(0));
      s.read.push_back(d.bytes.storage());  // nvJPEG reads the block in place
    }
    job.done = done.native();
    s.fence = EventFence::deferred(std::move(done));
    job.fence = s.fence;
    buffers.set_writer(s.fence);
    decoder_->submit(std::move(job));
  } catch (...) {
    s.error = std::current_exception();
    if (s.fence) {  // not queued: its event stays unrecorded (complete at once), so the copies must be done
      try {
        copy.synchronize();
      } catch (...) {
      }
      s.fence->recorded(s.error);
    }
  }
  return s;
}

bool DecodeStage::stop() noexcept { return !decoder_ || decoder_->stop(); }

void DecodeStage::reset() noexcept {
  std::unique_ptr<GpuJpegDecoder> gone;
  {
    std::lock_guard l(mu_);
    gone = std::move(decoder_);
  }
}

std::string DecodeStage::backend() const {
  std::lock_guard l(mu_);
  return decoder_ ? decoder_->backend() : std::string();
}
double DecodeStage::busy_ms() const {
  std::lock_guard l(mu_);
  return decoder_ ? decoder_->busy_ms() : 0;
}
int DecodeStage::threads() const {
  std::lock_guard l(mu_);
  return decoder_ ? decoder_->threads() : threads_;
}
std::uint64_t DecodeStage::allocations() const {
  std::lock_guard l(mu_);
  return decoder_ ? decoder_->allocations() : 0;
}

}  // namespace ferry::detail
