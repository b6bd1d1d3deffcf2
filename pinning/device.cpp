// The device stage: see Note [Device stage] in include/ferry/pinning/device.h.
#include "ferry/pinning/device.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "ferry/collate/collate.h"
#include "ferry/detail/engine.h"
#include "ferry/detail/pass_math.h"
#include "ferry/pinning/fence.h"
#include "gather_kernel.h"
#include "gpu_decode.h"

namespace ferry {
namespace {
// nvJPEG's hardware decode runs a kernel an image on streams of its own (14 a decoder thread on
// an H100), and CUDA maps every stream onto one of CUDA_DEVICE_MAX_CONNECTIONS hardware queues, 8
// by default: those kernels then share the consumer stream's queue and wait behind its kernels
// (Note [Decode threads]). The variable counts only when set before the process's first CUDA call.
void warn_if_few_hardware_queues() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (v && std::atoi(v) >= 32) return;
  detail::warn_once("gpu-decode-connections",
                    std::string("GPU decode: CUDA_DEVICE_MAX_CONNECTIONS is ") + (v ? v : "unset (8 hardware queues)") +
                        ". nvJPEG's kernels run on streams of their own that then share the training stream's hardware "
                        "queues and wait behind its kernels, and the GPU waits for data (bench/RESULTS.md). Set "
                        "CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before the process's first CUDA call.");
}
}  // namespace

struct DeviceStage::Impl : std::enable_shared_from_this<Impl> {
  struct Buffer {
    std::byte* ptr = nullptr;
    std::size_t size = 0;
    cuda::Event released;      // recorded on the consumer stream when the batch was dropped
    bool has_release = false;  // guarded by mu
    bool free = true;          // guarded by mu
    // Guarded by mu: the fence of the last GPU decode that writes into it, until a lease has put
    // the copy stream behind it. A batch dropped before its hand-over (an epoch left early) frees
    // its buffer while its decode may still be queued: the buffer is reused only once that decode
    // is issued, and behind it (lease).
    std::shared_ptr<const EventFence> writer;
  };
  struct Pending {
    const std::byte* src;
    std::size_t dst_off, bytes;
    Storage storage;
  };

  Impl(DeviceStageOptions o, std::shared_ptr<PinnedPool> p) : opt(o), pool(std::move(p)) {
    if (!cuda::available()) throw CudaError("DeviceStage: no usable CUDA device (" + cuda::unavailable_reason() + ")");
    if (opt.device < 0 || opt.device >= cuda::device_count())
      throw Error("DeviceStage: device " + std::to_string(opt.device) + " does not exist (" +
                  std::to_string(cuda::device_count()) + " devices)");
    if (opt.decode_threads < 0)
      throw Error("DeviceStage: decode_threads must be at least 0 (0: chosen from the hardware), got " +
                  std::to_string(opt.decode_threads));
    copy = cuda::Stream::create(opt.device, opt.high_priority);
    consumer = opt.consumer_stream ? cuda::Stream::borrow(opt.consumer_stream, opt.device) : cuda::Stream::create(opt.device);
  }
  ~Impl() {
    // Every device batch is gone (each holds a reference); the decode threads finish the decodes
    // queued (into these buffers), then wait for the streams, then free. A decode that never came
    // back may still write a buffer: then nothing is freed (Note [A decode that never returns]).
    if (decoder && !decoder->stop()) return;
    decoder.reset();
    std::optional<cuda::DeviceGuard> g;
    try {
      g.emplace(opt.device);
      copy.synchronize();
      consumer.synchronize();
    } catch (...) {
    }
    for (auto& b : buffers) cuda::device_free(b->ptr);
  }

  const DeviceStageOptions opt;
  const std::shared_ptr<PinnedPool> pool;
  cuda::Stream copy, consumer;
  std::mutex mu;
  std::vector<std::unique_ptr<Buffer>> buffers;  // guarded by mu
  DeviceStageStats counters;
  // The batch being moved (the thread that begins batches only): its buffer, which it holds from
  // cur_begin to cur_end, and the end of what it has placed so far.
  Buffer* cur = nullptr;
  std::size_t cur_begin = 0, cur_end = 0, used = 0;
  std::shared_ptr<void> cur_owner;
  // Shared batches (begin(bytes, true)): carved one after another from one buffer of up to
  // kSharedBatches of them, which the stage holds while it carves and which returns to the pool,
  // behind one release event, once the stage has moved on and its last batch is dropped. Small
  // batches then cost one buffer lease, one copy-stream wait and one release a buffer, not a batch.
  static constexpr std::size_t kSharedBatches = 8;
  Buffer* shared = nullptr;
  std::shared_ptr<void> shared_owner;
  std::size_t shared_used = 0;
  std::vector<Pending> pending;
  // Sources not from `pool` stay alive until the copy that read them completes.
  std::deque<std::pair<std::shared_ptr<EventFence>, std::vector<Storage>>> keepalive;
  // Start events and completion fences of copies whose GPU time is not yet counted.
  struct Timing {
    cuda::Event started, copied;  // copied: recorded between the copies and a GPU decode or gather (else empty)
    std::shared_ptr<EventFence> done;
    bool gather = false;  // the interval after `copied` is a gather's, not a decode's
  };
  std::deque<Timing> timings;
  std::vector<cuda::Event> spare_starts;  // timing events already counted, reused
  // Gather launches issued and maybe not finished, each one's fence (throttle_gathers): popped
  // once waited for.
  std::deque<std::shared_ptr<const EventFence>> launched;
  static constexpr std::size_t kLaunchesAhead = 4, kLaunchesLeft = 2;

