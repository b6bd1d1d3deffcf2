// The device stage: see Note [Device stage] in include/ferry/pinning/device.h.
#include "ferry/pinning/device.h"

#include <atomic>
#include <deque>
#include <mutex>
#include <set>

#include "device_buffers.h"
#include "device_decode.h"
#include "device_gather.h"
#include "ferry/collate/collate.h"
#include "ferry/detail/engine.h"
#include "ferry/detail/pass_math.h"
#include "ferry/pinning/fence.h"
#include "gather_kernel.h"

namespace ferry {

// The stage: its streams, the batch's copies and their timing, and the three parts a batch may
// use, each its own owner: where the batch goes (detail::DeviceBuffers), GPU decode
// (detail::DecodeStage) and the device gather (detail::GatherStage). end() issues a batch's
// copies, then its gathers, then hands its decodes to a decode thread.
struct DeviceStage::Impl : std::enable_shared_from_this<Impl> {
  struct Pending {
    const std::byte* src;
    std::byte* dst;
    std::size_t bytes;
    Storage storage;
  };

  Impl(DeviceStageOptions o, std::shared_ptr<PinnedPool> p)
      : opt(check(o)),
        pool(std::move(p)),
        copy(cuda::Stream::create(opt.device, opt.high_priority)),
        consumer(opt.consumer_stream ? cuda::Stream::borrow(opt.consumer_stream, opt.device) : cuda::Stream::create(opt.device)),
        buffers(opt.device, copy, consumer),
        decode(opt.device, opt.decode_threads, opt.high_priority),
        gather(opt.device) {}
  static DeviceStageOptions check(const DeviceStageOptions& o) {
    if (!cuda::available()) throw CudaError("DeviceStage: no usable CUDA device (" + cuda::unavailable_reason() + ")");
    if (o.device < 0 || o.device >= cuda::device_count())
      throw Error("DeviceStage: device " + std::to_string(o.device) + " does not exist (" + std::to_string(cuda::device_count()) +
                  " devices)");
    if (o.decode_threads < 0)
      throw Error("DeviceStage: decode_threads must be at least 0 (0: chosen from the hardware), got " +
                  std::to_string(o.decode_threads));
    return o;
  }
  ~Impl() {
    // Every device batch is gone (each holds a reference); the decode threads finish the decodes
    // queued (into these buffers), then wait for the streams, then the buffers are freed. A decode
    // that never came back may still write a buffer: then nothing is freed (Note [A decode that
    // never returns]).
    if (!decode.stop()) {
      buffers.leak();
      return;
    }
    decode.reset();
    try {
      cuda::DeviceGuard g(opt.device);
      copy.synchronize();
      consumer.synchronize();
    } catch (...) {
    }
  }

  const DeviceStageOptions opt;
  const std::shared_ptr<PinnedPool> pool;
  cuda::Stream copy, consumer;    // declared before the parts: destroyed after them
  detail::DeviceBuffers buffers;  // freed after the streams are synchronized (~Impl)
  detail::DecodeStage decode;
  detail::GatherStage gather;
  DeviceStageStats counters;
  std::vector<Pending> pending;  // the batch's copies
  // Sources not from `pool` stay alive until the copy that read them completes.
  std::deque<std::pair<std::shared_ptr<EventFence>, std::vector<Storage>>> keepalive;
  // Start events and completion fences of copies whose GPU time is not yet counted.
  struct Timing {
    cuda::Event started, copied;  // copied: recorded between the copies and a GPU decode or gather (else empty)
    std::shared_ptr<EventFence> done;
    bool gather = false;  // the interval after `copied` is a gather's, not a decode's
  };
  std::deque<Timing> timings;
  std::vector<cuda::Event> spare_starts;           // timing events already counted, reused
  std::mutex stats_mu;                             // counters and timings (end() and stats() may run on two threads)
  std::atomic<std::uint64_t> delivered_serial{0};  // the fence deliver() last had the consumer's stream wait on

  void begin(std::size_t bytes, bool share) { buffers.begin(bytes, share, shared_from_this()); }

