// GPU tests (run by scripts/gpu.sh on the GPU machine with FERRY_REQUIRE_GPU=1): no batch is
// corrupted by pinned-block reuse over 100,000 batches while a slow kernel delays the copy stream,
// and the same run with fences ignored is caught; copies overlap compute; custom batch types reach
// the GPU intact; pinned and device memory stay constant after warm-up.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>

#include "ferry/ferry.h"
#include "kernels.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kCols = 4096;

// Sample i: kCols words of pattern(i, c), and its index.
struct Patterned {
  std::size_t n;
  std::size_t size() const { return n; }
  std::pair<Tensor, std::int64_t> get(std::size_t i) const {
    Tensor t = Tensor::empty(DType::Int32, {kCols});
    auto* p = reinterpret_cast<std::uint32_t*>(t.raw());
    for (int c = 0; c < kCols; ++c) p[c] = test::pattern(static_cast<std::int64_t>(i), c);
    return {t, static_cast<std::int64_t>(i)};
  }
};

// Streams batches to the GPU while a spin kernel on the copy stream delays every copy; returns
// the number of words that reached the GPU different from what the dataset produced.
unsigned long long corruption_run(std::size_t batches, bool ignore_fences, DataLoaderOptions::PinMode mode) {
  constexpr std::size_t kBatch = 16;
  PinnedPoolOptions po;
  // As few blocks as the pipeline's depth allows, so blocks are reused all the time: copy mode
  // holds pin_depth + device_prefetch + 2 = 6, direct mode adds prefetch_factor x num_workers = 8.
  po.limit_bytes = (mode == DataLoaderOptions::PinMode::Copy ? 6 : 14) * (kBatch * kCols * 4 + 4096);
  po.ignore_fences_unsafe = ignore_fences;
  auto pool = std::make_shared<PinnedPool>(po);
  DataLoaderOptions o;
  o.batch_size = kBatch;
  o.num_workers = 4;
  o.device = 0;
  o.pinned_pool = pool;
  o.pin_mode = mode;
  DataLoader loader(Patterned{batches * kBatch}, o);
  unsigned long long* bad = test::alloc_counter();
  std::size_t seen = 0;
  for (auto& [data, index] : loader) {
    REQUIRE(data.device() == Device::cuda(0));
    test::launch_check(loader.stream()->native(), reinterpret_cast<const std::uint32_t*>(data.raw()),
                       static_cast<const std::int64_t*>(index.raw()), static_cast<int>(data.size(0)), kCols, bad);
    test::launch_spin(loader.device_stage()->copy_stream().native(), 20.0);  // the next copies wait
    ++seen;
  }
  const unsigned long long mismatches = test::read_counter(bad);
  test::free_counter(bad);
  CHECK(seen == batches);
  return mismatches;
}

}  // namespace

TEST_CASE("100,000 batches reach the GPU intact while the copy stream is delayed", "[gpu][corruption]") {
  CHECK(corruption_run(100000, false, DataLoaderOptions::PinMode::Copy) == 0);
  CHECK(corruption_run(20000, false, DataLoaderOptions::PinMode::Direct) == 0);
}

TEST_CASE("the corruption test catches pinned blocks reused before their copy finished", "[gpu][corruption]") {
  // The same pipeline with the pool told to ignore fences: the test must see corruption, proving
  // it can catch the bug the fences prevent.
  CHECK(corruption_run(5000, true, DataLoaderOptions::PinMode::Copy) > 0);
}

