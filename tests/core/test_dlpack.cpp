// Tests that DLPack export and import share bytes without copying, free them exactly once, and
// reject layouts ferry cannot represent without leaking.
#include <catch2/catch.hpp>

#include <dlpack/dlpack.h>

#include "ferry/ferry.h"

using namespace ferry;

TEST_CASE("to_dlpack then from_dlpack shares the bytes and frees them once", "[unit][dlpack]") {
  std::weak_ptr<void> owner;
  Tensor back;
  {
    Tensor t = Tensor::from(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
    owner = t.storage().owner();
    Tensor row = t.select(1);
    DLManagedTensor* m = to_dlpack(row);
    CHECK(m->dl_tensor.ndim == 1);
    CHECK(m->dl_tensor.shape[0] == 3);
    CHECK(m->dl_tensor.dtype.code == kDLFloat);
    CHECK(m->dl_tensor.dtype.bits == 32);
    CHECK(m->dl_tensor.device.device_type == kDLCPU);
    CHECK(m->dl_tensor.byte_offset == 12);
    back = from_dlpack(m);
    CHECK(back.raw() == row.raw());
  }
  CHECK(back.shape() == Shape{3});
  CHECK(back.item<float>(0) == 4.0f);
  CHECK_FALSE(owner.expired());  // the import keeps the export, which keeps the storage
  back = Tensor();
  CHECK(owner.expired());
}

TEST_CASE("every dtype round-trips through DLPack", "[unit][dlpack]") {
  for (DType d : {DType::Bool, DType::UInt8, DType::Int8, DType::Int16, DType::Int32, DType::Int64, DType::Float16,
                  DType::BFloat16, DType::Float32, DType::Float64}) {
    Tensor t = Tensor::zeros(d, {2, 2});
    CHECK(from_dlpack(to_dlpack(t)).dtype() == d);
  }
}

TEST_CASE("a strided import is refused and still released", "[unit][dlpack][errors]") {
  static int deleted = 0;
  static std::int64_t shape[2] = {2, 3}, strides[2] = {1, 2};  // column-major
  static float data[6];
  auto* m = new DLManagedTensor{};
  m->dl_tensor = DLTensor{data, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, strides, 0};
  m->deleter = [](DLManagedTensor* self) {
    ++deleted;
    delete self;
  };
  CHECK_THROWS_WITH(from_dlpack(m), Catch::Contains("only C-contiguous tensors are supported"));
  CHECK(deleted == 1);
  CHECK_THROWS_WITH(from_dlpack(nullptr), Catch::Contains("null"));
}

TEST_CASE("an empty tensor is taken whatever its strides", "[unit][dlpack]") {
  static std::int64_t shape[3] = {3, 0, 5}, strides[3] = {5, 5, 1};  // what torch gives a [3, 0, 5] tensor
  static float data[1];
  auto* m = new DLManagedTensor{};
  m->dl_tensor = DLTensor{data, {kDLCPU, 0}, 3, {kDLFloat, 32, 1}, shape, strides, 0};
  m->deleter = [](DLManagedTensor* self) { delete self; };
  const Tensor t = from_dlpack(m);
  CHECK(t.shape() == Shape{3, 0, 5});
  CHECK(t.numel() == 0);
}
