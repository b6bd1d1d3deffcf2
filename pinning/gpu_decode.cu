// GPU decode: nvJPEG batched decode into a scratch buffer, then one fused kernel per batch that
// applies each image's single-pass plan (crop, bilinear resize, flip, to_float, normalize) with
// the arithmetic of ferry/detail/pass_math.h. See DeviceStage::decode_images.
#include <cuda_runtime.h>
#include <nvjpeg.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/core/error.h"
#include "ferry/detail/pass_math.h"
#include "ferry/pinning/cuda.h"
#include "gpu_decode.h"

namespace ferry::detail {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaError(std::string("GPU decode: ") + what + ": " + cudaGetErrorString(e));
}

const char* nvjpeg_status(nvjpegStatus_t s) {
  switch (s) {
    case NVJPEG_STATUS_SUCCESS: return "success";
    case NVJPEG_STATUS_NOT_INITIALIZED: return "not initialized";
    case NVJPEG_STATUS_INVALID_PARAMETER: return "invalid parameter";
    case NVJPEG_STATUS_BAD_JPEG: return "bad JPEG";
    case NVJPEG_STATUS_JPEG_NOT_SUPPORTED: return "JPEG not supported";
    case NVJPEG_STATUS_ALLOCATOR_FAILURE: return "allocator failure";
    case NVJPEG_STATUS_EXECUTION_FAILED: return "execution failed";
    case NVJPEG_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case NVJPEG_STATUS_INTERNAL_ERROR: return "internal error";
    case NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED: return "implementation not supported";
    default: return "unknown status";
  }
}

struct Plan {  // one image's index row, as the kernel reads it
  std::int64_t scratch, height, width;
  PassAxis y, x;
  int channels, round, kind;  // kind: PassOutput
  float a[4], b[4];
};

__device__ Plan read_plan(const std::int64_t* row) {
  Plan p;
  p.height = row[2];
  p.width = row[3];
  p.y = {row[4], row[5], row[6], row[7], row[8], static_cast<int>(row[9]), static_cast<int>(row[10])};
  p.x = {row[11], row[12], row[13], row[14], row[15], static_cast<int>(row[16]), static_cast<int>(row[17])};
  p.channels = static_cast<int>(row[18]);
  p.round = static_cast<int>(row[19]);
  p.kind = static_cast<int>(row[20]);
  for (int c = 0; c < 4; ++c) {
    p.a[c] = __int_as_float(static_cast<int>(row[21 + c]));
    p.b[c] = __int_as_float(static_cast<int>(row[25 + c]));
  }
  p.scratch = row[29];
  return p;
}

// One thread per output pixel of the batch; every channel. Decoded images are RGB interleaved
// (pitch = width * 3) in `scratch`.
__global__ void fused_transform(const std::uint8_t* scratch, const std::int64_t* index, int rows, int OH, int OW, int C,
                                int kind, int channels_last, void* out) {
  const std::int64_t pixels = static_cast<std::int64_t>(OH) * OW;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= pixels * rows) return;
  const int n = static_cast<int>(t / pixels);
  const std::int64_t p = t % pixels;
  const int y = static_cast<int>(p / OW), x = static_cast<int>(p % OW);
  const Plan plan = read_plan(index + static_cast<std::int64_t>(n) * kEncodedIndexWords);
  const std::uint8_t* src = scratch + plan.scratch;
  const PassTap ty = pass_tap(plan.y, y), tx = pass_tap(plan.x, x);
  for (int c = 0; c < C; ++c) {
    const float v = pass_value(src, plan.width * 3, 3, ty, tx, c, plan.round != 0);
    const std::int64_t hwc = ((static_cast<std::int64_t>(n) * OH + y) * OW + x) * C + c;
    if (kind == kPassUInt8) {
      static_cast<std::uint8_t*>(out)[hwc] = pass_store_u8(v, plan.a[c], plan.b[c]);
      continue;
    }
    const float f = __fadd_rn(__fmul_rn(plan.a[c], v), plan.b[c]);
    const std::int64_t o = channels_last ? hwc : ((static_cast<std::int64_t>(n) * C + c) * OH + y) * OW + x;
    if (kind == kPassFloat32) static_cast<float*>(out)[o] = f;
    else if (kind == kPassFloat16) static_cast<std::uint16_t*>(out)[o] = pass_f16_bits(f);
    else static_cast<std::uint16_t*>(out)[o] = pass_bf16_bits(f);
  }
}

