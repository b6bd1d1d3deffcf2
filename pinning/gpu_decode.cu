// GPU decode: nvJPEG batched decode into a scratch buffer, then one fused kernel per batch that
// applies each image's single-pass plan (crop, bilinear resize, flip, to_float, normalize) with
// the arithmetic of ferry/detail/pass_math.h. See DeviceStage::decode_images.
#include <cuda_runtime.h>
#include <nvjpeg.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/core/error.h"
#include "ferry/detail/pass_math.h"
#include "ferry/pinning/cuda.h"
#include "gpu_decode.h"
#include "thread.h"

namespace ferry::detail {

void warn_once(const char* key, const std::string& message);  // ferry/detail/engine.h (which nvcc does not take)
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

// c0, L0, R, c1, N, resized, flip: ImagePassPlan::Axis as the worker wrote it (image.cpp).
__device__ PassAxis read_axis(const std::int64_t* a) {
  return {a[0], a[1], a[2], a[3], a[4], static_cast<int>(a[5]), static_cast<int>(a[6])};
}

__device__ Plan read_plan(const std::int64_t* row) {
  Plan p;
  p.height = row[EncodedRow::kHeight];
  p.width = row[EncodedRow::kWidth];
  p.y = read_axis(row + EncodedRow::kAxisY);
  p.x = read_axis(row + EncodedRow::kAxisX);
  p.channels = static_cast<int>(row[EncodedRow::kChannels]);
  p.round = static_cast<int>(row[EncodedRow::kRound]);
  p.kind = static_cast<int>(row[EncodedRow::kOutput]);
  for (int c = 0; c < 4; ++c) {
    p.a[c] = __int_as_float(static_cast<int>(row[EncodedRow::kScale + c]));
    p.b[c] = __int_as_float(static_cast<int>(row[EncodedRow::kShift + c]));
  }
  p.scratch = row[EncodedRow::kScratch];
  return p;
}

// One thread per output pixel of the batch; every channel. Decoded images are RGB interleaved
// (pitch = width * 3) in `scratch`.
__global__ void fused_transform(const std::uint8_t* scratch, const std::int64_t* index, int rows, int OH, int OW, int C, int kind,
                                int channels_last, void* out) {
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
    if (kind == kPassFloat32)
      static_cast<float*>(out)[o] = f;
    else if (kind == kPassFloat16)
      static_cast<std::uint16_t*>(out)[o] = pass_f16_bits(f);
    else
      static_cast<std::uint16_t*>(out)[o] = pass_bf16_bits(f);
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
    // Memory freed on one decode thread's stream is not reused on another's behind a device-side
    // dependency: nvJPEG's hardware writes do not wait for one (Note [Decode threads]).
    int no = 0;
    cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowOpportunistic, &no);
    cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &no);
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

