// ferry/core/allocator.h — where batch buffers come from.
//
// Collate and direct (get_into) datasets never call `new` for batch memory: they ask the
// BatchAllocator they are handed. By default that is pageable host memory; the pinning stage
// hands a pinned pool instead, so a batch can be built straight in page-locked memory.
//
// Thread safety: implementations must allow concurrent allocate() calls (workers share one).
#pragma once

#include <cstddef>

#include "ferry/core/tensor.h"

namespace ferry {

/// Source of batch buffers.
class BatchAllocator {
 public:
  virtual ~BatchAllocator() = default;
  /// `nbytes` of memory, at least 64-byte aligned. May block (a bounded pool); throws ferry::Error
  /// when the request can never be met. An implementation that blocks must poll stop_requested()
  /// and throw once it is true, or the loader cannot shut down while it waits.
  virtual Storage allocate(std::size_t nbytes) = 0;
};

/// True when the loader thread calling it (a worker or the pin thread) is being stopped: its
/// epoch ended early or the loader is being destroyed. Code that blocks (an allocator waiting for
/// memory, a dataset waiting on a network read) should give up by throwing; the loader discards
/// the result. Always false on threads a loader did not start.
bool stop_requested() noexcept;

/// Pageable host memory (Storage::allocate). A process-wide instance.
BatchAllocator& pageable_allocator() noexcept;

/// An uninitialized tensor from `allocator`.
Tensor empty(DType dtype, Shape shape, BatchAllocator& allocator);

}  // namespace ferry
