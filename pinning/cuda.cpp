// CUDA runtime wrappers. Without the toolkit (FERRY_HAVE_CUDA undefined) every entry point reports
// "built without CUDA" and available() is false.
#include "ferry/pinning/cuda.h"

#include <unistd.h>
#include "ferry/detail/numa.h"

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ferry/detail/engine.h"
#include "ferry/pinning/fence.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ferry::cuda {
namespace {

#ifdef FERRY_HAVE_CUDA
void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state
    throw CudaError(std::string(call) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}
// Destructors: never throw; tolerate the runtime being torn down at process exit.
void check_noexcept(cudaError_t e, const char* call) noexcept {
  if (e == cudaSuccess || e == cudaErrorCudartUnloading) return;
  cudaGetLastError();
  detail::warn_once(call, std::string(call) + " failed in a destructor: " + cudaGetErrorString(e));
}
#define FERRY_CUDA(call) check((call), #call)

struct Probe {
  int count = 0;
  std::string reason;
};
const Probe& probe() {
  static const Probe p = [] {
    Probe r;
    const cudaError_t e = cudaGetDeviceCount(&r.count);
    if (e != cudaSuccess) {
      cudaGetLastError();
      r.count = 0;
      const std::string what = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
      // Without any NVIDIA driver the runtime says the driver is "insufficient", which sends people
      // to upgrade a driver they do not have: say what is missing first.
      const bool no_driver =
          (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice) && access("/proc/driver/nvidia/version", F_OK) != 0;
      r.reason = no_driver ? "no NVIDIA GPU driver on this machine (no /proc/driver/nvidia; " + what + ")" : what;
    } else if (r.count == 0) {
      r.reason = "no CUDA device";
    }
    return r;
  }();
  return p;
}
#else
[[noreturn]] void no_cuda(const char* what) { throw CudaError(std::string(what) + ": ferry was built without CUDA"); }
#endif

}  // namespace

#ifdef FERRY_HAVE_CUDA
bool available() noexcept { return probe().count > 0; }
int device_count() noexcept { return probe().count; }
std::string unavailable_reason() { return probe().reason; }

std::string pci_bus_id(int device) {
  char id[64] = {};
  FERRY_CUDA(cudaDeviceGetPCIBusId(id, static_cast<int>(sizeof id), device));
  return id;
}

DeviceGuard::DeviceGuard(int device) {
  FERRY_CUDA(cudaGetDevice(&previous_));
  if (previous_ != device) FERRY_CUDA(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_ && previous_ >= 0)
    check_noexcept(cudaSetDevice(previous_), "cudaSetDevice");
}

Stream Stream::create(int device, bool high_priority) {
  DeviceGuard g(device);
  Stream s;
  cudaStream_t h = nullptr;
  int least = 0, greatest = 0;
  if (high_priority) FERRY_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  FERRY_CUDA(cudaStreamCreateWithPriority(&h, cudaStreamNonBlocking, high_priority ? greatest : 0));
  s.handle_ = h;
  s.device_ = device;
  s.owned_ = true;
  return s;
}
Stream Stream::borrow(void* native, int device) {
  Stream s;
  s.handle_ = native;
  s.device_ = device;
  s.owned_ = false;
  return s;
}
Stream::~Stream() {
  if (owned_ && handle_) check_noexcept(cudaStreamDestroy(static_cast<cudaStream_t>(handle_)), "cudaStreamDestroy");
}
void Stream::wait(const Event& event) const {
  FERRY_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(handle_), static_cast<cudaEvent_t>(event.native()), 0));
}
void Stream::synchronize() const { FERRY_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_))); }

namespace {

// Events are made and dropped at a batch's rate (a gather's completion, a batch's release):
// cudaEventCreate and cudaEventDestroy cost a microsecond or two of the pin thread's time each.
// A dropped event's handle waits here for the next create() of its device and kind (its last
// record may still be pending: whoever takes it records it again, and a stream that waited on the
// old record keeps waiting for just that). Bounded; what passes the bound is destroyed. The pool
// is never freed (handles outlive no context: none is reset).
struct EventPool {
  static constexpr std::size_t kMax = 1024;  // a device and kind
  std::mutex mu;
  std::map<std::pair<int, unsigned>, std::vector<void*>> free;  // by device and flags
};

EventPool& event_pool() {
  static EventPool* pool = new EventPool;  // outlives every Event, also those of static objects
  return *pool;
}

}  // namespace

Event Event::create(int device, bool timing, bool blocking) {
  Event e;
  e.device_ = device;
  e.flags_ = (timing ? 0u : static_cast<unsigned>(cudaEventDisableTiming)) |
             (blocking ? static_cast<unsigned>(cudaEventBlockingSync) : 0u);
  {
    EventPool& pool = event_pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    std::vector<void*>& mine = pool.free[{device, e.flags_}];
    if (!mine.empty()) {
      e.handle_ = mine.back();
      mine.pop_back();
      return e;
    }
  }
  DeviceGuard g(device);
  cudaEvent_t h = nullptr;
  FERRY_CUDA(cudaEventCreateWithFlags(&h, e.flags_));
  e.handle_ = h;
  return e;
}
Event::~Event() {
  if (!handle_) return;
  {
    EventPool& pool = event_pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    std::vector<void*>& mine = pool.free[{device_, flags_}];
    if (mine.size() < EventPool::kMax) {
      mine.push_back(handle_);
      return;
    }
  }
  check_noexcept(cudaEventDestroy(static_cast<cudaEvent_t>(handle_)), "cudaEventDestroy");
}
void Event::record(const Stream& stream) {
  FERRY_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(stream.native())));
}
bool Event::ready() const {
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (e == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  FERRY_CUDA(e);
  return true;
}
void Event::synchronize() const { FERRY_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_))); }
double Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0;
  FERRY_CUDA(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.native()), static_cast<cudaEvent_t>(end.native())));
  return ms;
}