// Note [Decode threads]
// nvJPEG's hardware backend (A100, H100) departs from CUDA's stream model in two ways, measured on
// an H100 with nvJPEG 13.0.1 (bench/probe_nvjpeg.cpp; the second was reported first in
// torchcodec's pull request 1634, for nvJPEG 12.3 to 13.2):
//  * nvjpegDecodeBatched returns when the batch is decoded: the thread that calls it waits out
//    the whole decode (about 8 ms a batch of 256 500x375 images alone, 40 ms and more beside a
//    step that fills the SMs). One thread issuing every decode delivers one batch a decode.
//  * Its writes are not ordered after work queued before it on its stream: they happen during the
//    call, while kernels queued earlier may still read the buffer. A cudaStreamWaitEvent does not
//    hold them back either; only a host wait does.
// So the decoder has threads (DataLoaderOptions::gpu_decode_threads; by default 2 where the GPU
// has JPEG engines and the host 8 CPUs, else 1: decode_threads_for), each with its
// own nvJPEG handle and state, stream and scratch, which take the batches' decodes in turn from
// a queue; the pin thread only queues them (DeviceStage::end). Two decodes run at once: 41,673
// images/s against 26,708 for one, alone (bench_gpu_decode's ceiling rows, H100).
// Beside a training step, what the decode gets is decided by where its kernels queue: nvJPEG runs
// a kernel an image (rgba2rgb) on 14 streams of its own a handle, not on the stream it is given
// (Nsight Compute over bench/probe_nvjpeg --alone-only), so that stream's priority never applies to
// them. CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues, 8 by default; there
// nvJPEG's streams share the step's queue and each kernel waits behind the step's kernels queued
// before it (15-22% of a loop of 20 ms steps waiting for data; 1-2% at 32 queues, bench/RESULTS.md
// "Images: nvJPEG's kernels and the hardware queues"). The variable counts only before CUDA
// starts, so DeviceStage warns when it is lower than 32 rather than setting it.
// Before a thread's decode writes its scratch, it waits on the host for the event recorded after
// the fused kernel that last read that scratch; each thread has two scratches, used in turn, so
// that wait is for the kernel of its batch before last (long done) rather than of the batch it
// just issued, whose kernel waits on the device for the batch's copies and output buffer; a
// scratch that grows is replaced only once the thread's stream has drained. The
// fused kernel waits on the device for the batch's copies (its index, its output buffer's
// release), and the batch's fence is a deferred EventFence recorded after it: the consumer's
// hand-over (DeviceStage::deliver) waits for the record, then for the event on the device, and
// rethrows a decode's error there, at the batch's position.
// Opening nvJPEG's handle and state in one thread while another decodes on the hardware backend
// can deadlock both for good (seen on an H200 with nvJPEG 13.0: one thread waiting inside
// nvjpegDecodeBatched in cuEventSynchronize, the other inside nvjpegJpegStateCreate in libnvcuvid's
// cuMemFree; bench_object_store --watchdog-s prints such stacks). So opens and decodes are gated
// (begin_open, begin_decode): a thread opens its context, or a fallback decoder, only while no
// decode runs, and decodes wait while one opens; the threads after the first open theirs once the
// first batch is decoded, so the first batch does not wait for them. The gate is a decoder's own:
// a second loader decoding on the GPU in the same process opens its decoder beside the first's
// decodes ungated (not seen to hang; a process-wide gate would make one loader's start wait for
// the other's decodes, and those can wait for the other loader's consumer).
// Still open: with two threads, decodes have stopped for good (both threads in nvjpegDecodeBatched,
// in cuEventSynchronize; nvcuvid's own thread in a timed wait) in 7 of 1,204 loaders of 30 batches
// while the process took profiling signals, on an H100 with nvJPEG 13.0, in a process's first
// loader too; never with one thread or without signals (bench/stress_gpu_decode; bench/RESULTS.md
// "GPU decode: the two-thread stall"). Note [A decode that never returns] keeps it from holding
// the program.
// The decode threads chosen from the hardware (DataLoaderOptions::gpu_decode_threads = 0): 2 where
// nvJPEG's hardware backend has JPEG engines (`engines` > 0: A100, H100, H200) and the machine has
// 8 CPUs or more, else 1. Two threads give 1.5-1.7x one thread's images on an H100, within 0.89
// of all its engines give (bench/RESULTS.md "The JPEG engines' ceiling"); each thread is a busy
// core while it decodes, so more are left to the user. That core is nvJPEG's: bitstreams in device
// memory (NVJPEG_BACKEND_HARDWARE_DEVICE), no pipelining, a context made for blocking waits and the
// GPU hybrid backend each hold their thread as busy (bench/RESULTS.md "GPU decode: what holds a
// decode thread's core").
int decode_threads_for(unsigned engines, unsigned cpus) noexcept { return engines > 0 && cpus >= 8 ? 2 : 1; }