TEST_CASE("a copy on the side stream overlaps a kernel on the compute stream", "[gpu][overlap]") {
  auto pool = std::make_shared<PinnedPool>(PinnedPoolOptions{});
  DeviceStage stage({}, pool);
  const std::size_t bytes = std::size_t{512} << 20;
  Tensor host(pool->allocate(bytes), DType::UInt8, {static_cast<std::int64_t>(bytes)});
  std::memset(host.raw(), 7, bytes);
  auto time = [&](auto&& body) {
    const auto t0 = Clock::now();
    body();
    stage.copy_stream().synchronize();
    stage.consumer_stream().synchronize();
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  (void)time([&] { (void)stage.to_device(host); });  // warm-up: device buffer allocated
  const double copy_ms = time([&] { (void)stage.to_device(host); });
  // A spin three times as long as the copy, on the consumer stream, then the copy on the copy
  // stream: on the GPU's own clock (events), the copy ends before the kernel does when they run
  // together; a copy made to wait for the kernel ends after it (an order, with a 3x margin, not a
  // speed).
  void* const consumer = stage.consumer_stream().native();
  void* const side = stage.copy_stream().native();
  void* kernel_start = test::record_event(consumer);
  test::launch_spin(consumer, 3 * copy_ms * 1000);
  void* kernel_end = test::record_event(consumer);
  void* copy_start = test::record_event(side);
  (void)stage.to_device(host);
  void* copy_end = test::record_event(side);
  const double copy_end_to_kernel_end = test::event_ms(copy_end, kernel_end);
  WARN("copy alone " << copy_ms << " ms (" << bytes / copy_ms / 1e6 << " GB/s); beside a " << 3 * copy_ms
                     << " ms kernel it ran from " << test::event_ms(kernel_start, copy_start) << " to "
                     << test::event_ms(kernel_start, copy_end) << " ms of the kernel's "
                     << test::event_ms(kernel_start, kernel_end) << " ms");
  CHECK(copy_end_to_kernel_end > 0);  // the copy ended while the kernel still ran
  for (void* e : {kernel_start, kernel_end, copy_start, copy_end}) test::destroy_event(e);
}

namespace {
struct CustomBatch {
  Tensor x, y;
  void pin_memory(PinContext& ctx) {
    x = ctx.pin(x);
    y = ctx.pin(y);
  }
};
struct Rows {
  std::size_t size() const { return 1000; }
  std::int64_t get(std::size_t i) const { return static_cast<std::int64_t>(i); }
};
}  // namespace

TEST_CASE("custom batch types reach the GPU intact; device-to-host copies synchronize", "[gpu][custom]") {
  DataLoaderOptions o;
  o.batch_size = 32;
  o.num_workers = 2;
  o.shuffle = true;
  o.device = 0;
  DataLoader loader(Rows{}, o, [](std::vector<std::int64_t>&& s) {
    Tensor x = Tensor::empty(DType::Float32, {static_cast<std::int64_t>(s.size()), 3});
    for (std::size_t r = 0; r < s.size(); ++r)
      for (int k = 0; k < 3; ++k) x.data<float>()[r * 3 + k] = static_cast<float>(s[r] * 3 + k);
    return CustomBatch{x, collate(s)};
  });
  std::size_t batches = 0;
  for (CustomBatch& b : loader) {
    REQUIRE(b.x.device() == Device::cuda(0));
    REQUIRE(b.y.device() == Device::cuda(0));
    Tensor x = to_host(b.x, *loader.stream()).get();
    Tensor y = to_host(b.y, *loader.stream()).get();
    CHECK(x.is_pinned());
    for (std::int64_t r = 0; r < y.numel(); ++r)
      for (int k = 0; k < 3; ++k) REQUIRE(x.item<float>(r * 3 + k) == static_cast<float>(y.item<std::int64_t>(r) * 3 + k));
    ++batches;
  }
  CHECK(batches == 32);
}

TEST_CASE("pinned and device memory stay constant after the first epoch", "[gpu][pool]") {
  DataLoaderOptions o;
  o.batch_size = 64;
  o.num_workers = 2;
  o.device = 0;
  DataLoader loader(Patterned{64 * 50}, o);
  std::uint64_t host_allocs = 0, device_allocs = 0;
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (auto& b : loader) (void)b;
    if (epoch == 0) {
      host_allocs = loader.pinned_pool()->stats().allocations;
      device_allocs = loader.device_stage()->stats().device_allocations;
    }
  }
  CHECK(loader.pinned_pool()->stats().allocations == host_allocs);
  CHECK(loader.device_stage()->stats().device_allocations == device_allocs);
  CHECK(loader.device_stage()->stats().copies == loader.device_stage()->stats().batches);  // packed: one copy a batch
}

TEST_CASE("direct-mode batches built from several pinned blocks reach the GPU intact", "[gpu][custom]") {
  // IdxDataset's make_batch leases one block for the images and one for the labels; blocks can
  // be adjacent in memory, and packing them into one copy across two cudaHostAlloc allocations
  // is an invalid copy. Each sample's label is its first pixel, so pairing is checked too.
  constexpr std::int64_t kN = 4096;
  Tensor images = Tensor::empty(DType::UInt8, {kN, 28, 28});
  Tensor labels = Tensor::empty(DType::Int64, {kN});
  for (std::int64_t i = 0; i < kN; ++i) {
    std::fill_n(images.data<std::uint8_t>() + i * 784, 784, static_cast<std::uint8_t>(i % 251));
    labels.data<std::int64_t>()[i] = i % 251;
  }
  DataLoaderOptions o;
  o.batch_size = 128;
  o.shuffle = true;
  o.num_workers = 4;
  o.device = 0;
  DataLoader loader(IdxDataset(images, labels), o);
  STATIC_REQUIRE(decltype(loader)::direct());
  std::size_t batches = 0;
  for (LabeledBatch& b : loader) {
    Tensor x = to_host(b.image, *loader.stream()).get();
    Tensor y = to_host(b.label, *loader.stream()).get();
    for (std::int64_t r = 0; r < y.numel(); ++r) REQUIRE(x.data<std::uint8_t>()[r * 784 + 783] == y.item<std::int64_t>(r));
    ++batches;
  }
  CHECK(batches == kN / 128);
}