// Note [Decode memory]
// Nothing the decode does per batch may synchronize the device: a cudaMalloc, cudaFree or
// cudaFreeHost there would wait for the training step running on another stream (and a step
// that fills the GPU would hold each batch's decode until it ends). So nvJPEG gets stream-ordered
// allocators (nvjpegCreateExV2): device memory from a pool of the decoder's own
// (cudaMallocFromPoolAsync / cudaFreeAsync on the stream nvJPEG names; the pool keeps what it
// frees), pinned memory from a cache whose blocks are reused once an event recorded at their free
// has passed; the decode scratch grows the same way. Pinned blocks are freed, and the pool
// destroyed, only with the decoder.
class DecodeMemory {
 public:
  explicit DecodeMemory(int device) {
    cuda::DeviceGuard guard(device);
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    check_cuda(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
    std::uint64_t keep = UINT64_MAX;  // never hand memory back at a synchronization
    cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  ~DecodeMemory() {
    for (Block& b : pinned_) {
      if (b.freed) cudaEventSynchronize(b.freed), cudaEventDestroy(b.freed);
      cudaFreeHost(b.ptr);
    }
    cudaMemPoolDestroy(pool_);  // its memory goes once nothing from it is outstanding
  }
  DecodeMemory(const DecodeMemory&) = delete;
  DecodeMemory& operator=(const DecodeMemory&) = delete;

  nvjpegDevAllocatorV2_t device_allocator() { return {&dev_malloc, &dev_free, this}; }
  nvjpegPinnedAllocatorV2_t pinned_allocator() { return {&pinned_malloc, &pinned_free, this}; }
  /// Device memory on `stream`'s order.
  void* device(std::size_t size, cudaStream_t stream) {
    void* p = nullptr;
    check_cuda(cudaMallocFromPoolAsync(&p, size, pool_, stream), "cudaMallocFromPoolAsync of the decode scratch");
    return p;
  }
  /// Pinned blocks allocated (not reused) so far: constant after warm-up.
  std::uint64_t pinned_allocations() const { return pinned_allocations_.load(); }

 private:
  struct Block {
    void* ptr;
    std::size_t size;
    cudaEvent_t freed;  // recorded at the free on nvJPEG's stream; null while in use
    bool in_use;
  };
  static int dev_malloc(void* ctx, void** p, std::size_t size, cudaStream_t s) {
    return cudaMallocFromPoolAsync(p, size, static_cast<DecodeMemory*>(ctx)->pool_, s) == cudaSuccess ? 0 : 1;
  }
  static int dev_free(void*, void* p, std::size_t, cudaStream_t s) { return cudaFreeAsync(p, s) == cudaSuccess ? 0 : 1; }
  static int pinned_malloc(void* ctx, void** p, std::size_t size, cudaStream_t) {
    auto* m = static_cast<DecodeMemory*>(ctx);
    std::lock_guard l(m->mu_);
    Block* best = nullptr;
    for (Block& b : m->pinned_)
      if (!b.in_use && b.size >= size && b.size <= 2 * size + 4096 && (!best || b.size < best->size) &&
          (!b.freed || cudaEventQuery(b.freed) == cudaSuccess))
        best = &b;
    cudaGetLastError();
    if (!best) {
      void* q = nullptr;
      if (cudaHostAlloc(&q, size, cudaHostAllocPortable) != cudaSuccess) return 1;
      m->pinned_.push_back({q, size, nullptr, false});
      ++m->pinned_allocations_;
      best = &m->pinned_.back();
    }
    best->in_use = true;
    *p = best->ptr;
    return 0;
  }
  static int pinned_free(void* ctx, void* p, std::size_t, cudaStream_t s) {
    auto* m = static_cast<DecodeMemory*>(ctx);
    std::lock_guard l(m->mu_);
    for (Block& b : m->pinned_) {
      if (b.ptr != p) continue;
      if (!b.freed && cudaEventCreateWithFlags(&b.freed, cudaEventDisableTiming) != cudaSuccess) return 1;
      if (cudaEventRecord(b.freed, s) != cudaSuccess) return 1;
      b.in_use = false;
      return 0;
    }
    return 1;
  }

  cudaMemPool_t pool_ = nullptr;
  std::mutex mu_;
  std::vector<Block> pinned_;  // pointers into it are used only under mu_
  std::atomic<std::uint64_t> pinned_allocations_{0};
};

class NvJpegDecoder final : public GpuJpegDecoder {
 public:
  explicit NvJpegDecoder(int device) : device_(device), mem_(device) {
    cuda::DeviceGuard guard(device_);
    nvjpegDevAllocatorV2_t dev = mem_.device_allocator();
    nvjpegPinnedAllocatorV2_t pinned = mem_.pinned_allocator();
    // The hardware backend where the GPU has JPEG engines (A100, H100, ...), else the GPU hybrid.
    const std::pair<nvjpegBackend_t, const char*> backends[] = {{NVJPEG_BACKEND_HARDWARE, "hardware"},
                                                                {NVJPEG_BACKEND_GPU_HYBRID, "GPU hybrid"},
                                                                {NVJPEG_BACKEND_DEFAULT, "default"}};
    nvjpegStatus_t last = NVJPEG_STATUS_NOT_INITIALIZED;
    for (auto [b, name] : backends) {
      last = nvjpegCreateExV2(b, &dev, &pinned, NVJPEG_FLAGS_DEFAULT, &handle_);
      if (last == NVJPEG_STATUS_SUCCESS) {
        backend_ = name;
        break;
      }
      handle_ = nullptr;
    }
    if (!handle_) throw CudaError(std::string("GPU decode: nvjpegCreateEx failed for every backend: ") + nvjpeg_status(last));
    if (nvjpegJpegStateCreate(handle_, &state_) != NVJPEG_STATUS_SUCCESS) throw CudaError("GPU decode: nvjpegJpegStateCreate failed");
  }
  ~NvJpegDecoder() override {
    cuda::DeviceGuard guard(device_);
    if (scratch_) cudaFree(scratch_);  // synchronizes: the last kernel is done with it
    if (fallback_state_) nvjpegJpegStateDestroy(fallback_state_);
    if (fallback_) nvjpegDestroy(fallback_);
    if (state_) nvjpegJpegStateDestroy(state_);
    if (handle_) nvjpegDestroy(handle_);
  }

  void prepare(std::int64_t* index, int rows) override {
    std::size_t total = 0;
    for (int r = 0; r < rows; ++r) {
      std::int64_t* row = index + static_cast<std::int64_t>(r) * kEncodedIndexWords;
      row[29] = static_cast<std::int64_t>(total);
      total += (static_cast<std::size_t>(row[2]) * static_cast<std::size_t>(row[3]) * 3 + 255) / 256 * 256;
    }
    scratch_needed_ = total;  // run() grows the scratch, in the stream's order
  }

  void run(const std::byte* base, const std::int64_t* index, const std::int64_t* index_dev, int rows, void* out,
           void* stream) override {
    cuda::DeviceGuard guard(device_);
    auto s = static_cast<cudaStream_t>(stream);
    if (scratch_needed_ > scratch_size_) {  // Note [Decode memory]: no device synchronization
      if (scratch_) check_cuda(cudaFreeAsync(scratch_, s), "cudaFreeAsync of the decode scratch");
      scratch_ = nullptr;
      const std::size_t size = scratch_needed_ + scratch_needed_ / 4;  // headroom: batches vary in size
      scratch_ = mem_.device(size, s);
      scratch_size_ = size;
      ++allocations_;
    }
    data_.resize(static_cast<std::size_t>(rows));
    lengths_.resize(static_cast<std::size_t>(rows));
    images_.assign(static_cast<std::size_t>(rows), nvjpegImage_t{});
    for (int r = 0; r < rows; ++r) {
      const std::int64_t* row = index + static_cast<std::int64_t>(r) * kEncodedIndexWords;
      data_[static_cast<std::size_t>(r)] = reinterpret_cast<const unsigned char*>(base + row[0]);
      lengths_[static_cast<std::size_t>(r)] = static_cast<std::size_t>(row[1]);
      images_[static_cast<std::size_t>(r)].channel[0] = static_cast<unsigned char*>(scratch_) + row[29];
      images_[static_cast<std::size_t>(r)].pitch[0] = static_cast<unsigned int>(row[3] * 3);
    }
    nvjpegStatus_t st = NVJPEG_STATUS_SUCCESS;
    if (rows != initialized_rows_) {
      st = nvjpegDecodeBatchedInitialize(handle_, state_, rows, 1, NVJPEG_OUTPUT_RGBI);
      if (st == NVJPEG_STATUS_SUCCESS) initialized_rows_ = rows;
    }
    if (st == NVJPEG_STATUS_SUCCESS) st = nvjpegDecodeBatched(handle_, state_, data_.data(), lengths_.data(), images_.data(), s);
    if (st != NVJPEG_STATUS_SUCCESS) {
      initialized_rows_ = -1;
      decode_one_by_one(rows, s, st);  // progressive, CMYK, ... : what the batched backend refuses
    }
    const std::int64_t* first = index;
    const int OH = static_cast<int>(first[8]), OW = static_cast<int>(first[15]), C = static_cast<int>(first[18]);
    const std::int64_t threads = static_cast<std::int64_t>(rows) * OH * OW;
    const int block = 256;
    fused_transform<<<static_cast<unsigned>((threads + block - 1) / block), block, 0, s>>>(
        static_cast<const std::uint8_t*>(scratch_), index_dev, rows, OH, OW, C, static_cast<int>(first[20]), static_cast<int>(first[30]),
        out);
    check_cuda(cudaGetLastError(), "the fused transform kernel");
  }

  std::string backend() const override { return backend_; }
  std::uint64_t allocations() const override { return allocations_ + mem_.pinned_allocations(); }

 private:
  void decode_one_by_one(int rows, cudaStream_t s, nvjpegStatus_t batched_status) {
    if (!fallback_) {
      nvjpegDevAllocatorV2_t dev = mem_.device_allocator();
      nvjpegPinnedAllocatorV2_t pinned = mem_.pinned_allocator();
      if (nvjpegCreateExV2(NVJPEG_BACKEND_DEFAULT, &dev, &pinned, NVJPEG_FLAGS_DEFAULT, &fallback_) != NVJPEG_STATUS_SUCCESS ||
          nvjpegJpegStateCreate(fallback_, &fallback_state_) != NVJPEG_STATUS_SUCCESS)
        throw CudaError(std::string("GPU decode: the batched decode failed (") + nvjpeg_status(batched_status) +
                        ") and no fallback decoder could start");
    }
    for (int r = 0; r < rows; ++r) {
      const nvjpegStatus_t st = nvjpegDecode(fallback_, fallback_state_, data_[static_cast<std::size_t>(r)],
                                             lengths_[static_cast<std::size_t>(r)], NVJPEG_OUTPUT_RGBI,
                                             &images_[static_cast<std::size_t>(r)], s);
      if (st != NVJPEG_STATUS_SUCCESS)
        throw DataError("GPU decode", DataError::kNoOffset,
                        "image " + std::to_string(r) + " of the batch (" + std::to_string(lengths_[static_cast<std::size_t>(r)]) +
                            " bytes) is a JPEG nvJPEG cannot decode: " + nvjpeg_status(st));
    }
  }

  int device_;
  DecodeMemory mem_;  // outlives the handles, which free into it
  nvjpegHandle_t handle_ = nullptr, fallback_ = nullptr;
  nvjpegJpegState_t state_ = nullptr, fallback_state_ = nullptr;
  std::string backend_;
  int initialized_rows_ = -1;
  void* scratch_ = nullptr;
  std::size_t scratch_size_ = 0, scratch_needed_ = 0;
  std::uint64_t allocations_ = 0;
  std::vector<const unsigned char*> data_;
  std::vector<std::size_t> lengths_;
  std::vector<nvjpegImage_t> images_;
};

}  // namespace

bool gpu_decode_built() noexcept { return true; }

std::unique_ptr<GpuJpegDecoder> make_gpu_jpeg_decoder(int device) { return std::make_unique<NvJpegDecoder>(device); }

}  // namespace ferry::detail