  // Before a gather launch (on the pin thread): once kLaunchesAhead launches are queued on the
  // copy stream, sleeps until kLaunchesLeft are. Left alone, the pin thread runs ahead until the
  // driver's queue is full, and the driver then holds it in cudaMemcpyBatchAsync or the launch
  // spinning and yielding: a whole core busy waiting for the link. It checks the launch's fence
  // after sleeps of 50 us, each half again as long as the last, up to 1 ms: the two launches
  // still queued keep the copy stream busy past the last sleep's overshoot. Not a blocking-sync
  // event: each one recorded wakes CUDA's event thread when it completes, whoever waits (0.1 to
  // 0.2 of a core at 7,000 launches a second, bench/RESULTS.md), and waiting for two launches at
  // a time wakes the pin thread once every other launch.
  void throttle_gathers() {
    if (launched.size() < kLaunchesAhead) return;
    const EventFence& target = *launched[launched.size() - 1 - kLaunchesLeft];
    std::chrono::microseconds sleep(50);
    while (!target.ready()) {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 3 / 2, std::chrono::microseconds(1000));
    }
    launched.erase(launched.begin(), launched.end() - kLaunchesLeft);
  }
  // A gather launch's completion, for the throttle: the fence itself where one follows the launch.
  void mark_gather_launch(std::shared_ptr<const EventFence> done) { launched.push_back(std::move(done)); }
  void mark_gather_launch() {
    cuda::Event e = cuda::Event::create(opt.device, false);
    e.record(copy);
    mark_gather_launch(std::make_shared<EventFence>(std::move(e)));
  }
  std::mutex stats_mu;                             // counters and timings (end() and stats() may run on two threads)
  std::atomic<std::uint64_t> delivered_serial{0};  // the fence deliver() last had the consumer's stream wait on
  // GPU decode (decode_images): the decoder, made on first use, and the batch's decodes.
  struct PendingDecode {
    Tensor bytes, index;
    const std::int64_t* index_dev;
    std::size_t out_off;
  };
  std::unique_ptr<detail::GpuJpegDecoder> decoder;  // its threads issue the decodes (Note [Decode threads])
  std::vector<PendingDecode> decodes;
  // Device gather (gather_rows): the batch's gathers, run after its copies, one launch for the
  // fields that share an index.
  struct PendingGather {
    Tensor index;  // host (read at launch) or device
    detail::GatherField field;
  };
  std::vector<PendingGather> gathers;
  // Batches ended by end_held(): their fields and host indices, for one launch at issue_held().
  // A batch of more than kHeldBytes is never held (and a shared buffer is at most that: begin);
  // a held launch writes at most kHeldLaunchBytes (24 batches of 256 rows of 784 float32 take
  // 19.3 MB), and carries twice the indices while every row fits a 32-bit index word (held_wide
  // false).
  static constexpr std::size_t kHeldBytes = std::size_t{16} << 20, kHeldLaunchBytes = std::size_t{32} << 20;
  std::vector<detail::GatherField> held_fields;
  std::vector<std::int64_t> held_index;
  std::size_t held_batches = 0, held_bytes = 0;
  bool held_wide = false;

  Tensor gather_rows(const Tensor& index, const void* src, std::size_t row_bytes, DType dtype, const Shape& row_shape,
                     const RowTransform* t) {
    if (!cur) throw Error("DeviceStage::gather_rows: no batch begun");
    if (!detail::gather_built())
      throw CudaError(
          "DeviceStage: the device gather needs the gather kernel, and this build of ferry was made without a CUDA compiler");
    check_gather_index(index, "gather_rows");
    std::int64_t per_row = 1;
    for (std::int64_t d : row_shape) per_row *= d;
    if (static_cast<std::size_t>(per_row) * itemsize(dtype) != row_bytes)
      throw Error("DeviceStage::gather_rows: a row of " + std::to_string(row_bytes) +
                  " bytes does not hold its shape's elements");
    const std::int64_t rows = index.size(0);
    detail::GatherField field;
    field.src = src;
    field.dst = cur->ptr + used;
    field.row_bytes = row_bytes;
    Shape shape{rows};
    std::size_t out_row_bytes = row_bytes;
    if (t) {
      if (std::string why = detail::row_transform_problem(*t, dtype, row_bytes, "DeviceStage::gather_rows"); !why.empty())
        throw Error(why);
      field.out_kind = detail::pass_output_of(t->dtype);
      field.chw = t->dtype != DType::UInt8 && !t->channels_last;
      field.flip = t->flip_p > 0;
      field.height = t->height;
      field.width = t->width;
      field.channels = t->channels;
      for (int c = 0; c < RowTransform::kMaxChannels; ++c) {
        field.a[c] = t->a[c];
        field.b[c] = t->b[c];
      }
      out_row_bytes = row_bytes * itemsize(t->dtype);
      field.out_row_bytes = out_row_bytes;
      shape.insert(shape.end(), t->shape.begin(), t->shape.end());
      dtype = t->dtype;
    } else {
      shape.insert(shape.end(), row_shape.begin(), row_shape.end());
    }
    const std::size_t bytes = static_cast<std::size_t>(rows) * out_row_bytes;
    if (used + align_up(bytes) > cur_end) throw Error("DeviceStage::gather_rows: more than begin() reserved");
    Tensor out(Storage::wrap(cur->ptr, cur->size, Device::cuda(opt.device), cur_owner), dtype, shape, used);
    gathers.push_back({index, field});
    used += align_up(bytes);
    return out;
  }

  Tensor gather_windows(const Tensor& index, const void* src, DType dtype, std::int64_t elements, const RowWindow& w) {
    if (!cur) throw Error("DeviceStage::gather_windows: no batch begun");
    if (!detail::gather_built())
      throw CudaError(
          "DeviceStage: the device gather needs the gather kernel, and this build of ferry was made without a CUDA compiler");
    check_gather_index(index, "gather_windows");
    if (std::string why = detail::row_window_problem(w, dtype, itemsize(dtype), elements, "DeviceStage::gather_windows");
        !why.empty())
      throw Error(why);
    if (index.device().is_host()) {
      const std::int64_t* word = index.data<std::int64_t>();
      for (std::int64_t i = 0; i < index.size(0); ++i)
        if (word[i] < 0 || word[i] > elements - w.length - w.shift)
          throw Error("DeviceStage::gather_windows: window " + std::to_string(i) + " starts at element " +
                      std::to_string(word[i]) + ", past the last that fits an array of " + std::to_string(elements));
    }
    const std::int64_t n = index.size(0);
    detail::GatherField field;
    field.src = src;
    field.dst = cur->ptr + used;
    field.row_bytes = itemsize(dtype);
    field.rows = n;
    field.window = w.length;
    field.shift = w.shift;
    field.out_elem_bytes = static_cast<int>(itemsize(w.dtype));
    field.src_signed = !w.is_unsigned;
    const std::size_t bytes = static_cast<std::size_t>(n * w.length) * itemsize(w.dtype);
    if (used + align_up(bytes) > cur_end) throw Error("DeviceStage::gather_windows: more than begin() reserved");
    Tensor out(Storage::wrap(cur->ptr, cur->size, Device::cuda(opt.device), cur_owner), w.dtype, Shape{n, w.length}, used);
    gathers.push_back({index, field});
    used += align_up(bytes);
    return out;
  }

  void check_gather_index(const Tensor& index, const char* what) const {
    if (!index.defined() || index.dtype() != DType::Int64 || index.dim() != 1 ||
        (!index.device().is_host() && index.device() != Device::cuda(opt.device)))
      throw Error(std::string("DeviceStage::") + what +
                  ": expected an int64 [B] index on the host or on cuda:" + std::to_string(opt.device) + ", got " + index.str());
    if (index.device().is_host() && index.size(0) > DeviceStage::gather_index_in_launch)
      throw Error(std::string("DeviceStage::") + what + ": a host index of " + std::to_string(index.size(0)) +
                  " rows is more than a launch carries (" + std::to_string(DeviceStage::gather_index_in_launch) +
                  "); move it to the device first");
  }

  Tensor decode_images(const Tensor& bytes, const Tensor& index, const Tensor& index_dev) {
    if (!cur) throw Error("DeviceStage::decode_images: no batch begun");
    if (!detail::gpu_decode_built())
      throw CudaError(
          "DeviceStage: GPU decode needs nvJPEG, and this build of ferry was made without it (CMake did not find "
          "nvjpeg.h and libnvjpeg: scripts/install-deps.sh installs them where the CUDA Toolkit lacks them)");
    if (!bytes.defined() || bytes.dtype() != DType::UInt8 || !bytes.is_pinned() || !index.defined() ||
        index.dtype() != DType::Int64 || index.dim() != 2 || index.size(1) != detail::kEncodedIndexWords || !index.is_pinned() ||
        !index_dev.defined() || index_dev.device().kind != MemoryKind::Device)
      throw Error("DeviceStage::decode_images: expected pinned uint8 bytes, a pinned int64 [B, " +
                  std::to_string(detail::kEncodedIndexWords) + "] index and its device copy; got " + bytes.str() + ", " +
                  index.str() + ", " + index_dev.str());
    if (!decoder) {
      warn_if_few_hardware_queues();
      auto made = detail::make_gpu_jpeg_decoder(opt.device, opt.decode_threads, opt.high_priority);
      std::lock_guard l(stats_mu);  // stats() and decode_backend() read it on the consumer's thread
      decoder = std::move(made);
    }
    const std::size_t bytes_out = DeviceStage::decoded_bytes(index);
    if (used + align_up(bytes_out) > cur_end) throw Error("DeviceStage::decode_images: more than begin() reserved");
    const std::int64_t* row = index.data<std::int64_t>();
    const std::int64_t rows = index.size(0), OH = row[detail::EncodedRow::kOutHeight], OW = row[detail::EncodedRow::kOutWidth],
                       C = row[detail::EncodedRow::kChannels];
    const std::int64_t kind = row[detail::EncodedRow::kOutput];
    const DType dtype = kind == detail::kPassFloat32    ? DType::Float32
                        : kind == detail::kPassFloat16  ? DType::Float16
                        : kind == detail::kPassBFloat16 ? DType::BFloat16
                                                        : DType::UInt8;
    const bool chw = kind != detail::kPassUInt8 && row[detail::EncodedRow::kChannelsLast] == 0;
    const Shape shape = chw ? Shape{rows, C, OH, OW} : Shape{rows, OH, OW, C};
    Tensor out(Storage::wrap(cur->ptr, cur->size, Device::cuda(opt.device), cur_owner), dtype, shape, used);
    decodes.push_back({bytes, index, index_dev.data<std::int64_t>(), used});
    used += align_up(bytes_out);
    return out;
  }

  // A free buffer of `want` bytes or up to twice as many, else a new one; the copy stream waits
  // (on the device) for its last release before anything is written into it.
  Buffer* lease(std::size_t want) {
    Buffer* best = nullptr;
    {
      std::lock_guard l(mu);
      for (auto& b : buffers)
        if (b->free && b->size >= want && b->size <= 2 * want && (!best || b->size < best->size) &&
            (!b->writer || b->writer->wait_recorded(std::chrono::microseconds(0))))
          best = b.get();
      if (best) best->free = false;
    }
    if (!best) {
      cuda::DeviceGuard g(opt.device);
      auto b = std::make_unique<Buffer>();
      b->ptr = static_cast<std::byte*>(cuda::device_alloc(want));
      b->size = want;
      b->released = cuda::Event::create(opt.device);
      b->free = false;
      best = b.get();
      std::lock_guard l(mu);
      buffers.push_back(std::move(b));
      ++counters.device_allocations;
    }
    {
      std::lock_guard l(mu);
      if (best->has_release) {
        cuda::DeviceGuard g(opt.device);
        copy.wait(best->released);  // reuse only behind the consumer's release
      }
      if (best->writer) {
        cuda::DeviceGuard g(opt.device);
        copy.wait(best->writer->event());  // and behind the last decode into it (issued: see above)
        best->writer.reset();
      }
    }
    return best;
  }
  // The reference that returns `b` to the pool when its last batch is dropped.
  std::shared_ptr<void> owner_of(Buffer* b) {
    std::shared_ptr<Impl> self = shared_from_this();
    return std::shared_ptr<void>(b, [self](void* p) { self->release(static_cast<Buffer*>(p)); });
  }

  void begin(std::size_t bytes, bool share) {
    if (cur) throw Error("DeviceStage::begin: the previous batch was not ended");
    const std::size_t want = std::max<std::size_t>(bytes, 1);
    if (share && align_up(want) <= kHeldBytes / 2) {
      const std::size_t need = align_up(want);
      if (!shared_owner || shared_used + need > shared->size) {
        close_shared();
        shared = lease(std::min(kSharedBatches * need, kHeldBytes));
        shared_owner = owner_of(shared);
        shared_used = 0;
      }
      cur = shared;
      cur_owner = shared_owner;
      used = cur_begin = shared_used;
      cur_end = shared_used + bytes;
      shared_used += need;
      return;
    }
    cur = lease(want);
    cur_owner = owner_of(cur);
    used = cur_begin = 0;
    cur_end = bytes;
  }
  // The stage lets go of the shared buffer it was carving (it returns once its batches are gone).
  void close_shared() noexcept {
    shared_owner.reset();
    shared = nullptr;
    shared_used = 0;
  }

  void release(Buffer* b) noexcept {
    std::lock_guard l(mu);
    try {
      cuda::DeviceGuard g(opt.device);  // the batch may be dropped on any thread, current on any device
      b->released.record(consumer);
      b->has_release = true;
    } catch (const std::exception& e) {
      detail::warn_once("device-release",
                        std::string("DeviceStage: recording a release event failed: ") + e.what() + "; synchronizing instead");
      try {
        consumer.synchronize();
      } catch (...) {
      }
      b->has_release = false;
    }
    b->free = true;
  }

  Tensor move(const Tensor& host) {
    if (!cur) throw Error("DeviceStage::move: no batch begun");
    if (!host.defined()) return host;
    if (host.device().kind == MemoryKind::Device) {
      if (host.device().index == opt.device) return host;
      throw Error("DeviceStage: " + host.str() + " is on another device than cuda:" + std::to_string(opt.device));
    }
    const std::size_t bytes = align_up(host.nbytes());
    if (used + bytes > cur_end)
      throw Error("DeviceStage: the batch moved more bytes than begin() reserved; a custom pin_memory must only call ctx.pin()");
    if (!host.is_pinned())
      detail::warn_once("device-pageable",
                        "DeviceStage: copying from pageable host memory (slower, and the copy "
                        "cannot overlap); enable pin_memory");
    pending.push_back({static_cast<const std::byte*>(host.raw()), used, host.nbytes(), host.storage()});
    Tensor out(Storage::wrap(cur->ptr, cur->size, Device::cuda(opt.device), cur_owner), host.dtype(), host.shape(), used);
    used += bytes;
    return out;
  }

  // After an issue: the timings are counted in runs, once kTimingsHeld wait, so the check that
  // finds the oldest unfinished (a cudaEventQuery, about 1.5 us on an H100 host) comes once a run
  // rather than once a launch; stats() counts them all.
  static constexpr std::size_t kTimingsHeld = 16;
  void poll_timings_held() {
    if (timings.size() >= kTimingsHeld) poll_timings();
  }
  // Adds the GPU time of completed copies to the counters (consumer thread).
  void poll_timings() {
    while (!timings.empty() && timings.front().done->ready()) {
      Timing& t = timings.front();
      if (t.copied.native()) {
        counters.copy_ms += cuda::Event::elapsed_ms(t.started, t.copied);
        if (t.gather) counters.gather_ms += cuda::Event::elapsed_ms(t.copied, t.done->event());  // a decode's: decoder->busy_ms()
        spare_starts.push_back(std::move(t.copied));
      } else if (t.gather) {  // a held launch: no copies before the gather
        counters.gather_ms += cuda::Event::elapsed_ms(t.started, t.done->event());
      } else {
        counters.copy_ms += cuda::Event::elapsed_ms(t.started, t.done->event());
      }
      spare_starts.push_back(std::move(t.started));  // reused: no cudaEventCreate per batch
      timings.pop_front();
    }
  }

  // A timing event: one already counted, else a new one (stats_mu held).
  cuda::Event timing_event() {
    if (spare_starts.empty()) return cuda::Event::create(opt.device, true);
    cuda::Event e = std::move(spare_starts.back());
    spare_starts.pop_back();
    return e;
  }

  bool end_held() {
    if (!cur) throw Error("DeviceStage::end_held: no batch begun");
    if (!pending.empty() || !decodes.empty() || gathers.empty() || used - cur_begin > kHeldBytes ||
        gathers.size() > static_cast<std::size_t>(detail::kMaxGatherFields))
      return false;
    std::size_t rows = 0;
    bool wide = held_wide;
    for (std::size_t i = 0; i < gathers.size(); ++i) {
      const Tensor& index = gathers[i].index;
      if (!index.device().is_host()) return false;
      if (i == 0 || index.raw() != gathers[i - 1].index.raw()) {
        const std::int64_t n = index.size(0);
        rows += static_cast<std::size_t>(n);
        wide = wide || !detail::narrow_rows(index.data<std::int64_t>(), n);
      }
    }
    if (rows > static_cast<std::size_t>(detail::kGatherIndexInLaunch)) return false;
    const auto room = static_cast<std::size_t>(wide ? detail::kGatherIndexInLaunch : detail::kGatherNarrowIndexInLaunch);
    if (held_index.size() + rows > room ||
        held_fields.size() + gathers.size() > static_cast<std::size_t>(detail::kMaxGatherFields) ||
        held_bytes + (used - cur_begin) > kHeldLaunchBytes)
      return false;
    held_wide = wide;
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < gathers.size(); ++i) {
      const Tensor& index = gathers[i].index;
      if (i == 0 || index.raw() != gathers[i - 1].index.raw()) {
        offset = static_cast<std::int64_t>(held_index.size());
        const std::int64_t* d = index.data<std::int64_t>();
        held_index.insert(held_index.end(), d, d + index.size(0));
      }
      detail::GatherField f = gathers[i].field;
      f.rows = index.size(0);
      f.index_dev = nullptr;
      f.index_offset = offset;
      held_fields.push_back(f);
    }
    held_bytes += used - cur_begin;
    ++held_batches;
    gathers.clear();
    cur_owner.reset();
    cur = nullptr;
    return true;
  }

  std::vector<std::shared_ptr<const EventFence>> issue_held() {
    std::vector<std::shared_ptr<const EventFence>> out;
    if (held_batches == 0) return out;
    const std::size_t n = held_batches;
    // Emptied however the launch goes (a failed one drops its batches); the vectors keep their
    // capacity for the next launch.
    struct Clear {
      Impl& s;
      ~Clear() {
        s.held_fields.clear();
        s.held_index.clear();
        s.held_batches = s.held_bytes = 0;
        s.held_wide = false;
      }
    } clear{*this};
    const std::vector<detail::GatherField>& fields = held_fields;
    const std::vector<std::int64_t>& index = held_index;
    cuda::DeviceGuard device_guard(opt.device);
    throttle_gathers();
    std::lock_guard stats_lock(stats_mu);
    cuda::Event started = timing_event();
    started.record(copy);  // no copies: the interval after it is the gather's
    detail::launch_gather(index.data(), static_cast<std::int64_t>(index.size()), fields.data(), static_cast<int>(fields.size()),
                          copy.native());
    for (const detail::GatherField& f : fields) counters.rows_gathered += static_cast<std::uint64_t>(f.rows);
    ++counters.gather_launches;
    // One event after the launch covers every batch it wrote: the batches share its fence, and
    // the consumer's stream waits on it once (deliver). It also times the launch and is what the
    // throttle checks.
    cuda::Event done = cuda::Event::create(opt.device, true);
    done.record(copy);
    auto fence = std::make_shared<EventFence>(std::move(done));
    mark_gather_launch(fence);
    out.assign(n, fence);
    timings.push_back({std::move(started), cuda::Event(), fence, true});
    poll_timings_held();
    counters.batches += n;
    return out;
  }

  std::shared_ptr<const EventFence> end() {
    if (!cur) throw Error("DeviceStage::end: no batch begun");
    cuda::DeviceGuard device_guard(opt.device);  // copies, events and kernels go to this device's streams
    if (!gathers.empty()) throttle_gathers();
    std::lock_guard stats_lock(stats_mu);  // counters and timings: stats() reads them on another thread
    std::exception_ptr decode_error;
    // Each image's place in the decode scratch goes into the host index before it is copied.
    for (PendingDecode& d : decodes)
      detail::lay_out_decode_scratch(d.index.data<std::int64_t>(), static_cast<int>(d.index.size(0)));
    cuda::Event started = timing_event(), copied;
    started.record(copy);  // after any wait begin() queued: the interval is the copies alone
    std::size_t i = 0;
    while (i < pending.size()) {
      std::size_t j = i + 1;
      if (opt.pack)
        // Adjacent in the same storage only: two pinned blocks can be adjacent in memory, but one
        // cudaMemcpyAsync may not span two cudaHostAlloc allocations (cudaErrorInvalidValue).
        while (j < pending.size() && pending[j].storage.owner() == pending[j - 1].storage.owner() &&
               pending[j].src == pending[j - 1].src + align_up(pending[j - 1].bytes) &&
               pending[j].dst_off == pending[j - 1].dst_off + align_up(pending[j - 1].bytes))
          ++j;
      const std::size_t span = static_cast<std::size_t>(pending[j - 1].src + pending[j - 1].bytes - pending[i].src);
      if (span) cuda::memcpy_async(cur->ptr + pending[i].dst_off, pending[i].src, span, cuda::CopyKind::HostToDevice, copy);
      ++counters.copies;
      counters.bytes += span;
      i = j;
    }
    if (!decodes.empty() || !gathers.empty()) {  // a decode's or gather's GPU time is counted apart from the copies'
      copied = timing_event();
      copied.record(copy);
    }
    const bool gathered = !gathers.empty();
    for (std::size_t i = 0; i < gathers.size() && !decode_error;) {
      std::size_t j = i;
      std::vector<detail::GatherField> fields;
      while (j < gathers.size() && gathers[j].index.raw() == gathers[i].index.raw() && fields.size() < detail::kMaxGatherFields)
        fields.push_back(gathers[j++].field);
      const Tensor& index = gathers[i].index;
      const bool on_host = index.device().is_host();
      for (detail::GatherField& f : fields) {
        f.rows = index.size(0);
        f.index_dev = on_host ? nullptr : index.data<std::int64_t>();
        f.index_offset = 0;
      }
      try {
        detail::launch_gather(on_host ? index.data<std::int64_t>() : nullptr, on_host ? index.size(0) : 0, fields.data(),
                              static_cast<int>(fields.size()), copy.native());
        counters.rows_gathered += static_cast<std::uint64_t>(index.size(0)) * fields.size();
        ++counters.gather_launches;
      } catch (...) {
        decode_error = std::current_exception();
      }
      i = j;
    }
    // The throttle's mark: the batch's fence where it follows the gather (no decode after it).
    const bool mark = gathered && !decode_error;
    if (mark && !decodes.empty()) mark_gather_launch();
    gathers.clear();
    cuda::Event done = cuda::Event::create(opt.device, true);
    std::shared_ptr<EventFence> fence;
    if (!decodes.empty() && !decode_error) {
      // A decode thread issues the batch's decodes and records `done` after them (Note [Decode
      // threads]); their kernels wait on the device for what was queued on the copy stream so far.
      detail::DecodeJob job;
      try {
        job.inputs = cuda::Event::create(opt.device);
        job.inputs.record(copy);
        for (PendingDecode& d : decodes) {
          job.work.push_back({std::make_shared<const std::pair<Tensor, Tensor>>(d.bytes, d.index),
                              static_cast<const std::byte*>(d.bytes.raw()), d.index.data<std::int64_t>(),
                              static_cast<int>(d.index.size(0)), d.index_dev, cur->ptr + d.out_off});
          counters.images_decoded += static_cast<std::uint64_t>(d.index.size(0));
          pending.push_back({nullptr, 0, 0, d.bytes.storage()});  // fenced below: nvJPEG reads the block in place
        }
        job.done = done.native();
        fence = EventFence::deferred(std::move(done));
        job.fence = fence;
        {
          std::lock_guard l(mu);
          cur->writer = fence;
        }
        decoder->submit(std::move(job));
      } catch (...) {
        decode_error = std::current_exception();
        if (fence) {  // not queued: its event stays unrecorded (complete at once), so the copies must be done
          try {
            copy.synchronize();
          } catch (...) {
          }
          fence->recorded(decode_error);
        }
      }
    }
    decodes.clear();
    if (decoder) counters.decode_allocations = decoder->allocations();
    if (!fence) {
      done.record(copy);
      fence = std::make_shared<EventFence>(std::move(done));
      if (mark) mark_gather_launch(fence);
    }
    timings.push_back({std::move(started), std::move(copied), fence, gathered});
    poll_timings_held();
    std::vector<Storage> keep;
    std::set<const void*> seen;
    for (auto& p : pending) {
      if (!seen.insert(p.storage.owner().get()).second) continue;
      if (pool && p.storage.device().kind == MemoryKind::PinnedHost && pool->owns(p.storage))
        pool->add_fence(p.storage, fence);
      else
        keep.push_back(p.storage);
    }
    if (!keep.empty()) keepalive.emplace_back(fence, std::move(keep));
    while (!keepalive.empty() && keepalive.front().first->ready()) keepalive.pop_front();
    ++counters.batches;
    pending.clear();
    cur_owner.reset();
    cur = nullptr;
    if (decode_error) std::rethrow_exception(decode_error);  // after the fence: the pinned block stays safe
    return fence;
  }
};

