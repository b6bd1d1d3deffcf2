// ferry/pinning/cuda.h — the CUDA runtime, as far as ferry needs it, behind RAII types.
//
// ferry's library code is plain C++ linked to the CUDA runtime (no kernels, no nvcc). One binary
// runs with or without a GPU: cuda_available() says whether a device can be used now. Every CUDA
// call is checked; a failure throws ferry::CudaError naming the call and the runtime's message.
// Destructors never throw (a failing destroy is logged once; cudaErrorCudartUnloading at process
// exit is ignored).
//
//   ferry::cuda::Stream copy = ferry::cuda::Stream::create(/*device=*/0);
//   ferry::cuda::Event done = ferry::cuda::Event::create();
//   done.record(copy);
//   compute.wait(done);                    // cudaStreamWaitEvent: compute waits, the host does not
//
// Streams and events cross the API as opaque handles: native() returns the cudaStream_t /
// cudaEvent_t as void*, so users compile against ferry without CUDA's headers.
//
// Thread safety: the wrappers are move-only values; the CUDA calls they make are thread-safe.
#pragma once

#include <memory>
#include <string>

#include "ferry/core/error.h"

namespace ferry {

/// A CUDA runtime call failed; what() names the call and the error.
class CudaError : public Error {
 public:
  using Error::Error;
};

namespace cuda {

/// True when ferry was built with the CUDA runtime and a device is usable now (checked once).
bool available() noexcept;
/// Number of usable devices (0 without CUDA).
int device_count() noexcept;
/// The PCI address of `device` ("0000:41:00.0"); throws CudaError.
std::string pci_bus_id(int device);
/// Why CUDA is unavailable ("built without CUDA", the runtime's error), or "" when available.
std::string unavailable_reason();

/// Makes `device` current for the scope, restoring the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

class Event;

/// An owned, non-blocking CUDA stream (or a borrowed one, from `borrow`).
class Stream {
 public:
  Stream() = default;
  /// A new stream on `device` that does not synchronize with the legacy default stream. With
  /// `high_priority`, at the device's greatest stream priority: the GPU schedules its kernels'
  /// blocks ahead of waiting blocks of lower-priority streams (it does not preempt running ones).
  static Stream create(int device, bool high_priority = false);
  /// Wraps a stream owned elsewhere (e.g. the framework's current stream); not destroyed by ferry.
  static Stream borrow(void* native, int device);
  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;
  ~Stream();

  void* native() const noexcept { return handle_; }
  int device() const noexcept { return device_; }
  /// This stream waits (on the device) until `event` has completed.
  void wait(const Event& event) const;
  /// Blocks the host until all work queued so far has finished.
  void synchronize() const;

 private:
  void* handle_ = nullptr;
  int device_ = 0;
  bool owned_ = false;
};

/// An owned CUDA event, created without timing (cheapest to record and query) unless asked.
/// Dropped events are kept for the next create() of their device and kind (recorded again there),
/// so an event a batch costs no cudaEventCreate/cudaEventDestroy.
class Event {
 public:
  Event() = default;
  /// `blocking`: synchronize() sleeps until the event completes (cudaEventBlockingSync) instead
  /// of spinning, as CUDA's default does on a host with more CPUs than GPUs.
  static Event create(int device, bool timing = false, bool blocking = false);
  /// Milliseconds between two completed timing events (cudaEventElapsedTime).
  static double elapsed_ms(const Event& start, const Event& end);
  Event(Event&&) noexcept;
  Event& operator=(Event&&) noexcept;
  ~Event();

  void* native() const noexcept { return handle_; }
  /// Captures the work queued on `stream` so far.
  void record(const Stream& stream);
  /// True when the captured work has finished (cudaEventQuery).
  bool ready() const;
  /// Blocks the host until the captured work has finished.
  void synchronize() const;

 private:
  void* handle_ = nullptr;
  int device_ = 0;
  unsigned flags_ = 0;  // cudaEventCreateWithFlags's
};

/// Pinned host memory: cudaHostAlloc / cudaFreeHost (throws CudaError; free never throws).
void* host_alloc(std::size_t bytes);
void host_free(void* p) noexcept;
/// Pins memory allocated elsewhere (a shared mapping) for every device: cudaHostRegister, portable
/// (throws CudaError); unregister never throws. The range must stay mapped while registered.
void host_register(void* p, std::size_t bytes);
void host_unregister(void* p) noexcept;
/// Device memory on the current device: cudaMalloc / cudaFree.
void* device_alloc(std::size_t bytes);
void device_free(void* p) noexcept;
/// cudaMemcpyAsync in the given direction on `stream`.
enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice, HostToHost };
void memcpy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, const Stream& stream);

}  // namespace cuda
}  // namespace ferry
