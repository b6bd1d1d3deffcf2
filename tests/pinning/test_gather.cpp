// The device gather's decisions, without a GPU (Note [Device gather], ferry/pinning/gather.h):
// which datasets and options take it and the reason when not, the index batches it sends, and
// registration refused before any CUDA call or without CUDA. The GPU side: tests/gpu/test_gather.cpp.
#include <catch2/catch.hpp>

#include <cstring>

#include "ferry/ferry.h"

using namespace ferry;

namespace {

struct Squares {  // not rows of host arrays: computes its samples
  std::size_t size() const { return 10; }
  Tensor get(std::size_t i) const {
    Tensor t = Tensor::zeros(DType::Int64, {1});
    t.data<std::int64_t>()[0] = static_cast<std::int64_t>(i * i);
    return t;
  }
};

// A dataset that opts in but declines for a reason of its own.
struct Declines : DatasetBase<Declines> {
  std::size_t size() const { return 4; }
  Tensor get(std::size_t) const { return Tensor::zeros(DType::Int64, {1}); }
  std::vector<HostRows> host_rows(std::string& why) const {
    why = "its rows are computed";
    return {};
  }
};

DataLoaderOptions on_device(Gather g = Gather::Auto) {
  DataLoaderOptions o;
  o.device = 0;
  o.gather = g;
  return o;
}

template <class D, class Batch = std::vector<Tensor>>
std::string why_not(const D& ds, const DataLoaderOptions& o, bool default_collate = true) {
  std::vector<HostRows> rows;
  return detail::gather_unavailable<D, Batch>(o, default_collate, ds, rows);
}

}  // namespace

TEST_CASE("device gather: a TensorDataset's fields are its rows, in order", "[unit][gather]") {
  Tensor img = Tensor::zeros(DType::UInt8, {10, 3, 4, 5});
  Tensor label = Tensor::zeros(DType::Int64, {10});
  const TensorDataset ds({img, label});
  std::vector<HostRows> rows;
  const std::string why = detail::gather_unavailable<TensorDataset, std::vector<Tensor>>(on_device(), true, ds, rows);
  if (!DeviceStage::can_gather()) {
    CHECK_THAT(why, Catch::Contains("no gather kernel"));
    return;
  }
  CHECK(why.empty());
  REQUIRE(rows.size() == 2);
  CHECK(rows[0].data == img.raw());
  CHECK(rows[0].rows == 10);
  CHECK(rows[0].row_bytes == 60);
  CHECK(rows[0].row_shape == Shape{3, 4, 5});
  CHECK(rows[0].dtype == DType::UInt8);
  CHECK(rows[1].row_bytes == 8);
  CHECK(rows[1].row_shape.empty());
  CHECK_THAT(rows[1].name, Catch::Contains("tensor 1"));
}

TEST_CASE("device gather: an NpyDataset is one field of rows", "[unit][gather]") {
  Tensor a = Tensor::zeros(DType::Float32, {6, 7});
  const NpyDataset ds(a);
  std::string why;
  const std::vector<HostRows> rows = ds.host_rows(why);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].row_bytes == 28);
  CHECK(rows[0].rows == 6);
  CHECK(rows[0].row_shape == Shape{7});
  CHECK_FALSE(rows[0].mapped_file);  // an array in memory, not a file's mapping
}

TEST_CASE("device gather: where it does not apply, the reason says why", "[unit][gather]") {
  const TensorDataset ds({Tensor::zeros(DType::Int64, {10})});
  CHECK(why_not(ds, on_device(Gather::Host)) == "gather = Host");
  CHECK_THAT(why_not(ds, DataLoaderOptions{}), Catch::Contains("needs DataLoaderOptions::device"));
  CHECK_THAT((why_not<Squares, Tensor>(Squares{}, on_device())), Catch::Contains("not rows of host arrays"));
  CHECK_THAT(why_not(ds, on_device(), /*default_collate=*/false), Catch::Contains("collate_fn"));
  DataLoaderOptions alloc = on_device();
  alloc.allocator = std::make_shared<PinnedPool>(PinnedPoolOptions{.backend = pageable_backend_for_tests()});
  CHECK_THAT(why_not(ds, alloc), Catch::Contains("allocator"));
  CHECK_THAT((why_not<Declines, Tensor>(Declines{}, on_device())), Catch::Contains("its rows are computed"));
  // A one-Tensor batch from two fields, and a batch type the gather cannot build.
  const TensorDataset two({Tensor::zeros(DType::Int64, {10}), Tensor::zeros(DType::Int64, {10})});
  CHECK_THAT((why_not<TensorDataset, Tensor>(two, on_device())), Catch::Contains("gave 2 fields"));
  struct Pair {
    Tensor a, b;
  };
  CHECK_THAT((why_not<TensorDataset, Pair>(ds, on_device())), Catch::Contains("neither a Tensor"));
  // A FieldsBatch (LabeledBatch: image, label) needs as many fields as it has.
  if (DeviceStage::can_gather())
    CHECK_THAT((why_not<TensorDataset, LabeledBatch>(ds, on_device())),
               Catch::Contains("batch has 2 fields but host_rows() gave 1"));
}

