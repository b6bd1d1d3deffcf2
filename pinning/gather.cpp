// RowRegistration: host arrays registered with CUDA for the device gather (Note [Device gather]).
//
// Registrations are shared across the process: two loaders over the same arrays (one per GPU, say)
// register their pages once, portable to every device, and the last one out unregisters them, so
// one loader's destruction never pulls memory from under another's kernels. A range that overlaps
// a registered one without lying inside it is refused (a CudaError; Gather::Auto then takes the
// host path).
#include "ferry/pinning/gather.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include "ferry/pinning/cuda.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ferry {
namespace {

struct Range {
  std::uintptr_t begin = 0, end = 0;
  std::size_t array = 0;  // the first array in it (for errors)
};

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}

// The arrays' page ranges, sorted and merged where they overlap.
std::vector<Range> ranges_of(const std::vector<HostRows>& arrays) {
  const std::uintptr_t page = page_size();
  std::vector<Range> r;
  for (std::size_t k = 0; k < arrays.size(); ++k) {
    const HostRows& a = arrays[k];
    if (!a.data || a.rows <= 0 || a.row_bytes == 0) continue;
    const auto b = reinterpret_cast<std::uintptr_t>(a.data);
    const std::uintptr_t e = b + static_cast<std::uintptr_t>(a.rows) * a.row_bytes;
    r.push_back({b / page * page, (e + page - 1) / page * page, k});
  }
  std::sort(r.begin(), r.end(), [](const Range& x, const Range& y) { return x.begin < y.begin; });
  std::vector<Range> merged;
  for (const Range& x : r) {
    if (!merged.empty() && x.begin < merged.back().end)
      merged.back().end = std::max(merged.back().end, x.end);
    else
      merged.push_back(x);
  }
  return merged;
}

// The process's registrations: range start -> (end, references).
struct Registry {
  std::mutex mu;
  std::map<std::uintptr_t, std::pair<std::uintptr_t, int>> ranges;
  std::size_t bytes = 0;
};
Registry& registry() {
  static Registry* r = new Registry;  // leaked: outlives static destructors that may unregister
  return *r;
}

}  // namespace

std::size_t RowRegistration::bytes_needed(const std::vector<HostRows>& arrays) {
  std::size_t n = 0;
  for (const Range& r : ranges_of(arrays)) n += r.end - r.begin;
  return n;
}

namespace {
// Before any CUDA call: the arrays' pages (a mapped file's copy takes as many; arrays over the
// same pages count once) within the limit.
void check_limit(const std::vector<HostRows>& arrays, std::size_t limit_bytes) {
  const std::size_t need = RowRegistration::bytes_needed(arrays);
  if (need > limit_bytes)
    throw Error("device gather: the dataset's arrays need " + std::to_string(need) + " bytes registered, over the limit of " +
                std::to_string(limit_bytes) + " (DataLoaderOptions::register_memory_limit)");
}
}  // namespace

std::size_t RowRegistration::registered_bytes_now() noexcept {
  Registry& g = registry();
  std::lock_guard l(g.mu);
  return g.bytes;
}

#ifdef FERRY_HAVE_CUDA

namespace {
std::string cuda_message(cudaError_t e) {
  cudaGetLastError();
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

// A mapped file's bytes copied into `dst`, by up to 8 threads for a large one (the copy is what
// the first gather waits for).
void copy_in(void* dst, const void* src, std::size_t n) {
  constexpr std::size_t kChunk = std::size_t{64} << 20;
  const std::size_t chunks = (n + kChunk - 1) / kChunk;
  const std::size_t threads = std::min<std::size_t>({chunks, 8, std::max(1u, std::thread::hardware_concurrency())});
  if (threads <= 1) {
    std::memcpy(dst, src, n);
    return;
  }
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t c; (c = next.fetch_add(1)) < chunks;) {
      const std::size_t at = c * kChunk;
      std::memcpy(static_cast<char*>(dst) + at, static_cast<const char*>(src) + at, std::min(kChunk, n - at));
    }
  };
  std::vector<std::thread> pool;  // joined below, before the copy's caller goes on
  for (std::size_t t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer helpers: this thread takes the chunks left
    }
  }
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace

RowRegistration::RowRegistration(const std::vector<HostRows>& arrays, int device, std::size_t limit_bytes) : device_(device) {
  // A mapped file (HostRows::mapped_file) is not registered in place but copied into page-locked
  // memory (Note [Device gather], "mapped files", ferry/pinning/gather.h); arrays over the same
  // bytes (a token file's input_ids and labels) share one copy.
  std::vector<HostRows> in_place;   // the arrays registered in place (the others left empty)
  std::vector<std::size_t> copied;  // arrays[k] read from a copy
  std::vector<std::size_t> copy_of(arrays.size(), 0);
  std::vector<std::size_t> unique;  // the first array of each copy
  check_limit(arrays, limit_bytes);
  auto bytes_of = [&](std::size_t k) { return static_cast<std::size_t>(arrays[k].rows) * arrays[k].row_bytes; };
  for (std::size_t k = 0; k < arrays.size(); ++k) {
    if (!(arrays[k].mapped_file && arrays[k].data && arrays[k].rows > 0)) {
      in_place.push_back(arrays[k]);
      continue;
    }
    in_place.push_back(HostRows{});  // keeps ranges_of's indices those of `arrays`
    copied.push_back(k);
    std::size_t c = 0;
    while (c < unique.size() && !(arrays[unique[c]].data == arrays[k].data && bytes_of(unique[c]) == bytes_of(k))) ++c;
    if (c == unique.size()) unique.push_back(k);
    copy_of[k] = c;
  }
  const std::vector<Range> ranges = ranges_of(in_place);
  if (!cuda::available()) throw CudaError("device gather: CUDA is unavailable (" + cuda::unavailable_reason() + ")");
  cuda::DeviceGuard guard(device);
  int read_only = 0;
  cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, device);
  cudaGetLastError();
  const unsigned flags = cudaHostRegisterPortable | cudaHostRegisterMapped | (read_only ? cudaHostRegisterReadOnly : 0u);
  Registry& g = registry();
  std::vector<bool> foreign(arrays.size(), false);  // memory CUDA knew before us (cudaHostAlloc, a user's registration)
  try {
    std::lock_guard l(g.mu);
    for (const Range& r : ranges) {
      // Inside one of ours: share it.
      auto it = g.ranges.upper_bound(r.begin);
      if (it != g.ranges.begin()) {
        auto prev = std::prev(it);
        if (prev->first <= r.begin && r.end <= prev->second.first) {
          ++prev->second.second;
          registered_.push_back(reinterpret_cast<void*>(prev->first));
          continue;
        }
        if (prev->second.first > r.begin) it = prev;
      }
      if (it != g.ranges.end() && it->first < r.end)
        throw CudaError("device gather: " + arrays[r.array].name +
                        " shares pages with memory another loader registered differently");
      void* p = reinterpret_cast<void*>(r.begin);
      const cudaError_t e = cudaHostRegister(p, r.end - r.begin, flags);
      if (e == cudaErrorHostMemoryAlreadyRegistered) {
        cudaGetLastError();
        for (std::size_t k = 0; k < arrays.size(); ++k) {
          const auto b = reinterpret_cast<std::uintptr_t>(arrays[k].data);
          if (b >= r.begin && b < r.end) foreign[k] = true;
        }
        continue;
      }
      if (e != cudaSuccess)
        throw CudaError("device gather: cudaHostRegister of " + arrays[r.array].name + " (" + std::to_string(r.end - r.begin) +
                        " bytes) failed: " + cuda_message(e));
      g.ranges[r.begin] = {r.end, 1};
      g.bytes += r.end - r.begin;
      bytes_ += r.end - r.begin;
      registered_.push_back(p);
    }
  } catch (...) {
    release();
    throw;
  }
  try {
    for (std::size_t k : unique) {
      const std::size_t n = bytes_of(k);
      void* p = nullptr;
      const cudaError_t e = cudaHostAlloc(&p, n, cudaHostAllocPortable | cudaHostAllocMapped);
      if (e != cudaSuccess)
        throw CudaError("device gather: cudaHostAlloc of " + std::to_string(n) + " bytes for a copy of " + arrays[k].name +
                        " failed: " + cuda_message(e));
      copies_.push_back(p);
      {
        std::lock_guard l(g.mu);
        g.bytes += n;
      }
      bytes_ += n;
      copy_bytes_.push_back(n);
      copy_in(p, arrays[k].data, n);
    }
  } catch (...) {
    release();
    throw;
  }
  try {
    std::size_t next_copy = 0;
    for (std::size_t k = 0; k < arrays.size(); ++k) {
      void* d = nullptr;
      if (next_copy < copied.size() && copied[next_copy] == k) {
        ++next_copy;
        const cudaError_t e = cudaHostGetDevicePointer(&d, copies_[copy_of[k]], 0);
        if (e != cudaSuccess)
          throw CudaError("device gather: no device address for the copy of " + arrays[k].name + ": " + cuda_message(e));
        device_rows_.push_back(d);
        continue;
      }
      const cudaError_t e = cudaHostGetDevicePointer(&d, const_cast<void*>(arrays[k].data), 0);
      if (e != cudaSuccess)
        throw CudaError("device gather: no device address for " + arrays[k].name +
                        (foreign[k] ? " (pinned elsewhere, not mapped)" : "") + ": " + cuda_message(e));
      device_rows_.push_back(d);
    }
  } catch (...) {
    release();
    throw;
  }
}

RowRegistration::~RowRegistration() { release(); }

void RowRegistration::release() noexcept {
  Registry& g = registry();
  std::lock_guard l(g.mu);
  for (void* p : registered_) {
    auto it = g.ranges.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == g.ranges.end() || --it->second.second > 0) continue;
    const std::size_t len = it->second.first - it->first;
    const cudaError_t e = cudaHostUnregister(p);
    if (e != cudaSuccess && e != cudaErrorCudartUnloading) cudaGetLastError();
    g.bytes -= len;
    g.ranges.erase(it);
  }
  registered_.clear();
  for (std::size_t i = 0; i < copies_.size(); ++i) {
    if (cudaFreeHost(copies_[i]) != cudaSuccess) cudaGetLastError();
    g.bytes -= copy_bytes_[i];
  }
  copies_.clear();
  copy_bytes_.clear();
}

#else

RowRegistration::RowRegistration(const std::vector<HostRows>& arrays, int device, std::size_t limit_bytes) : device_(device) {
  check_limit(arrays, limit_bytes);
  throw CudaError("device gather: ferry was built without CUDA");
}
RowRegistration::~RowRegistration() = default;
void RowRegistration::release() noexcept {}

#endif

}  // namespace ferry