DeviceStage::DeviceStage(DeviceStageOptions options, std::shared_ptr<PinnedPool> pool)
    : impl_(std::make_shared<Impl>(options, std::move(pool))) {}
void DeviceStage::abort() noexcept {
  impl_->pending.clear();
  impl_->decodes.clear();
  impl_->gathers.clear();
  impl_->cur_owner.reset();  // the buffer returns (behind a release event: nothing was issued into it)
  impl_->cur = nullptr;
}

DeviceStage::~DeviceStage() {
  abort();
  impl_->close_shared();  // the stage's hold on the shared buffer (it refers to the stage's state)
  // The decodes queued are issued first (their fences recorded, or given an error where a decode
  // never came back: Note [A decode that never returns]), so no wait below is on one never recorded.
  if (impl_->decoder) impl_->decoder->stop();
  // Sources kept alive for in-flight copies: wait for those copies before dropping them.
  for (auto& [fence, storages] : impl_->keepalive) {
    try {
      fence->wait();
    } catch (...) {
    }
  }
}
Tensor DeviceStage::decode_images(const Tensor& bytes, const Tensor& index, const Tensor& index_on_device) {
  return impl_->decode_images(bytes, index, index_on_device);
}

std::size_t DeviceStage::decoded_bytes(const Tensor& index) {
  if (!index.defined() || index.dim() != 2 || index.size(1) != detail::kEncodedIndexWords || index.size(0) == 0) return 0;
  const std::int64_t* row = index.data<std::int64_t>();
  const std::int64_t element = row[detail::EncodedRow::kOutput] == detail::kPassFloat32 ? 4
                               : row[detail::EncodedRow::kOutput] == detail::kPassUInt8 ? 1
                                                                                        : 2;
  return static_cast<std::size_t>(index.size(0) * row[detail::EncodedRow::kOutHeight] * row[detail::EncodedRow::kOutWidth] *
                                  row[detail::EncodedRow::kChannels] * element);
}

