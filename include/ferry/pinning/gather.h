// ferry/pinning/gather.h — batches the GPU gathers itself from rows of host arrays.
//
// Note [Device gather]
// When a dataset's samples are rows of host arrays with a fixed row size (TensorDataset's
// tensors, a mapped .npy, IdxDataset's images and labels) and nothing but the row transforms below
// runs per sample, a batch needs no CPU copy at all. The
// loader registers each array once with CUDA (RowRegistration: cudaHostRegister, mapped, read-only
// where the device allows it, within DataLoaderOptions::register_memory_limit), and per batch
// sends only the sample indices: the pin thread writes them (whatever num_workers says: a worker
// would only write them, and its hand-over costs more, so no worker starts and worker_init_fn is
// not called) and, copying nothing on this path, issues one kernel a field on the copy stream
// (the indices in its launch, or first a pinned block's copy for a batch too large for that),
// which reads each row through the mapped
// address straight into the batch's device buffer (DeviceStage::gather_rows), and the consumer's
// thread only takes finished batches. Ordering, events, buffer reuse and hand-over are the device
// stage's (Note [Device stage]); the rows cross host memory once, read by the GPU over the link,
// where the host path crosses it three times (read and write by a worker, read by the copy
// engine). The batches are bitwise equal to the host path's. The loader chooses the path with
// DataLoaderOptions::gather (Auto: the device gather wherever it applies; where a row dataset
// cannot take it, the loader says why once, as a warning).
// Two refinements: small batches that are ready together share one launch (the pin thread holds
// their gathers, DeviceStage::end_held, and issues them at once, issue_held: a launch and its
// events cost about what a 0.8 MB batch takes the link; they also share device buffers, up to 8
// batches to one, begun `shared`: one lease and one release a buffer), and rows of 64 KiB and more,
// untransformed, go by the copy engines instead of the kernel (one cudaMemcpyBatchAsync a field,
// a copy a row: 0.99 of the link, where SM loads of mapped memory stop near 0.87).
//
//   ferry::DataLoaderOptions o;
//   o.device = 0;
//   o.num_workers = 0;                     // nothing for workers to do (none would start)
//   o.gather = ferry::Gather::Device;      // an Error naming the reason where it cannot apply
//   ferry::DataLoader loader(ferry::TensorDataset({images, labels}), o);
//
// Mapped files: gather = Auto leaves rows that are a file's mapping (HostRows::mapped_file, a
// .npy, a token file) to the host path; gather = Device gathers them from a copy. A mapping is
// never registered in place: on some hosts cudaHostRegister of a file's mapping did not return,
// its thread running in the kernel, killable only by SIGKILL (scripts/npy-register-probe.sh;
// bench/RESULTS.md, "Python"), while files the suite wrote itself registered; a long-term pin of
// page-cache pages that cannot be moved (a VM's ZONE_MOVABLE) is a plausible cause, not a
// confirmed one. So RowRegistration copies a mapped file's rows once into
// page-locked memory of its own (cudaHostAlloc, mapped; within register_memory_limit), and the GPU
// reads the copy: the file's bytes are read once at the loader's start (by up to 8 threads), and
// held twice in memory (page cache and copy) while the loader lives.
//
// Row transforms: a field's HostRows may carry a RowTransform (ferry/core/rows.h), the transforms
// image rows usually need: a random horizontal flip, uint8 to float32 / float16 / bfloat16 (CHW,
// or HWC with channels_last) and a per-channel a * v + b (to_float's 1/255 and normalize, folded).
// The kernel applies it to each byte it reads, with the arithmetic of the CPU pass
// (ferry/detail/pass_math.h), so the batch equals ImageTransform's bit for bit. Each sample's flip
// is drawn where its index is written, Generator(seed, epoch, index).bernoulli(p) as the CPU
// transform draws it, and travels as kRowFlipBit in the index word. IdxDataset offers its
// transform this way when ImageTransform::row_transform accepts it (no crop, no resize, at most
// one flip); one field a batch may flip.
//
// Larger than register_memory_limit: the host path (with a warning), not registration in windows.
// A shuffled batch's rows fall anywhere in the array, so each batch would register and unregister
// every window it touches, on the pin thread, and a file larger than RAM would pin what the page
// cache needs; the host path reads it through the page cache.
//
// A dataset opts in with a member `std::vector<ferry::HostRows> host_rows(std::string& why) const`
// (RowGatherDataset): one HostRows per field of its batch, in order, whose row i is sample i's
// field unchanged (or its RowTransform's input); an empty result with `why` set declines (say, a
// non-contiguous tensor).
//
// Thread safety: a RowRegistration is immutable after construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/core/rows.h"
#include "ferry/core/tensor.h"

namespace ferry {

/// Host arrays registered with CUDA for `device` to read (cudaHostRegister, mapped; read-only
/// where the device supports it), undone at destruction. Arrays that share pages are registered as
/// one range; memory CUDA already knows as pinned is used as it is; a mapped file's rows
/// (HostRows::mapped_file) are copied into page-locked memory instead (see the Note).
class RowRegistration {
 public:
  /// Throws Error when the arrays' pages exceed `limit_bytes` (before any CUDA call), CudaError
  /// naming the array and the driver's reason when CUDA refuses to register or map one.
  RowRegistration(const std::vector<HostRows>& arrays, int device, std::size_t limit_bytes);
  ~RowRegistration();
  RowRegistration(const RowRegistration&) = delete;
  RowRegistration& operator=(const RowRegistration&) = delete;

  /// The device's address of array k's first row.
  const void* device_rows(std::size_t k) const { return device_rows_.at(k); }
  /// Bytes page-locked by this registration.
  std::size_t bytes() const noexcept { return bytes_; }
  /// Bytes registered by all live RowRegistrations of the process (tests check it returns to 0).
  static std::size_t registered_bytes_now() noexcept;
  /// Page-aligned bytes `arrays` would register (merged where they share pages).
  static std::size_t bytes_needed(const std::vector<HostRows>& arrays);

 private:
  void release() noexcept;
  std::vector<const void*> device_rows_;
  std::vector<void*> registered_;  // starts of the ranges this object registered (to unregister)
  std::vector<void*> copies_;      // mapped files' copies (cudaHostAlloc), in the arrays' order
  std::vector<std::size_t> copy_bytes_;
  std::size_t bytes_ = 0;
  int device_ = 0;
};

}  // namespace ferry