  Tensor move(const Tensor& host) {
    if (!buffers.begun()) throw Error("DeviceStage::move: no batch begun");
    if (!host.defined()) return host;
    if (host.device().kind == MemoryKind::Device) {
      if (host.device().index == opt.device) return host;
      throw Error("DeviceStage: " + host.str() + " is on another device than cuda:" + std::to_string(opt.device));
    }
    if (align_up(host.nbytes()) > buffers.left())
      throw Error("DeviceStage: the batch moved more bytes than begin() reserved; a custom pin_memory must only call ctx.pin()");
    if (!host.is_pinned())
      detail::warn_once("device-pageable",
                        "DeviceStage: copying from pageable host memory (slower, and the copy "
                        "cannot overlap); enable pin_memory");
    Tensor out = buffers.place(host.nbytes(), host.dtype(), host.shape(), "move");
    pending.push_back(
        {static_cast<const std::byte*>(host.raw()), static_cast<std::byte*>(out.raw()), host.nbytes(), host.storage()});
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
        if (t.gather) counters.gather_ms += cuda::Event::elapsed_ms(t.copied, t.done->event());  // a decode's: busy_ms()
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
    if (!buffers.begun()) throw Error("DeviceStage::end_held: no batch begun");
    if (!pending.empty() || decode.pending() || !gather.hold(buffers.placed())) return false;
    buffers.finish();
    return true;
  }

  std::vector<std::shared_ptr<const EventFence>> issue_held() {
    std::vector<std::shared_ptr<const EventFence>> out;
    if (gather.held() == 0) return out;
    cuda::DeviceGuard device_guard(opt.device);
    gather.throttle();
    std::lock_guard stats_lock(stats_mu);
    cuda::Event started = timing_event();
    started.record(copy);  // no copies: the interval after it is the gather's
    const std::size_t n = gather.launch_held(copy, counters);
    // One event after the launch covers every batch it wrote: the batches share its fence, and
    // the consumer's stream waits on it once (deliver). It also times the launch and is what the
    // throttle checks.
    cuda::Event done = cuda::Event::create(opt.device, true);
    done.record(copy);
    auto fence = std::make_shared<EventFence>(std::move(done));
    gather.mark_launch(fence);
    out.assign(n, fence);
    timings.push_back({std::move(started), cuda::Event(), fence, true});
    poll_timings_held();
    counters.batches += n;
    return out;
  }

  // The batch's copies on the copy stream (with `pack`, tensors adjacent in one storage as one).
  void issue_copies() {
    std::size_t i = 0;
    while (i < pending.size()) {
      std::size_t j = i + 1;
      if (opt.pack)
        // Adjacent in the same storage only: two pinned blocks can be adjacent in memory, but one
        // cudaMemcpyAsync may not span two cudaHostAlloc allocations (cudaErrorInvalidValue).
        while (j < pending.size() && pending[j].storage.owner() == pending[j - 1].storage.owner() &&
               pending[j].src == pending[j - 1].src + align_up(pending[j - 1].bytes) &&
               pending[j].dst == pending[j - 1].dst + align_up(pending[j - 1].bytes))
          ++j;
      const std::size_t span = static_cast<std::size_t>(pending[j - 1].src + pending[j - 1].bytes - pending[i].src);
      if (span) cuda::memcpy_async(pending[i].dst, pending[i].src, span, cuda::CopyKind::HostToDevice, copy);
      ++counters.copies;
      counters.bytes += span;
      i = j;
    }
  }

  // Every storage the batch read is covered by `fence`: the pool's blocks by the pool, others
  // kept alive here until it completes.
  void fence_sources(const std::shared_ptr<EventFence>& fence, std::vector<Storage> read) {
    for (Pending& p : pending) read.push_back(std::move(p.storage));
    pending.clear();
    std::vector<Storage> keep;
    std::set<const void*> seen;
    for (Storage& s : read) {
      if (!seen.insert(s.owner().get()).second) continue;
      if (pool && s.device().kind == MemoryKind::PinnedHost && pool->owns(s))
        pool->add_fence(s, fence);
      else
        keep.push_back(std::move(s));
    }
    if (!keep.empty()) keepalive.emplace_back(fence, std::move(keep));
    while (!keepalive.empty() && keepalive.front().first->ready()) keepalive.pop_front();
  }