// Note [A decode that never returns]
// A call into nvJPEG that never comes back (the two-thread stall of Note [Decode threads]) must not
// take the program with it. Two waits could otherwise last for good:
//  * the consumer's, for the batch's decode to be issued: with a timeout or a wait poll it waits in
//    slices (LoaderCore::Parts::await_issued): the poll can interrupt it (Ctrl-C in Python) and
//    the timeout ends it with TimeoutError after twice `timeout`;
//  * the loader's destruction, which waits for the decode threads: stop() waits while they issue
//    what is queued, but once a thread has been inside one decode for kStuckDecodeSeconds, it
//    gives up on it. That thread is detached and the decoder, its nvJPEG handles, memory and the
//    batch's host bytes are left to it, never freed (it may come back and write into them); the
//    fences of its batch and of the jobs still queued (never issued) are recorded with an error, so
//    nothing waits on them; and the DeviceStage frees none of its device buffers (the decode may
//    still write one) and does not synchronize. A warning says so. What is left is a leak, once.
// FERRY_TEST_GPU_DECODE_STALL_MS=N (tests only) holds the decoder's third decode N ms before it
// calls nvJPEG, inside the gate, as a call that does not return would.
class NvJpegDecoder {
 public:
  NvJpegDecoder(int device, int threads, bool high_priority) : device_(device), mem_(device) {
    if (const char* v = std::getenv("FERRY_TEST_GPU_DECODE_STALL_MS")) stall_ms_ = std::atol(v);
    cuda::DeviceGuard guard(device_);
    contexts_.resize(static_cast<std::size_t>(std::max(threads, 1)));
    try {
      open(contexts_[0], high_priority);
      if (threads == 0) {  // chosen from the hardware: the first handle says how many engines it drives
        unsigned engines = 0, cores = 0;
        if (backend_ != "hardware" ||
            nvjpegGetHardwareDecoderInfo(contexts_[0].handle, &engines, &cores) != NVJPEG_STATUS_SUCCESS)
          engines = 0;
        contexts_.resize(static_cast<std::size_t>(decode_threads_for(engines, std::thread::hardware_concurrency())));
      }
    } catch (...) {
      close(contexts_[0]);
      throw;
    }
    // The other threads open their own contexts (about 0.2 s each on an H100: nvJPEG's handle and
    // state) once the first batch is decoded, while no decode runs (Note [Decode threads]): the
    // first batch does not wait for them, the next ones wait for their opens.
    for (std::size_t i = 0; i < contexts_.size(); ++i) {
      {
        std::lock_guard l(mu_);
        ++running_;
      }
      threads_.emplace_back("ferry-decode-" + std::to_string(i), [this, i, high_priority] {
        struct Ended {  // however the thread ends: stop() counts it out
          NvJpegDecoder& d;
          ~Ended() {
            {
              std::lock_guard l(d.mu_);
              --d.running_;
            }
            d.ended_.notify_all();
          }
        } ended{*this};
        cudaSetDevice(device_);  // this thread's device, for good
        if (i > 0) {
          // After the first batch is decoded, and while no decode runs (Note [Decode threads]).
          if (!begin_open(true)) return;  // stopping before any batch came
          try {
            open(contexts_[i], high_priority);
            end_open();
          } catch (const std::exception& e) {
            close(contexts_[i]);  // the other threads take the batches
            end_open();
            ++failed_threads_;
            warn_once("gpu-decode-thread", std::string("GPU decode: a decode thread could not start (") + e.what() +
                                               "); the others decode its batches");
            return;
          }
        }
        serve(contexts_[i]);
      });
    }
  }
  // Only once every thread has ended (stop_threads() returned true).
  ~NvJpegDecoder() {
    for (Thread& t : threads_) t.join();
    cuda::DeviceGuard guard(device_);
    for (auto c = contexts_.rbegin(); c != contexts_.rend(); ++c) close(*c);
  }

  // GpuJpegDecoder::stop(), less the freeing: true once every thread has ended, false when one has
  // been inside a decode too long (Note [A decode that never returns]).
  bool stop_threads() noexcept {
    {
      std::lock_guard l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    {
      std::lock_guard l(gate_mu_);
      gate_stop_ = true;
    }
    gate_cv_.notify_all();
    std::vector<std::shared_ptr<EventFence>> stuck;
    std::deque<DecodeJob> queued;
    {
      std::unique_lock l(mu_);
      const auto limit = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(GpuJpegDecoder::kStuckDecodeSeconds));
      while (!ended_.wait_for(l, std::chrono::milliseconds(100), [&] { return running_ == 0; })) {
        const auto now = std::chrono::steady_clock::now();
        for (Context& c : contexts_)
          if (c.current && now - c.since > limit) stuck.push_back(c.current);
        if (stuck.empty()) continue;  // each finishes the jobs queued
        queued.swap(jobs_);
        break;
      }
    }
    if (stuck.empty()) {
      for (Thread& t : threads_) t.join();
      return true;
    }
    try {
      give_up(stuck, queued);
    } catch (...) {  // out of memory for the error's text: the fences are left as they are
    }
    for (Thread& t : threads_) t.detach();  // the decoder stays theirs, never freed
    return false;
  }

