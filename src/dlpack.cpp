#include "ferry/core/dlpack.h"

#include <algorithm>
#include <dlpack/dlpack.h>

#include "ferry/core/error.h"

namespace ferry {
namespace {

constexpr std::uint8_t kDLBoolCode = 6;  // kDLBool in DLPack >= 0.8; Debian 12 ships 0.6

DLDataType to_dl(DType d) {
  const auto bits = static_cast<std::uint8_t>(itemsize(d) * 8);
  switch (d) {
    case DType::Bool: return {kDLBoolCode, 8, 1};
    case DType::UInt8: return {kDLUInt, bits, 1};
    case DType::Int8:
    case DType::Int16:
    case DType::Int32:
    case DType::Int64: return {kDLInt, bits, 1};
    case DType::BFloat16: return {kDLBfloat, 16, 1};
    case DType::Float16:
    case DType::Float32:
    case DType::Float64: return {kDLFloat, bits, 1};
  }
  return {kDLUInt, 8, 1};
}

DType from_dl(DLDataType t) {
  if (t.lanes != 1) throw Error("from_dlpack: vector types (lanes=" + std::to_string(t.lanes) + ") are not supported");
  switch (t.code) {
    case kDLUInt:
      if (t.bits == 8) return DType::UInt8;
      break;
    case kDLInt:
      if (t.bits == 8) return DType::Int8;
      if (t.bits == 16) return DType::Int16;
      if (t.bits == 32) return DType::Int32;
      if (t.bits == 64) return DType::Int64;
      break;
    case kDLFloat:
      if (t.bits == 16) return DType::Float16;
      if (t.bits == 32) return DType::Float32;
      if (t.bits == 64) return DType::Float64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::BFloat16;
      break;
    case kDLBoolCode:
      if (t.bits == 8) return DType::Bool;
      break;
    default: break;
  }
  throw Error("from_dlpack: unsupported dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits)");
}

struct Export {
  DLManagedTensor managed{};
  Tensor tensor;  // keeps the storage alive
  std::vector<std::int64_t> shape;
};

}  // namespace

DLManagedTensor* to_dlpack(const Tensor& tensor) {
  if (!tensor.defined()) throw Error("to_dlpack: the tensor is undefined");
  auto* e = new Export;
  e->tensor = tensor;
  e->shape = tensor.shape();
  DLTensor& t = e->managed.dl_tensor;
  t.data = tensor.storage().data();
  t.byte_offset = tensor.offset();
  const Device dev = tensor.device();
  t.device = {dev.kind == MemoryKind::Device       ? kDLCUDA
              : dev.kind == MemoryKind::PinnedHost ? kDLCUDAHost
                                                   : kDLCPU,
              dev.kind == MemoryKind::Device ? dev.index : 0};
  t.ndim = static_cast<int>(e->shape.size());
  t.dtype = to_dl(tensor.dtype());
  t.shape = e->shape.data();
  t.strides = nullptr;  // compact row-major
  e->managed.manager_ctx = e;
  e->managed.deleter = [](DLManagedTensor* self) { delete static_cast<Export*>(self->manager_ctx); };
  return &e->managed;
}

Tensor from_dlpack(DLManagedTensor* managed) {
  if (!managed) throw Error("from_dlpack: null DLManagedTensor");
  std::shared_ptr<void> owner(managed, [](void* p) {
    auto* m = static_cast<DLManagedTensor*>(p);
    if (m->deleter) m->deleter(m);
  });
  const DLTensor& t = managed->dl_tensor;
  if (t.ndim < 0) throw Error("from_dlpack: negative ndim");
  Shape shape(t.shape, t.shape + t.ndim);
  const DType dtype = from_dl(t.dtype);
  // An empty tensor holds no element whose place a stride could get wrong: any strides are compact
  // (torch gives a [3, 0, 5] tensor strides (5, 5, 1), or (0, 1, 0) after a transpose).
  const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
  if (t.strides && !empty) {
    std::int64_t expect = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (shape[static_cast<std::size_t>(d)] != 1 && t.strides[d] != expect)
        throw Error("from_dlpack: only C-contiguous tensors are supported; dimension " + std::to_string(d) + " of shape " +
                    shape_str(shape) + " has stride " + std::to_string(t.strides[d]) + ", expected " + std::to_string(expect));
      expect *= shape[static_cast<std::size_t>(d)];
    }
  }
  Device dev;
  switch (t.device.device_type) {
    case kDLCPU: dev = Device::host(); break;
    case kDLCUDAHost: dev = Device::pinned(); break;
    case kDLCUDA: dev = Device::cuda(t.device.device_id); break;
    default: throw Error("from_dlpack: unsupported device type " + std::to_string(static_cast<int>(t.device.device_type)));
  }
  std::int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const std::size_t nbytes = static_cast<std::size_t>(numel) * itemsize(dtype);
  auto* base = static_cast<std::byte*>(t.data) + t.byte_offset;
  return Tensor(Storage::wrap(base, nbytes, dev, std::move(owner)), dtype, std::move(shape));
}

}  // namespace ferry