bool DeviceStage::can_decode_images() noexcept { return detail::gpu_decode_built(); }

Tensor DeviceStage::gather_rows(const Tensor& index, const void* device_rows, std::size_t row_bytes, DType dtype,
                                const Shape& row_shape, const RowTransform* transform) {
  static_assert(gather_index_in_launch == detail::kGatherIndexInLaunch);
  static_assert(gather_flip_bit == detail::kGatherFlipBit && gather_flip_bit == detail::kRowFlipBit);
  static_assert(RowTransform::kMaxChannels == 4);  // GatherField's a and b
  return impl_->gather_rows(index, device_rows, row_bytes, dtype, row_shape, transform);
}

Tensor DeviceStage::gather_windows(const Tensor& index, const void* device_elements, DType dtype, std::int64_t elements,
                                   const RowWindow& window) {
  return impl_->gather_windows(index, device_elements, dtype, elements, window);
}

bool DeviceStage::can_gather() noexcept { return detail::gather_built(); }

std::string DeviceStage::decode_backend() const {
  std::lock_guard l(impl_->stats_mu);
  return impl_->decoder ? impl_->decoder->backend() : std::string();
}

const cuda::Stream& DeviceStage::copy_stream() const noexcept { return impl_->copy; }
const cuda::Stream& DeviceStage::consumer_stream() const noexcept { return impl_->consumer; }
int DeviceStage::device() const noexcept { return impl_->opt.device; }
DeviceStageStats DeviceStage::stats() const {
  std::lock_guard stats_lock(impl_->stats_mu);
  impl_->poll_timings();
  std::lock_guard lock(impl_->mu);  // device_allocations is counted under mu
  DeviceStageStats s = impl_->counters;
  if (impl_->decoder) s.decode_ms = impl_->decoder->busy_ms();
  s.decode_threads = impl_->decoder ? impl_->decoder->threads() : impl_->opt.decode_threads;
  return s;
}
void DeviceStage::begin(std::size_t bytes, bool shared) { impl_->begin(bytes, shared); }
Tensor DeviceStage::move(const Tensor& host) { return impl_->move(host); }
std::shared_ptr<const EventFence> DeviceStage::end() { return impl_->end(); }
bool DeviceStage::end_held() { return impl_->end_held(); }
std::vector<std::shared_ptr<const EventFence>> DeviceStage::issue_held() { return impl_->issue_held(); }
void DeviceStage::deliver(const EventFence& copied) {
  // Batches issued in one launch share a fence (issue_held): once the consumer's stream waits on
  // it, all that stream runs later is ordered after it, so the next ones need no wait.
  if (copied.serial() == impl_->delivered_serial.load(std::memory_order_relaxed)) return;
  cuda::DeviceGuard g(impl_->opt.device);
  impl_->consumer.wait(copied.event());  // a GPU decode's fence: waits for its thread to issue the decode first
  if (std::exception_ptr error = copied.error()) std::rethrow_exception(error);
  impl_->delivered_serial.store(copied.serial(), std::memory_order_relaxed);
}

Tensor DeviceStage::to_device(const Tensor& host) {
  begin(align_up(host.nbytes()), false);
  Tensor t;
  try {
    t = move(host);
  } catch (...) {
    abort();
    throw;
  }
  deliver(*end());
  return t;
}

HostCopy to_host(const Tensor& device_tensor, const cuda::Stream& stream) {
  if (device_tensor.device().kind != MemoryKind::Device) throw Error("to_host: " + device_tensor.str() + " is not on a device");
  cuda::DeviceGuard g(device_tensor.device().index);
  const std::size_t n = device_tensor.nbytes();
  void* p = cuda::host_alloc(std::max<std::size_t>(n, 1));
  Tensor host(Storage::wrap(p, n, Device::pinned(), std::shared_ptr<void>(p, [](void* q) { cuda::host_free(q); })),
              device_tensor.dtype(), device_tensor.shape());
  cuda::memcpy_async(p, device_tensor.raw(), n, cuda::CopyKind::DeviceToHost, stream);
  cuda::Event done = cuda::Event::create(device_tensor.device().index);
  done.record(stream);
  return HostCopy(std::move(host), std::move(done));
}

}  // namespace ferry