  // stop_threads() gives up on the decodes of `stuck` (their fences) and on the jobs `queued`.
  void give_up(const std::vector<std::shared_ptr<EventFence>>& stuck, std::deque<DecodeJob>& queued) {
    const auto error = std::make_exception_ptr(
        CudaError("GPU decode: a decode has not come back from nvJPEG in " +
                  std::to_string(static_cast<int>(GpuJpegDecoder::kStuckDecodeSeconds)) +
                  " s; the loader stopped without it (Note [A decode that never returns] in pinning/gpu_decode.cu)"));
    for (auto& f : stuck) f->recorded(error);
    for (DecodeJob& j : queued) j.fence->recorded(error);  // never issued: their host bytes go back now
    queued.clear();
    warn_once("gpu-decode-stuck",
              "GPU decode: a decode thread has been inside nvJPEG for over " +
                  std::to_string(static_cast<int>(GpuJpegDecoder::kStuckDecodeSeconds)) +
                  " s; the loader is destroyed without it, leaving its nvJPEG state, its batch and the "
                  "stage's device buffers unfreed (set gpu_decode_threads = 1 to avoid the known two-thread stall)");
  }

  void submit(DecodeJob job) {
    {
      std::lock_guard l(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

  std::string backend() const { return backend_; }
  double busy_ms() const { return static_cast<double>(busy_ns_.load()) / 1e6; }
  std::uint64_t allocations() const { return allocations_.load() + mem_.pinned_allocations(); }
  int threads() const { return static_cast<int>(contexts_.size()) - failed_threads_.load(); }

 private:
  struct Context {
    nvjpegHandle_t handle = nullptr, fallback = nullptr;
    nvjpegJpegState_t state = nullptr, fallback_state = nullptr;
    cuda::Stream owned_stream;      // the thread's stream (destroyed with the context)
    cudaStream_t stream = nullptr;  // owned_stream's handle
    // Two scratches, used in turn: a decode waits for the kernel that read its scratch two
    // batches ago, not for the one just issued (Note [Decode threads]).
    struct Scratch {
      cudaEvent_t read = nullptr;  // recorded after the last kernel that read it
      bool pending = false;        // `read` was recorded
      void* ptr = nullptr;
      std::size_t size = 0;
    };
    Scratch scratch[2];
    int turn = 0;  // the scratch the next decode writes
    int initialized_rows = -1;
    // The job being issued and since when (guarded by mu_; null between jobs): what stop() gives
    // up on (Note [A decode that never returns]).
    std::shared_ptr<EventFence> current;
    std::chrono::steady_clock::time_point since;
    std::vector<const unsigned char*> data;
    std::vector<std::size_t> lengths;
    std::vector<nvjpegImage_t> images;
  };

  // A thread's context. The first finds the backend (backend_, backend_kind_, set before any
  // other thread starts); the others open the same one.
  void open(Context& c, bool high_priority) {
    nvjpegDevAllocatorV2_t dev = mem_.device_allocator();
    nvjpegPinnedAllocatorV2_t pinned = mem_.pinned_allocator();
    // The hardware backend where the GPU has JPEG engines (A100, H100, ...), else the GPU hybrid.
    const std::pair<nvjpegBackend_t, const char*> backends[] = {
        {NVJPEG_BACKEND_HARDWARE, "hardware"}, {NVJPEG_BACKEND_GPU_HYBRID, "GPU hybrid"}, {NVJPEG_BACKEND_DEFAULT, "default"}};
    nvjpegStatus_t last = NVJPEG_STATUS_NOT_INITIALIZED;
    const bool first = backend_.empty();
    for (auto [b, name] : backends) {
      if (!first && b != backend_kind_) continue;
      last = nvjpegCreateExV2(b, &dev, &pinned, NVJPEG_FLAGS_DEFAULT, &c.handle);
      if (last == NVJPEG_STATUS_SUCCESS) {
        if (first) backend_ = name, backend_kind_ = b;
        break;
      }
      c.handle = nullptr;
    }
    if (!c.handle) throw CudaError(std::string("GPU decode: nvjpegCreateEx failed for every backend: ") + nvjpeg_status(last));
    if (nvjpegJpegStateCreate(c.handle, &c.state) != NVJPEG_STATUS_SUCCESS)
      throw CudaError("GPU decode: nvjpegJpegStateCreate failed");
    c.owned_stream = cuda::Stream::create(device_, high_priority);
    c.stream = static_cast<cudaStream_t>(c.owned_stream.native());
    for (Context::Scratch& x : c.scratch)
      check_cuda(cudaEventCreateWithFlags(&x.read, cudaEventDisableTiming), "cudaEventCreate");
  }

  static void close(Context& c) noexcept {
    if (c.stream) cudaStreamSynchronize(c.stream);
    for (Context::Scratch& x : c.scratch) {
      if (x.ptr) cudaFree(x.ptr);
      if (x.read) cudaEventDestroy(x.read);
    }
    if (c.fallback_state) nvjpegJpegStateDestroy(c.fallback_state);
    if (c.fallback) nvjpegDestroy(c.fallback);
    if (c.state) nvjpegJpegStateDestroy(c.state);
    if (c.handle) nvjpegDestroy(c.handle);
    c = Context{};
  }

  void serve(Context& c) {
    for (;;) {
      DecodeJob job;
      {
        std::unique_lock l(mu_);
        cv_.wait(l, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, and nothing is left
        job = std::move(jobs_.front());
        jobs_.pop_front();
        c.current = job.fence;
        c.since = std::chrono::steady_clock::now();
      }
      run(c, job);
      std::lock_guard l(mu_);
      c.current.reset();
    }
  }

  // Issues a batch's decodes on c's stream and records its fence; never throws (a failure goes
  // to the fence, and so to the consumer at the batch's position).
  void run(Context& c, DecodeJob& job) noexcept {
    begin_decode();
    const auto t0 = std::chrono::steady_clock::now();
    std::exception_ptr error;
    bool inputs_waited = false;
    try {
      cuda::DeviceGuard guard(device_);
      if (stall_ms_ > 0 && stalls_.fetch_add(1) == 2) std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms_));  // tests
      for (DecodeWork& w : job.work) {
        const int rows = w.rows;
        const std::int64_t* index = w.index;
        decode(c, w.bytes, index, rows);
        if (!inputs_waited)
          check_cuda(cudaStreamWaitEvent(c.stream, static_cast<cudaEvent_t>(job.inputs.native()), 0), "cudaStreamWaitEvent");
        inputs_waited = true;
        const int OH = static_cast<int>(index[8]), OW = static_cast<int>(index[15]), C = static_cast<int>(index[18]);
        const std::int64_t threads = static_cast<std::int64_t>(rows) * OH * OW;
        const int block = 256;
        Context::Scratch& x = c.scratch[c.turn];
        fused_transform<<<static_cast<unsigned>((threads + block - 1) / block), block, 0, c.stream>>>(
            static_cast<const std::uint8_t*>(x.ptr), w.index_dev, rows, OH, OW, C, static_cast<int>(index[20]),
            static_cast<int>(index[30]), w.out);
        check_cuda(cudaGetLastError(), "the fused transform kernel");
        check_cuda(cudaEventRecord(x.read, c.stream), "cudaEventRecord");
        x.pending = true;
        c.turn ^= 1;
      }
    } catch (...) {
      error = std::current_exception();
    }
    // The fence covers the batch's copies even when a decode failed before waiting for them.
    cudaError_t e = inputs_waited ? cudaSuccess : cudaStreamWaitEvent(c.stream, static_cast<cudaEvent_t>(job.inputs.native()), 0);
    if (e == cudaSuccess) e = cudaEventRecord(static_cast<cudaEvent_t>(job.done), c.stream);
    if (e != cudaSuccess) {
      // The fence's event may then be unrecorded (complete at once): wait here instead.
      cudaStreamSynchronize(c.stream);
      if (!error)
        error =
            std::make_exception_ptr(CudaError(std::string("GPU decode: recording the batch's event: ") + cudaGetErrorString(e)));
    }
    busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    end_decode();
    job.fence->recorded(error);
    job.work.clear();  // the batch's host tensors go now, not with the next job
  }

  // The gate between opening nvJPEG handles and states and decoding (Note [Decode threads]): an
  // open waits until no decode runs, and decodes wait while one is opening. With `after_first`,
  // the open also waits for the first batch's decode to end (false: the decoder is stopping).
  bool begin_open(bool after_first = false) {
    std::unique_lock l(gate_mu_);
    if (after_first) gate_cv_.wait(l, [&] { return decodes_done_ > 0 || gate_stop_; });
    if (after_first && decodes_done_ == 0) return false;
    gate_cv_.wait(l, [&] { return !opening_; });  // one open at a time
    opening_ = true;
    gate_cv_.wait(l, [&] { return decoding_ == 0; });
    return true;
  }
  void end_open() {
    {
      std::lock_guard l(gate_mu_);
      opening_ = false;
    }
    gate_cv_.notify_all();
  }
  void begin_decode() {
    std::unique_lock l(gate_mu_);
    gate_cv_.wait(l, [&] { return !opening_; });
    ++decoding_;
  }
  void end_decode() {
    {
      std::lock_guard l(gate_mu_);
      --decoding_;
      ++decodes_done_;
    }
    gate_cv_.notify_all();
  }

  // Decodes a batch's images into c's scratch (Note [Decode threads]: a host wait first).
  void decode(Context& c, const std::byte* base, const std::int64_t* index, int rows) {
    Context::Scratch& x = c.scratch[c.turn];
    if (x.pending) check_cuda(cudaEventSynchronize(x.read), "waiting for the scratch's last reader");
    x.pending = false;
    std::size_t needed = 0;
    for (int r = 0; r < rows; ++r) {
      const std::int64_t* row = index + static_cast<std::int64_t>(r) * kEncodedIndexWords;
      needed = std::max(needed, static_cast<std::size_t>(row[EncodedRow::kScratch]) +
                                    static_cast<std::size_t>(row[EncodedRow::kHeight] * row[EncodedRow::kWidth] * 3));
    }
    if (needed > x.size) {  // Note [Decode memory]: no device synchronization
      check_cuda(cudaStreamSynchronize(c.stream), "draining the decode stream before its scratch grows");
      if (x.ptr) check_cuda(cudaFreeAsync(x.ptr, c.stream), "cudaFreeAsync of the decode scratch");
      x.ptr = nullptr;
      x.size = 0;
      const std::size_t size = needed + needed / 4;  // headroom: batches vary in size
      x.ptr = mem_.device(size, c.stream);
      check_cuda(cudaStreamSynchronize(c.stream), "the decode scratch's allocation");  // made before nvJPEG writes
      x.size = size;
      ++allocations_;
    }
    c.data.resize(static_cast<std::size_t>(rows));
    c.lengths.resize(static_cast<std::size_t>(rows));
    c.images.assign(static_cast<std::size_t>(rows), nvjpegImage_t{});
    for (int r = 0; r < rows; ++r) {
      const std::int64_t* row = index + static_cast<std::int64_t>(r) * kEncodedIndexWords;
      const auto i = static_cast<std::size_t>(r);
      c.data[i] = reinterpret_cast<const unsigned char*>(base + row[EncodedRow::kOffset]);
      c.lengths[i] = static_cast<std::size_t>(row[EncodedRow::kBytes]);
      c.images[i].channel[0] = static_cast<unsigned char*>(x.ptr) + row[EncodedRow::kScratch];
      c.images[i].pitch[0] = static_cast<unsigned int>(row[EncodedRow::kWidth] * 3);
    }
    nvjpegStatus_t st = NVJPEG_STATUS_SUCCESS;
    if (rows != c.initialized_rows) {
      st = nvjpegDecodeBatchedInitialize(c.handle, c.state, rows, 1, NVJPEG_OUTPUT_RGBI);
      if (st == NVJPEG_STATUS_SUCCESS) c.initialized_rows = rows;
    }
    if (st == NVJPEG_STATUS_SUCCESS)
      st = nvjpegDecodeBatched(c.handle, c.state, c.data.data(), c.lengths.data(), c.images.data(), c.stream);
    if (st != NVJPEG_STATUS_SUCCESS) {
      c.initialized_rows = -1;
      decode_one_by_one(c, rows, st);  // progressive, CMYK, ... : what the batched backend refuses
    }
  }

  void decode_one_by_one(Context& c, int rows, nvjpegStatus_t batched_status) {
    if (!c.fallback) {
      nvjpegDevAllocatorV2_t dev = mem_.device_allocator();
      nvjpegPinnedAllocatorV2_t pinned = mem_.pinned_allocator();
      // Opened while no other thread decodes (Note [Decode threads]): this decode steps out of the gate.
      end_decode();
      begin_open();
      const bool made =
          nvjpegCreateExV2(NVJPEG_BACKEND_DEFAULT, &dev, &pinned, NVJPEG_FLAGS_DEFAULT, &c.fallback) == NVJPEG_STATUS_SUCCESS &&
          nvjpegJpegStateCreate(c.fallback, &c.fallback_state) == NVJPEG_STATUS_SUCCESS;
      end_open();
      begin_decode();
      if (!made)
        throw CudaError(std::string("GPU decode: the batched decode failed (") + nvjpeg_status(batched_status) +
                        ") and no fallback decoder could start");
    }
    for (int r = 0; r < rows; ++r) {
      const auto i = static_cast<std::size_t>(r);
      const nvjpegStatus_t st =
          nvjpegDecode(c.fallback, c.fallback_state, c.data[i], c.lengths[i], NVJPEG_OUTPUT_RGBI, &c.images[i], c.stream);
      if (st != NVJPEG_STATUS_SUCCESS)
        throw DataError("GPU decode", DataError::kNoOffset,
                        "image " + std::to_string(r) + " of the batch (" + std::to_string(c.lengths[i]) +
                            " bytes) is a JPEG nvJPEG cannot decode: " + nvjpeg_status(st));
    }
  }

  int device_;
  DecodeMemory mem_;  // outlives the handles, which free into it
  std::string backend_;
  nvjpegBackend_t backend_kind_ = NVJPEG_BACKEND_DEFAULT;
  std::vector<Context> contexts_;  // sized once, before the threads start
  std::vector<Thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<DecodeJob> jobs_;     // guarded by mu_
  bool stop_ = false;              // guarded by mu_
  int running_ = 0;                // guarded by mu_: decode threads not yet ended
  std::condition_variable ended_;  // a decode thread ended
  long stall_ms_ = 0;              // FERRY_TEST_GPU_DECODE_STALL_MS (Note [A decode that never returns])
  std::atomic<int> stalls_{0};
  std::atomic<std::uint64_t> allocations_{0};
  std::atomic<std::int64_t> busy_ns_{0};
  std::atomic<int> failed_threads_{0};  // decode threads that could not open their context (and ended)
  std::mutex gate_mu_;                  // the gate between opens and decodes (begin_open, begin_decode)
  std::condition_variable gate_cv_;
  int decoding_ = 0;                // guarded by gate_mu_: decodes running
  std::uint64_t decodes_done_ = 0;  // guarded by gate_mu_
  bool opening_ = false;            // guarded by gate_mu_: a thread is opening nvJPEG handles or states
  bool gate_stop_ = false;          // guarded by gate_mu_: the decoder is stopping
};

}  // namespace

bool gpu_decode_built() noexcept { return true; }

std::size_t lay_out_decode_scratch(std::int64_t* index, int rows) {
  std::size_t total = 0;
  for (int r = 0; r < rows; ++r) {
    std::int64_t* row = index + static_cast<std::int64_t>(r) * kEncodedIndexWords;
    row[EncodedRow::kScratch] = static_cast<std::int64_t>(total);
    total += (static_cast<std::size_t>(row[EncodedRow::kHeight]) * static_cast<std::size_t>(row[EncodedRow::kWidth]) * 3 + 255) /
             256 * 256;
  }
  return total;
}

namespace {
// The decoder as DeviceStage holds it: frees it once its threads have ended, else leaves it to the
// thread still inside nvJPEG (Note [A decode that never returns]).
class Decoder final : public GpuJpegDecoder {
 public:
  explicit Decoder(std::unique_ptr<NvJpegDecoder> d) : d_(d.release()) {}
  ~Decoder() override { stop(); }
  void submit(DecodeJob job) override {
    if (!d_) throw Error("GPU decode: submit() after stop()");
    d_->submit(std::move(job));
  }
  std::string backend() const override { return d_ ? d_->backend() : std::string(); }
  double busy_ms() const override { return d_ ? d_->busy_ms() : 0; }
  std::uint64_t allocations() const override { return d_ ? d_->allocations() : 0; }
  int threads() const override { return d_ ? d_->threads() : 0; }
  bool stop() noexcept override {
    if (!d_) return clean_;
    clean_ = d_->stop_threads();
    if (clean_) delete d_;
    d_ = nullptr;  // else its stuck thread keeps it, for good
    return clean_;
  }

 private:
  NvJpegDecoder* d_;
  bool clean_ = true;
};
}  // namespace

std::unique_ptr<GpuJpegDecoder> make_gpu_jpeg_decoder(int device, int threads, bool high_priority) {
  return std::make_unique<Decoder>(std::make_unique<NvJpegDecoder>(device, threads, high_priority));
}

}  // namespace ferry::detail
