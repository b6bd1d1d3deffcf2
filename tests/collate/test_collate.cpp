// Tests that the default collate rules match PyTorch's default_collate, build the whole batch in
// one buffer from the allocator, and name the offending samples when samples disagree.
#include <catch2/catch.hpp>

#include <cstring>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;

namespace {
struct Sample {
  Tensor image;
  int label;
  std::string name;
};
struct Batch {
  Tensor image;
  Tensor label;
  std::vector<std::string> name;
};
}  // namespace

template <>
struct ferry::CollateFields<Sample> {
  using batch_type = Batch;
  static constexpr auto fields = std::make_tuple(
      std::pair{&Sample::image, &Batch::image}, std::pair{&Sample::label, &Batch::label}, std::pair{&Sample::name, &Batch::name});
};

TEST_CASE("scalars become 1-D tensors of int64, float64 or bool", "[unit][collate]") {
  auto i = collate(std::vector<int>{1, 2, 3});
  CHECK(i.dtype() == DType::Int64);
  CHECK(i.shape() == Shape{3});
  CHECK(i.item<std::int64_t>(2) == 3);
  auto f = collate(std::vector<float>{0.5f, 1.5f});
  CHECK(f.dtype() == DType::Float64);
  CHECK(f.item<double>(1) == 1.5);
  auto b = collate(std::vector<bool>{true, false});
  CHECK(b.dtype() == DType::Bool);
  CHECK(b.item<bool>(0));
  auto s = collate(std::vector<std::string>{"a", "b"});
  CHECK(s == std::vector<std::string>{"a", "b"});
}

TEST_CASE("tensors are stacked along a new first dimension", "[unit][collate]") {
  std::vector<Tensor> rows;
  for (int r = 0; r < 4; ++r)
    rows.push_back(Tensor::from(std::vector<std::int16_t>{std::int16_t(r), std::int16_t(10 * r), 7}, {3}));
  Tensor t = collate(rows);
  CHECK(t.shape() == Shape{4, 3});
  CHECK(t.dtype() == DType::Int16);
  CHECK(t.item<std::int16_t>(3 * 3 + 1) == 30);
}

TEST_CASE("containers collate element-wise, recursively, into one buffer", "[unit][collate]") {
  using S = std::tuple<Tensor, std::pair<int, double>, std::array<Tensor, 2>, std::vector<int>, std::map<std::string, float>>;
  std::vector<S> samples;
  for (int i = 0; i < 3; ++i)
    samples.push_back(S{Tensor::scalar<float>(float(i)),
                        {i, i * 0.5},
                        {Tensor::zeros(DType::UInt8, {2}), Tensor::scalar<std::int64_t>(i)},
                        {i, -i},
                        {{"x", float(i)}, {"y", 1.0f}}});
  test::CountingAllocator alloc;
  std::vector<std::size_t> idx{10, 11, 12};
  auto b = collate(std::span<const S>(samples), idx, alloc);
  CHECK(alloc.allocations == 1);  // one buffer for the whole batch
  const Tensor& t0 = std::get<0>(b);
  CHECK(t0.shape() == Shape{3});
  CHECK(std::get<1>(b).first.item<std::int64_t>(2) == 2);
  CHECK(std::get<1>(b).second.item<double>(1) == 0.5);
  CHECK(std::get<2>(b)[0].shape() == Shape{3, 2});
  CHECK(std::get<2>(b)[1].item<std::int64_t>(1) == 1);
  CHECK(std::get<3>(b).size() == 2);
  CHECK(std::get<3>(b)[1].item<std::int64_t>(2) == -2);
  CHECK(std::get<4>(b).at("x").item<double>(2) == 2.0);
  // Every tensor lives in the one buffer, 64-byte aligned.
  for (const Tensor* t : std::initializer_list<const Tensor*>{&t0, &std::get<2>(b)[0], &std::get<4>(b).at("y")}) {
    CHECK(t->storage().data() == t0.storage().data());
    CHECK(reinterpret_cast<std::uintptr_t>(t->raw()) % 64 == 0);
  }
}

TEST_CASE("user structs collate through their field list", "[unit][collate]") {
  std::vector<Sample> samples{{Tensor::zeros(DType::Float32, {2, 2}), 3, "a"}, {Tensor::zeros(DType::Float32, {2, 2}), 4, "b"}};
  Batch b = collate(samples);
  CHECK(b.image.shape() == Shape{2, 2, 2});
  CHECK(b.label.item<std::int64_t>(1) == 4);
  CHECK(b.name[1] == "b");
}

TEST_CASE("mismatched samples are errors naming both samples", "[unit][collate][errors]") {
  std::vector<Tensor> rows{Tensor::zeros(DType::UInt8, {3, 4}), Tensor::zeros(DType::UInt8, {3, 4}),
                           Tensor::zeros(DType::UInt8, {3, 5})};
  std::vector<std::size_t> idx{40, 41, 42};
  CHECK_THROWS_WITH(collate(std::span<const Tensor>(rows), idx),
                    Catch::Contains("cannot stack sample 42 (uint8 [3, 5]) with sample 40 (uint8 [3, 4])"));
  std::vector<Tensor> dtypes{Tensor::zeros(DType::UInt8, {2}), Tensor::zeros(DType::Int8, {2})};
  CHECK_THROWS_WITH(collate(dtypes), Catch::Contains("(int8 [2]) with sample 0 (uint8 [2])"));
  std::vector<std::vector<int>> lens{{1, 2}, {1}};
  CHECK_THROWS_WITH(collate(lens), Catch::Contains("std::vector of sample 1 has 1 elements but sample 0 has 2"));
  std::vector<std::map<std::string, int>> keys{{{"a", 1}, {"b", 2}}, {{"a", 1}, {"c", 2}}};
  CHECK_THROWS_WITH(collate(keys), Catch::Contains("key 'b' is missing from sample 1"));
  CHECK_THROWS_WITH(collate(std::vector<Tensor>{}), Catch::Contains("empty batch"));
}

TEST_CASE("a large batch stacked by the parallel pool equals the serial result", "[unit][collate]") {
  std::vector<Tensor> rows;
  for (int r = 0; r < 64; ++r) {
    Tensor t = Tensor::empty(DType::UInt8, {256, 1024});
    std::memset(t.raw(), r, t.nbytes());
    rows.push_back(t);
  }
  std::vector<std::size_t> idx(64);
  ParallelFor pool(2);
  Tensor serial = collate(std::span<const Tensor>(rows), idx);
  Tensor parallel = collate(std::span<const Tensor>(rows), idx, pageable_allocator(), &pool);
  CHECK(parallel.equal(serial));
  CHECK(parallel.data<std::uint8_t>()[63 * 256 * 1024] == 63);
  std::vector<std::uint8_t> dst(8 << 20), src(8 << 20, 9);
  parallel_memcpy(dst.data(), src.data(), src.size(), &pool);
  CHECK(dst == src);
}
