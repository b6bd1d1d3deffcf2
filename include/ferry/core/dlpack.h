// ferry/core/dlpack.h — zero-copy hand-off to and from libtorch, CuPy, JAX through DLPack.
//
//   #include <dlpack/dlpack.h>                 // DLPack's own header, for the struct's fields
//   DLManagedTensor* m = ferry::to_dlpack(batch_images);
//   at::Tensor t = at::fromDLPack(m);          // libtorch now shares ferry's bytes
//
//   ferry::Tensor back = ferry::from_dlpack(some_framework_export);
//
// to_dlpack() returns a tensor that keeps ferry's storage alive until the consumer calls its
// deleter. from_dlpack() takes ownership of the DLManagedTensor and calls its deleter when the last
// ferry reference to the bytes goes. Only C-contiguous tensors are accepted (ferry::Error names the
// strides otherwise). Memory kinds map as cpu <-> kDLCPU, pinned <-> kDLCUDAHost, cuda:N <-> kDLCUDA.
// bool is exchanged with DLPack's type code 6 (kDLBool in DLPack >= 0.8).
#pragma once

#include "ferry/core/tensor.h"

struct DLManagedTensor;

namespace ferry {

/// Exports `tensor`; the caller (or the framework it is passed to) must call m->deleter(m).
DLManagedTensor* to_dlpack(const Tensor& tensor);

/// Imports `managed`, taking ownership of it (its deleter runs when the bytes are released).
/// On error the deleter is still called, so nothing leaks, and ferry::Error says what was wrong.
Tensor from_dlpack(DLManagedTensor* managed);

}  // namespace ferry