void* host_alloc(std::size_t bytes) {
  void* p = nullptr;
  // Portable: pinned for every device's context, so one pool may feed loaders on several GPUs.
  FERRY_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
  return p;
}
void host_free(void* p) noexcept { check_noexcept(cudaFreeHost(p), "cudaFreeHost"); }
void host_register(void* p, std::size_t bytes) { FERRY_CUDA(cudaHostRegister(p, bytes, cudaHostRegisterPortable)); }
void host_unregister(void* p) noexcept { check_noexcept(cudaHostUnregister(p), "cudaHostUnregister"); }
void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  FERRY_CUDA(cudaMalloc(&p, bytes));
  return p;
}
void device_free(void* p) noexcept { check_noexcept(cudaFree(p), "cudaFree"); }
void memcpy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, const Stream& stream) {
  const cudaMemcpyKind k = kind == CopyKind::HostToDevice     ? cudaMemcpyHostToDevice
                           : kind == CopyKind::DeviceToHost   ? cudaMemcpyDeviceToHost
                           : kind == CopyKind::DeviceToDevice ? cudaMemcpyDeviceToDevice
                                                              : cudaMemcpyHostToHost;
  FERRY_CUDA(cudaMemcpyAsync(dst, src, bytes, k, static_cast<cudaStream_t>(stream.native())));
}
#else
bool available() noexcept { return false; }
int device_count() noexcept { return 0; }
std::string unavailable_reason() { return "ferry was built without CUDA"; }
std::string pci_bus_id(int) { no_cuda("cudaDeviceGetPCIBusId"); }
DeviceGuard::DeviceGuard(int) { no_cuda("DeviceGuard"); }
DeviceGuard::~DeviceGuard() = default;
Stream Stream::create(int, bool) { no_cuda("Stream::create"); }
Stream Stream::borrow(void* native, int device) {
  Stream s;
  s.handle_ = native;
  s.device_ = device;
  return s;
}
Stream::~Stream() = default;
void Stream::wait(const Event&) const { no_cuda("Stream::wait"); }
void Stream::synchronize() const { no_cuda("Stream::synchronize"); }
Event Event::create(int, bool, bool) { no_cuda("Event::create"); }
double Event::elapsed_ms(const Event&, const Event&) { no_cuda("Event::elapsed_ms"); }
Event::~Event() = default;
void Event::record(const Stream&) { no_cuda("Event::record"); }
bool Event::ready() const { no_cuda("Event::ready"); }
void Event::synchronize() const { no_cuda("Event::synchronize"); }
void* host_alloc(std::size_t) { no_cuda("cudaHostAlloc"); }
void host_free(void*) noexcept {}
void host_register(void*, std::size_t) { no_cuda("cudaHostRegister"); }
void host_unregister(void*) noexcept {}
void* device_alloc(std::size_t) { no_cuda("cudaMalloc"); }
void device_free(void*) noexcept {}
void memcpy_async(void*, const void*, std::size_t, CopyKind, const Stream&) { no_cuda("cudaMemcpyAsync"); }
#endif

Stream::Stream(Stream&& o) noexcept
    : handle_(std::exchange(o.handle_, nullptr)), device_(o.device_), owned_(std::exchange(o.owned_, false)) {}
Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    Stream tmp(std::move(*this));
    handle_ = std::exchange(o.handle_, nullptr);
    device_ = o.device_;
    owned_ = std::exchange(o.owned_, false);
  }
  return *this;
}
Event::Event(Event&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)), device_(o.device_), flags_(o.flags_) {}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    Event tmp(std::move(*this));
    handle_ = std::exchange(o.handle_, nullptr);
    device_ = o.device_;
    flags_ = o.flags_;
  }
  return *this;
}

}  // namespace ferry::cuda

namespace ferry::detail {
Placement placement_for_device(int device) {
  if (!cuda::available() || device < 0 || device >= cuda::device_count()) {
    Placement p;
    p.reason = "not placed: no CUDA device " + std::to_string(device);
    return p;
  }
  std::string id;
  try {
    id = cuda::pci_bus_id(device);
  } catch (const std::exception& e) {
    Placement p;
    p.reason = std::string("not placed: ") + e.what();
    return p;
  }
  Placement p = placement_for_pci(id);
  p.reason = "cuda:" + std::to_string(device) + ": " + p.reason;
  return p;
}
}  // namespace ferry::detail

namespace ferry {

// Defined once, in this library, so that fences made in any of ferry's libraries draw from one
// counter.
std::uint64_t EventFence::next_serial() noexcept {
  static std::atomic<std::uint64_t> n{0};
  return n.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace ferry