TEST_CASE("device gather: a batch's indices in one int64 block; an index past the end is an error", "[unit][gather]") {
  const std::vector<std::size_t> idx{7, 0, 3, 9};
  Tensor t = detail::gather_index(idx, 10, pageable_allocator());
  REQUIRE(t.dtype() == DType::Int64);
  REQUIRE(t.size(0) == 4);
  for (std::size_t k = 0; k < idx.size(); ++k) CHECK(t.data<std::int64_t>()[k] == static_cast<std::int64_t>(idx[k]));
  const std::vector<std::size_t> bad{1, 10};
  CHECK_THROWS_WITH(detail::gather_index(bad, 10, pageable_allocator()),
                    Catch::Contains("index 10 out of range for a dataset of 10 samples") && Catch::Contains("position 1"));
  // Longer batches: the check runs four lanes at a time, then the rest one by one.
  std::vector<std::size_t> many(11);
  for (std::size_t k = 0; k < many.size(); ++k) many[k] = (k * 7) % 10;
  Tensor m = detail::gather_index(many, 10, pageable_allocator());
  for (std::size_t k = 0; k < many.size(); ++k) CHECK(m.data<std::int64_t>()[k] == static_cast<std::int64_t>(many[k]));
  for (std::size_t at : {std::size_t{2}, std::size_t{6}, std::size_t{10}}) {
    std::vector<std::size_t> one_bad = many;
    one_bad[at] = 12;
    CHECK_THROWS_WITH(detail::gather_index(one_bad, 10, pageable_allocator()),
                      Catch::Contains("index 12 out of range") && Catch::Contains("position " + std::to_string(at) + " "));
  }
}

TEST_CASE("device gather: registration over the budget is refused before CUDA, and without CUDA clearly", "[unit][gather]") {
  Tensor a = Tensor::zeros(DType::UInt8, {1000, 100});
  std::string why;
  const std::vector<HostRows> rows = TensorDataset({a}).host_rows(why);
  // Two arrays in one buffer share their pages: registered once.
  Tensor whole = Tensor::zeros(DType::UInt8, {2, 50000});
  const std::vector<HostRows> halves{{whole.raw(), 1, 50000, DType::UInt8, {50000}, "first", false, std::nullopt, std::nullopt},
                                     {static_cast<std::byte*>(whole.raw()) + 50000,
                                      1,
                                      50000,
                                      DType::UInt8,
                                      {50000},
                                      "second",
                                      false,
                                      std::nullopt,
                                      std::nullopt}};
  const std::size_t page = RowRegistration::bytes_needed({halves[0]}) > 50000 ? 4096 : 0;
  CHECK(RowRegistration::bytes_needed(halves) <= 100000 + 2 * page);
  CHECK(RowRegistration::bytes_needed(halves) <
        RowRegistration::bytes_needed({halves[0]}) + RowRegistration::bytes_needed({halves[1]}));
  CHECK_THROWS_WITH(RowRegistration(rows, 0, 1000),
                    Catch::Contains("over the limit of 1000") && Catch::Contains("register_memory_limit"));
  if (!cuda::available()) {
    CHECK_THROWS_AS(RowRegistration(rows, 0, std::size_t{1} << 30), CudaError);
    CHECK(RowRegistration::registered_bytes_now() == 0);
  }
}

TEST_CASE("device gather: gather = Device where it cannot apply is an Error naming the reason", "[unit][gather]") {
  DataLoaderOptions o;
  o.gather = Gather::Device;  // and no device
  CHECK_THROWS_WITH(DataLoader(TensorDataset({Tensor::zeros(DType::Int64, {4})}), o),
                    Catch::Contains("gather = Device cannot make this loader's batches") && Catch::Contains("device"));
  // gather = Host, and Auto without a device, make host batches as always.
  for (Gather g : {Gather::Host, Gather::Auto}) {
    DataLoaderOptions h;
    h.gather = g;
    h.batch_size = 2;
    DataLoader loader(TensorDataset({Tensor::zeros(DType::Int64, {4})}), h);
    std::size_t n = 0;
    for (auto& b : loader) n += static_cast<std::size_t>(b[0].size(0));
    CHECK(n == 4);
    CHECK_FALSE(loader.stats().device_gather);
  }
}

TEST_CASE("device gather: a type-erased dataset (the registry's) passes its rows on, or says why not", "[unit][gather]") {
  Tensor a = Tensor::zeros(DType::Float32, {6, 7});
  const AnyDataset<std::vector<Tensor>> rows_of(TensorDataset({a}));
  std::string why;
  const std::vector<HostRows> rows = rows_of.host_rows(why);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].data == a.raw());
  struct Pairs {
    std::size_t size() const { return 3; }
    std::vector<Tensor> get(std::size_t) const { return {Tensor::zeros(DType::Int64, {1})}; }
  };
  const AnyDataset<std::vector<Tensor>> computed(Pairs{});
  CHECK(computed.host_rows(why).empty());
  CHECK_THAT(why, Catch::Contains("not rows of host arrays"));
}