  std::shared_ptr<const EventFence> end() {
    if (!buffers.begun()) throw Error("DeviceStage::end: no batch begun");
    cuda::DeviceGuard device_guard(opt.device);  // copies, events and kernels go to this device's streams
    if (gather.pending()) gather.throttle();
    std::lock_guard stats_lock(stats_mu);  // counters and timings: stats() reads them on another thread
    std::exception_ptr error;
    decode.lay_out();  // before the indexes are copied
    cuda::Event started = timing_event(), copied;
    started.record(copy);  // after any wait begin() queued: the interval is the copies alone
    issue_copies();
    const bool gathered = gather.pending();
    if (decode.pending() || gathered) {  // a decode's or gather's GPU time is counted apart from the copies'
      copied = timing_event();
      copied.record(copy);
    }
    try {
      gather.launch(copy, counters);
    } catch (...) {
      error = std::current_exception();
    }
    // The throttle's mark: the batch's fence where it follows the gather (no decode after it).
    const bool mark = gathered && !error;
    if (mark && decode.pending()) gather.mark_launch(copy);
    cuda::Event done = cuda::Event::create(opt.device, true);
    std::shared_ptr<EventFence> fence;
    std::vector<Storage> read;
    if (decode.pending() && !error) {
      detail::DecodeStage::Submitted s = decode.submit(copy, done, buffers, counters);
      fence = std::move(s.fence);
      error = s.error;
      read = std::move(s.read);
    }
    decode.clear();
    counters.decode_allocations = decode.allocations();
    if (!fence) {
      done.record(copy);
      fence = std::make_shared<EventFence>(std::move(done));
      if (mark) gather.mark_launch(fence);
    }
    timings.push_back({std::move(started), std::move(copied), fence, gathered});
    poll_timings_held();
    fence_sources(fence, std::move(read));
    ++counters.batches;
    buffers.finish();
    if (error) std::rethrow_exception(error);  // after the fence: the pinned block stays safe
    return fence;
  }
};

DeviceStage::DeviceStage(DeviceStageOptions options, std::shared_ptr<PinnedPool> pool)
    : impl_(std::make_shared<Impl>(options, std::move(pool))) {}
void DeviceStage::abort() noexcept {
  impl_->pending.clear();
  impl_->decode.clear();
  impl_->gather.clear();
  impl_->buffers.finish();  // the buffer returns (behind a release event: nothing was issued into it)
}

DeviceStage::~DeviceStage() {
  abort();
  impl_->buffers.close_shared();  // the stage's hold on the shared buffer (it refers to the stage's state)
  // The decodes queued are issued first (their fences recorded, or given an error where a decode
  // never came back: Note [A decode that never returns]), so no wait below is on one never recorded.
  impl_->decode.stop();
  // Sources kept alive for in-flight copies: wait for those copies before dropping them.
  for (auto& [fence, storages] : impl_->keepalive) {
    try {
      fence->wait();
    } catch (...) {
    }
  }
}
Tensor DeviceStage::decode_images(const Tensor& bytes, const Tensor& index, const Tensor& index_on_device) {
  return impl_->decode.add(impl_->buffers, bytes, index, index_on_device);
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
  return impl_->gather.rows(impl_->buffers, index, device_rows, row_bytes, dtype, row_shape, transform);
}

Tensor DeviceStage::gather_windows(const Tensor& index, const void* device_elements, DType dtype, std::int64_t elements,
                                   const RowWindow& window) {
  return impl_->gather.windows(impl_->buffers, index, device_elements, dtype, elements, window);
}

bool DeviceStage::can_gather() noexcept { return detail::gather_built(); }

std::string DeviceStage::decode_backend() const { return impl_->decode.backend(); }

const cuda::Stream& DeviceStage::copy_stream() const noexcept { return impl_->copy; }
const cuda::Stream& DeviceStage::consumer_stream() const noexcept { return impl_->consumer; }
int DeviceStage::device() const noexcept { return impl_->opt.device; }
DeviceStageStats DeviceStage::stats() const {
  std::lock_guard stats_lock(impl_->stats_mu);
  impl_->poll_timings();
  DeviceStageStats s = impl_->counters;
  s.device_allocations = impl_->buffers.allocations();
  s.decode_ms = impl_->decode.busy_ms();
  s.decode_threads = impl_->decode.threads();
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
