// The device gather (Note [Device gather], ferry/pinning/gather.h) on the GPU: batches bitwise
// equal to the host path's for every row width (16-, 8-, 4- and 1-byte words, and rows of 64 KiB
// and more, which the copy engines move), any num_workers (none starts: the pin thread writes the indices),
// TensorDataset and a mapped .npy of 2 GiB; 100,000 batches intact and in order while the copy
// stream is delayed; registered memory constant, pinned and device memory recycled within the
// pipeline's depth; every
// registration undone when the loader goes, mid-epoch too, and kept while another loader uses it;
// small batches held for one launch, 6,144 rows of 32-bit index words, or 3,072 of 64-bit ones
// where a row is past 2^31.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "ferry/ferry.h"
#include "kernels.h"
#include "loaders/files.h"
#include "loaders/pattern_images.h"
#include "pipeline_depth.h"

using namespace ferry;

// The token options below are written with designated initializers, which GCC 12 reports under
// -Wextra for every member left to its default.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace {

// Fields of every word width the kernel picks: uint8 [3,16,16] (768 B rows: 16-byte words),
// int64 labels (8 B), float32 [7] (28 B: 4-byte words), uint8 [3] (3 B: bytes).
TensorDataset mixed(std::int64_t n) {
  Tensor img = Tensor::empty(DType::UInt8, {n, 3, 16, 16});
  Tensor label = Tensor::empty(DType::Int64, {n});
  Tensor feat = Tensor::empty(DType::Float32, {n, 7});
  Tensor odd = Tensor::empty(DType::UInt8, {n, 3});
  for (std::size_t i = 0; i < img.nbytes(); ++i)
    static_cast<std::uint8_t*>(img.raw())[i] = static_cast<std::uint8_t>(i * 131 + 7);
  for (std::int64_t i = 0; i < n; ++i) {
    label.data<std::int64_t>()[i] = i * 1000003;
    for (int k = 0; k < 7; ++k) feat.data<float>()[i * 7 + k] = static_cast<float>(i) + 0.125f * static_cast<float>(k);
    for (int k = 0; k < 3; ++k) odd.data<std::uint8_t>()[i * 3 + k] = static_cast<std::uint8_t>(i * 7 + k);
  }
  return TensorDataset({img, label, feat, odd});
}

DataLoaderOptions options(Gather g, int workers) {
  DataLoaderOptions o;
  o.batch_size = 64;
  o.shuffle = true;
  o.seed = 21;
  o.num_workers = workers;
  o.device = 0;
  o.gather = g;
  return o;
}

// Every batch of two epochs, brought back to the host.
template <class D>
std::vector<std::vector<Tensor>> epochs(D ds, const DataLoaderOptions& o, bool* gathered = nullptr) {
  DataLoader loader(std::move(ds), o);
  std::vector<std::vector<Tensor>> out;
  for (int e = 0; e < 2; ++e)
    for (auto& b : loader) {
      std::vector<Tensor> fields;
      if constexpr (std::is_same_v<std::decay_t<decltype(b)>, Tensor>) {
        fields.push_back(to_host(b, *loader.stream()).get());
      } else if constexpr (std::is_same_v<std::decay_t<decltype(b)>, LabeledBatch>) {
        for (const Tensor& t : {b.image, b.label}) {
          REQUIRE(t.device() == Device::cuda(0));
          fields.push_back(to_host(t, *loader.stream()).get());
        }
      } else {
        for (const Tensor& t : b) {
          REQUIRE(t.device() == Device::cuda(0));
          fields.push_back(to_host(t, *loader.stream()).get());
        }
      }
      out.push_back(std::move(fields));
    }
  if (gathered) *gathered = loader.stats().device_gather;
  return out;
}

void check_equal(const std::vector<std::vector<Tensor>>& a, const std::vector<std::vector<Tensor>>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].size() == b[i].size());
    for (std::size_t k = 0; k < a[i].size(); ++k) {
      REQUIRE(a[i][k].shape() == b[i][k].shape());
      REQUIRE(a[i][k].dtype() == b[i][k].dtype());
      REQUIRE(std::memcmp(a[i][k].raw(), b[i][k].raw(), a[i][k].nbytes()) == 0);
    }
  }
}

// One host array of `rows` rows of `row_bytes` for RowRegistration, its rows `shape` of `dtype`.
HostRows host_array(const Tensor& t, std::int64_t rows, std::size_t row_bytes, DType dtype, Shape shape, const char* name) {
  HostRows h;
  h.data = t.raw();
  h.rows = rows;
  h.row_bytes = row_bytes;
  h.dtype = dtype;
  h.row_shape = std::move(shape);
  h.name = name;
  return h;
}

}  // namespace

TEST_CASE("device gather: batches bitwise equal to the host path's, for any num_workers", "[gpu][gather]") {
  const TensorDataset ds = mixed(1000);  // 15 full batches and one of 40
  bool gathered = false, host_gathered = true;
  const auto host = epochs(ds, options(Gather::Host, 2), &host_gathered);
  CHECK_FALSE(host_gathered);
  for (int workers : {0, 3}) {
    INFO("num_workers " << workers);
    check_equal(epochs(ds, options(Gather::Device, workers), &gathered), host);
    CHECK(gathered);
  }
  // Auto takes it too; drop_last as well.
  check_equal(epochs(ds, options(Gather::Auto, 1), &gathered), host);
  CHECK(gathered);
  DataLoaderOptions d = options(Gather::Device, 2);
  d.drop_last = true;
  DataLoaderOptions h = options(Gather::Host, 2);
  h.drop_last = true;
  check_equal(epochs(ds, d), epochs(ds, h));
  // Batches larger than a launch's indices (DeviceStage::gather_index_in_launch) copy their
  // index to the device first: 10,000 rows in batches of 4,096 take both ways.
  const TensorDataset big = mixed(10000);
  DataLoaderOptions bd = options(Gather::Device, 2), bh = options(Gather::Host, 2);
  bd.batch_size = bh.batch_size = 4096;
  check_equal(epochs(big, bd), epochs(big, bh));
  // Rows of 72 KiB (the copy engines') beside int64 labels (the kernel's), in one batch.
  Tensor wide = Tensor::empty(DType::UInt8, {300, 3, 128, 192});
  Tensor ids = Tensor::empty(DType::Int64, {300});
  for (std::size_t i = 0; i < wide.nbytes(); ++i)
    static_cast<std::uint8_t*>(wide.raw())[i] = static_cast<std::uint8_t>(i * 29 + i / 4099);
  for (std::int64_t i = 0; i < 300; ++i) ids.data<std::int64_t>()[i] = 3 * i + 5;
  const TensorDataset rows_72k({wide, ids});
  const auto wide_host = epochs(rows_72k, options(Gather::Host, 2));
  for (int workers : {0, 2}) {
    INFO("72 KiB rows, num_workers " << workers);
    check_equal(epochs(rows_72k, options(Gather::Device, workers), &gathered), wide_host);
    CHECK(gathered);
  }
}

namespace {
// Threads of this process whose name starts with `prefix` (Linux: /proc/self/task/*/comm).
int threads_named(const std::string& prefix) {
  int n = 0;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(t.path() / "comm");
    std::string name;
    std::getline(in, name);
    n += name.rfind(prefix, 0) == 0;
  }
  return n;
}
}  // namespace

TEST_CASE("device gather: num_workers > 0 starts no worker; the pin thread writes the indices, the batches the host path's",
          "[gpu][gather]") {
  const TensorDataset ds = mixed(1000);
  const auto host = epochs(ds, options(Gather::Host, 2));
  for (const bool persistent : {false, true}) {
    INFO((persistent ? "persistent workers" : "workers each epoch"));
    DataLoaderOptions o = options(Gather::Device, 3);
    o.persistent_workers = persistent;
    auto inits = std::make_shared<std::atomic<int>>(0);
    o.worker_init_fn = [inits](const WorkerInfo&) { inits->fetch_add(1); };
    DataLoader loader(ds, o);
    std::vector<std::vector<Tensor>> got;
    for (int e = 0; e < 2; ++e) {
      for (auto& b : loader) {
        CHECK(threads_named("ferry-w") == 0);  // the engine's workers are ferry-w0, ferry-w1, ...
        std::vector<Tensor> fields;
        for (const Tensor& t : b) fields.push_back(to_host(t, *loader.stream()).get());
        got.push_back(std::move(fields));
      }
    }
    check_equal(got, host);
    CHECK(loader.stats().device_gather);
    CHECK(loader.stats().workers == 1);
    CHECK(inits->load() == 0);
  }
  // The host path, for contrast, starts its workers.
  DataLoader hosted(ds, options(Gather::Host, 3));
  auto it = hosted.begin();
  (void)(it != hosted.end());
  for (int k = 0; k < 400 && threads_named("ferry-w") < 3; ++k)  // each names itself as it starts
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(threads_named("ferry-w") == 3);
}

TEST_CASE("device gather: IdxDataset's images and labels, equal to the host path", "[gpu][gather][idx]") {
  test::TempDir dir;
  const std::uint32_t n = 1000;
  test::Bytes pixels(n * 28 * 28), labels(n);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = std::byte(static_cast<unsigned char>(i * 37 + i / 784));
  for (std::size_t i = 0; i < n; ++i) labels[i] = std::byte(static_cast<unsigned char>(i % 10));
  test::write_file(dir / "img.gz", test::gzip(test::idx_bytes(0x08, {n, 28, 28}, pixels)));
  test::write_file(dir / "lbl", test::idx_bytes(0x08, {n}, labels));
  const IdxDataset ds(dir / "img.gz", dir / "lbl");
  bool gathered = false, hosted = true;
  const auto device = epochs(ds, options(Gather::Auto, 0), &gathered);
  const auto host = epochs(ds, options(Gather::Host, 3), &hosted);
  CHECK(gathered);
  CHECK_FALSE(hosted);
  check_equal(device, host);
}

TEST_CASE("device gather: flips, to_float and normalize in the kernel, equal to the CPU transform", "[gpu][gather][idx]") {
  // Gray 28x28 (784 B rows: 16-byte words), RGB 5x7 (105 B rows: bytes) and RGB 8x8 and 40x48
  // (16-byte words), every output type, CHW and HWC; the flips drawn per (seed, epoch, index) as
  // the CPU transform draws them.
  const std::int64_t n = 1000;
  auto images = [&](std::int64_t h, std::int64_t w, std::int64_t c) { return test::pattern_images(n, h, w, c); };
  Tensor labels = Tensor::empty(DType::Int64, {n});
  for (std::int64_t i = 0; i < n; ++i) labels.data<std::int64_t>()[i] = i % 10;
  struct Case {
    const char* name;
    Tensor img;
    ImageTransform t;
  };
  std::vector<Case> cases;
  cases.push_back({"gray, flip + float + normalize (the demo)", images(28, 28, 0),
                   ImageTransform().horizontal_flip().to_float().normalize({0.286f}, {0.353f})});
  cases.push_back({"gray, flip only (uint8)", images(28, 28, 0), ImageTransform().horizontal_flip(0.3)});
  cases.push_back(
      {"rgb, bfloat16", images(5, 7, 3),
       ImageTransform().horizontal_flip().to_float(DType::BFloat16).normalize({0.4f, 0.5f, 0.6f}, {0.2f, 0.25f, 0.3f})});
  cases.push_back({"rgb, float16 channels_last", images(5, 7, 3),
                   ImageTransform().to_float(DType::Float16).channels_last().horizontal_flip()});
  cases.push_back({"rgb, float32, no flip", images(5, 7, 3), ImageTransform().to_float().normalize({0.5f}, {0.25f})});
  // 16-byte words through the kernel's shared-memory tiles: rows shorter than a block's step of
  // bytes (8x8x3: 192 B), and longer, with pixels split across tiles (40x48x3: 5,760 B).
  cases.push_back({"rgb 8x8, float32 CHW, flip + normalize", images(8, 8, 3),
                   ImageTransform().horizontal_flip().to_float().normalize({0.4f, 0.5f, 0.6f}, {0.2f, 0.25f, 0.3f})});
  cases.push_back({"rgb 40x48, float32 CHW, flip + normalize", images(40, 48, 3),
                   ImageTransform().horizontal_flip().to_float().normalize({0.4f, 0.5f, 0.6f}, {0.2f, 0.25f, 0.3f})});
  cases.push_back({"rgb 40x48, float16 channels_last, flip", images(40, 48, 3),
                   ImageTransform().to_float(DType::Float16).channels_last().horizontal_flip()});
  cases.push_back({"rgb 40x48, uint8 flip only", images(40, 48, 3), ImageTransform().horizontal_flip(0.5)});
  for (const Case& c : cases) {
    INFO(c.name);
    const IdxDataset ds(c.img, labels, {c.t});
    for (int workers : {0, 2}) {
      INFO(workers << " workers");
      bool gathered = false, hosted = true;
      const auto device = epochs(ds, options(Gather::Device, workers), &gathered);
      const auto host = epochs(ds, options(Gather::Host, 3), &hosted);
      CHECK(gathered);
      CHECK_FALSE(hosted);
      check_equal(device, host);
    }
  }
  // Batches larger than a launch's indices: the flips travel in the index copied to the device.
  const IdxDataset demo(cases[0].img, labels, {cases[0].t});
  DataLoaderOptions bd = options(Gather::Device, 2), bh = options(Gather::Host, 2);
  bd.batch_size = bh.batch_size = 4000;
  check_equal(epochs(demo, bd), epochs(demo, bh));
}

TEST_CASE("device gather: a mapped .npy of 2 GiB, equal to the host path", "[gpu][gather][npy]") {
  test::TempDir dir;
  const std::string path = dir / "big.npy";
  constexpr std::int64_t kRows = 32768, kCols = 65536;  // uint8 [32768, 65536]: 2 GiB
  {
    std::ofstream f(path, std::ios::binary);
    std::string header =
        "{'descr': '|u1', 'fortran_order': False, 'shape': (" + std::to_string(kRows) + ", " + std::to_string(kCols) + "), }";
    while ((10 + header.size() + 1) % 64) header += ' ';
    header += '\n';
    const std::uint16_t len = static_cast<std::uint16_t>(header.size());
    f.write("\x93NUMPY\x01\x00", 8);
    f.write(reinterpret_cast<const char*>(&len), 2);
    f << header;
    std::vector<char> row(kCols);
    for (std::int64_t i = 0; i < kRows; ++i) {
      for (std::int64_t c = 0; c < kCols; c += 4096) row[static_cast<std::size_t>(c)] = static_cast<char>(i * 31 + c / 4096);
      f.write(row.data(), kCols);
    }
  }
  NpyDataset npy(path);
  auto opts = [](Gather g) {
    DataLoaderOptions o;
    o.batch_size = 32;
    o.sampler = std::make_shared<RandomSampler>(static_cast<std::size_t>(kRows), 9, true, 40 * 32);
    o.num_workers = 2;
    o.device = 0;
    o.gather = g;
    return o;
  };
  bool gathered = false;
  check_equal(epochs(npy, opts(Gather::Device), &gathered), epochs(npy, opts(Gather::Host)));
  CHECK(gathered);
  CHECK(RowRegistration::registered_bytes_now() == 0);
}

namespace {

// Streams `batches` gathered batches of `batch` rows while a spin kernel on the copy stream delays
// every later gather; counts words that differ from the pattern and ids out of the sampler's order
// (both checked on the GPU, on the consumer's stream). A tight pinned pool makes large batches'
// index blocks (pinned, copied) come back all the time.
std::pair<unsigned long long, unsigned long long> delayed_run(int cols, std::int64_t batch, std::int64_t batches,
                                                              bool tight_pool) {
  const std::int64_t n = 4096;
  Tensor data = Tensor::empty(DType::Int32, {n, cols});
  Tensor index = Tensor::empty(DType::Int64, {n});
  for (std::int64_t i = 0; i < n; ++i) {
    index.data<std::int64_t>()[i] = i;
    for (int c = 0; c < cols; ++c) reinterpret_cast<std::uint32_t*>(data.raw())[i * cols + c] = test::pattern(i, c);
  }
  auto sampler = std::make_shared<RandomSampler>(static_cast<std::size_t>(n), 4, true, static_cast<std::size_t>(batches * batch));
  const std::vector<std::size_t> order = sampler->indices(0);
  Tensor want = Tensor::empty(DType::Int64, {static_cast<std::int64_t>(order.size())});
  for (std::size_t k = 0; k < order.size(); ++k) want.data<std::int64_t>()[k] = static_cast<std::int64_t>(order[k]);
  DataLoaderOptions o;
  o.batch_size = static_cast<std::size_t>(batch);
  o.sampler = sampler;
  o.num_workers = 2;
  o.device = 0;
  o.gather = Gather::Device;
  if (tight_pool) {
    PinnedPoolOptions po;
    po.limit_bytes = test::max_batches_alive(o) * static_cast<std::size_t>(batch) * 8;
    o.pinned_pool = std::make_shared<PinnedPool>(po);
  }
  DataLoader loader(TensorDataset({data, index}), o);
  auto* want_dev = static_cast<std::int64_t*>(cuda::device_alloc(want.nbytes()));
  cuda::memcpy_async(want_dev, want.raw(), want.nbytes(), cuda::CopyKind::HostToDevice, *loader.stream());
  unsigned long long* bad_rows = test::alloc_counter();
  unsigned long long* bad_order = test::alloc_counter();
  std::int64_t seen = 0;
  for (auto& b : loader) {
    test::launch_check(loader.stream()->native(), reinterpret_cast<const std::uint32_t*>(b[0].raw()),
                       static_cast<const std::int64_t*>(b[1].raw()), static_cast<int>(b[0].size(0)), cols, bad_rows);
    test::launch_count_differences(loader.stream()->native(), static_cast<const std::int64_t*>(b[1].raw()),
                                   want_dev + seen * batch, static_cast<int>(b[1].size(0)), bad_order);
    test::launch_spin(loader.device_stage()->copy_stream().native(), 20.0);  // the next gathers wait
    ++seen;
  }
  CHECK(seen == batches);
  CHECK(loader.stats().rows_gathered == static_cast<std::uint64_t>(2 * batches * batch));  // two fields a row
  const std::pair<unsigned long long, unsigned long long> bad{test::read_counter(bad_rows), test::read_counter(bad_order)};
  test::free_counter(bad_rows);
  test::free_counter(bad_order);
  cuda::device_free(want_dev);
  return bad;
}

}  // namespace

TEST_CASE("device gather: 100,000 batches intact and in order while the copy stream is delayed", "[gpu][gather][corruption]") {
  // Indices in the launch (16 rows a batch), and copied from recycled pinned blocks (4,096 rows).
  CHECK(delayed_run(1024, 16, 100000, false) == std::pair<unsigned long long, unsigned long long>{0, 0});
  CHECK(delayed_run(16, 4096, 2000, true) == std::pair<unsigned long long, unsigned long long>{0, 0});
  // Rows of 64 KiB go by the copy engines (cudaMemcpyBatchAsync), in the same stream order.
  CHECK(delayed_run(16384, 32, 3000, false) == std::pair<unsigned long long, unsigned long long>{0, 0});
}

TEST_CASE("device gather: memory recycled within the pipeline's depth; registrations undone, mid-epoch too, shared while used",
          "[gpu][gather][memory]") {
  const TensorDataset ds = mixed(2000);
  REQUIRE(RowRegistration::registered_bytes_now() == 0);
  {
    DataLoaderOptions o = options(Gather::Device, 2);
    o.persistent_workers = true;
    DataLoader loader(ds, o);
    const std::size_t registered = RowRegistration::registered_bytes_now();
    std::string why;
    CHECK(registered >= RowRegistration::bytes_needed(ds.host_rows(why)));
    std::uint64_t device_allocs = 0, pinned_allocs = 0;
    for (int epoch = 0; epoch < 5; ++epoch) {
      for (auto& b : loader) (void)b;
      if (epoch == 0) {
        device_allocs = loader.device_stage()->stats().device_allocations;
        pinned_allocs = loader.pinned_pool()->stats().allocations;
      }
    }
    const std::uint64_t d = loader.device_stage()->stats().device_allocations;
    CHECK(d >= device_allocs);
    CHECK(d <= test::max_device_buffers(o, test::gather_depth(o, 64 * (3 * 16 * 16 + 8 + 7 * 4 + 3))));
    const PinnedPoolStats pool = loader.pinned_pool()->stats();
    CHECK(pool.allocations >= pinned_allocs);
    CHECK(pool.frees == 0);
    CHECK(pool.blocks <= test::max_pinned_blocks(o, 1));  // one index block a batch
    CHECK(RowRegistration::registered_bytes_now() == registered);
    CHECK(loader.stats().device_gather);
    CHECK_THAT(loader.stats().report(), Catch::Contains("gather"));
  }
  CHECK(RowRegistration::registered_bytes_now() == 0);

  // Destroyed mid-epoch with batches held: the held batch stays readable, registrations go.
  Tensor held;
  {
    DataLoader loader(ds, options(Gather::Device, 3));
    auto it = loader.begin();
    ++it;
    held = (*it)[1];
  }
  CHECK(RowRegistration::registered_bytes_now() == 0);
  CHECK(to_host(held, cuda::Stream::create(0)).get().size(0) == 64);

  // Two loaders over the same arrays share one registration; the first one going leaves the
  // second's intact.
  auto first = std::make_unique<DataLoader<TensorDataset>>(ds, options(Gather::Device, 1));
  DataLoader second(ds, options(Gather::Device, 1));
  const auto host = epochs(ds, options(Gather::Host, 1));
  for (auto& b : *first) (void)b;
  first.reset();
  CHECK(RowRegistration::registered_bytes_now() > 0);
  std::vector<std::vector<Tensor>> got;
  for (int e = 0; e < 2; ++e)
    for (auto& b : second) {
      std::vector<Tensor> fields;
      for (const Tensor& t : b) fields.push_back(to_host(t, *second.stream()).get());
      got.push_back(std::move(fields));
    }
  check_equal(got, host);
}

TEST_CASE("device gather: small batches share a launch (end_held / issue_held), each equal to its own gather",
          "[gpu][gather][held]") {
  // The stage's protocol itself: three batches of different sizes held, then one launch; a batch
  // that does not fit the held launch is refused, the stage untouched, until issue_held().
  {  // (its registration gone before the loader's below: their pages could be neighbours)
    const std::int64_t n = 5000;
    Tensor rows = Tensor::empty(DType::Int32, {n, 5});  // 20-byte rows: 4-byte words
    Tensor label = Tensor::empty(DType::Int64, {n});
    for (std::int64_t i = 0; i < n; ++i) {
      label.data<std::int64_t>()[i] = 7 * i + 1;
      for (int c = 0; c < 5; ++c) rows.data<std::int32_t>()[i * 5 + c] = static_cast<std::int32_t>(i * 10 + c);
    }
    const std::vector<HostRows> arrays = {host_array(rows, n, 20, DType::Int32, {5}, "rows"),
                                          host_array(label, n, 8, DType::Int64, {}, "label")};
    RowRegistration reg(arrays, 0, std::size_t{1} << 30);
    DeviceStage stage;
    auto index_of = [](std::int64_t first, std::int64_t count) {
      Tensor t = Tensor::empty(DType::Int64, {count});
      for (std::int64_t k = 0; k < count; ++k) t.data<std::int64_t>()[k] = (first + k * 37) % 5000;
      return t;
    };
    struct Made {
      Tensor index, a, b;
    };
    auto make = [&](const Tensor& index) {
      const std::int64_t b = index.size(0);
      stage.begin(static_cast<std::size_t>(((b * 20 + 63) / 64 + (b * 8 + 63) / 64) * 64));
      Made m{index, stage.gather_rows(index, reg.device_rows(0), 20, DType::Int32, {5}),
             stage.gather_rows(index, reg.device_rows(1), 8, DType::Int64, {})};
      return m;
    };
    auto check = [&](const Made& m) {
      const Tensor a = to_host(m.a, stage.consumer_stream()).get(), b = to_host(m.b, stage.consumer_stream()).get();
      for (std::int64_t k = 0; k < m.index.size(0); ++k) {
        const std::int64_t i = m.index.data<std::int64_t>()[k];
        REQUIRE(b.data<std::int64_t>()[k] == 7 * i + 1);
        for (int c = 0; c < 5; ++c) REQUIRE(a.data<std::int32_t>()[k * 5 + c] == static_cast<std::int32_t>(i * 10 + c));
      }
    };
    std::vector<Made> held;
    for (std::int64_t count : {256, 3, 700, 2200}) {
      held.push_back(make(index_of(count, count)));
      REQUIRE(stage.end_held());
    }
    // 6,144 rows a launch while every row fits a 32-bit index word: 3,159 held, so 3,000 more
    // do not fit; alone they do.
    Made big = make(index_of(11, 3000));
    CHECK_FALSE(stage.end_held());
    const std::uint64_t launches = stage.stats().gather_launches;
    std::vector<std::shared_ptr<const EventFence>> fences = stage.issue_held();
    REQUIRE(fences.size() == 4);
    CHECK(stage.stats().gather_launches == launches + 1);
    // One launch, one event: its batches share a fence, which the consumer's stream waits on once.
    CHECK(fences[0] == fences[1]);
    CHECK(fences[1] == fences[2]);
    CHECK(fences[2] == fences[3]);
    // The next launch runs behind 20 ms of other work: its batch must wait for its own fence, not
    // pass with the one its consumer's stream waited on last.
    test::launch_spin(stage.copy_stream().native(), 20000.0);
    REQUIRE(stage.end_held());
    std::vector<std::shared_ptr<const EventFence>> more = stage.issue_held();
    REQUIRE(more.size() == 1);
    CHECK(more[0]->serial() != fences[0]->serial());
    CHECK(stage.issue_held().empty());
    test::launch_spin(stage.copy_stream().native(), 20000.0);  // later work on the copy stream must not matter
    for (std::size_t k = 0; k < held.size(); ++k) {
      stage.deliver(*fences[k]);
      check(held[k]);
    }
    stage.deliver(*more[0]);
    check(big);
    // A batch with a device index is never held.
    stage.begin(4096);
    const Tensor index_dev = stage.move(index_of(5, 10));
    (void)stage.gather_rows(index_dev, reg.device_rows(1), 8, DType::Int64, {});
    CHECK_FALSE(stage.end_held());
    stage.deliver(*stage.end());
    stage.consumer_stream().synchronize();
  }

  // Through the loader: with no workers the pin thread finds the next batches at hand and issues
  // them together; every batch still equals the host path's, the last (short) one too.
  const TensorDataset ds = mixed(1000);
  DataLoaderOptions o = options(Gather::Device, 0);
  o.batch_size = 16;
  DataLoaderOptions h = options(Gather::Host, 2);
  h.batch_size = 16;
  check_equal(epochs(ds, o), epochs(ds, h));
  DataLoader loader(ds, o);
  std::size_t batches = 0;
  for (auto& b : loader) {
    (void)b;
    ++batches;
  }
  const DeviceStageStats s = loader.device_stage()->stats();
  CHECK(s.batches == batches);
  CHECK(s.gather_launches < batches);
  CHECK(s.gather_launches > 0);
}

// A launch's indices travel as 32-bit words (the row, the flip in the top bit) while every row
// fits 31 bits, 6,144 of them; a row of 2^31 or more takes the 64-bit words, and the launch then
// holds 3,072. One-byte rows of a 2 GiB array, its last 4,096 rows past 2^31; only the rows read
// are written.
TEST_CASE("device gather: rows past 2^31 travel as 64-bit index words, 3,072 of them a launch", "[gpu][gather][held][wide]") {
  constexpr std::int64_t kWide = std::int64_t{1} << 31, n = kWide + 4096;
  Tensor bytes = Tensor::empty(DType::UInt8, {n});
  auto value = [](std::int64_t i) { return static_cast<std::uint8_t>(i * 131 + (i >> 31) * 7 + 3); };
  auto index_of = [&](std::int64_t count, std::int64_t first, bool wide) {
    Tensor t = Tensor::empty(DType::Int64, {count});
    for (std::int64_t k = 0; k < count; ++k) {
      // Every other row of a wide batch past 2^31; the flip bit set on some (a copied field ignores it).
      const std::int64_t row = wide && k % 2 ? kWide + (first + k * 7) % 4096 : (first + k * 37) % 100000;
      t.data<std::int64_t>()[k] = row | (k % 5 == 0 ? DeviceStage::gather_flip_bit : 0);
      bytes.data<std::uint8_t>()[row] = value(row);
    }
    return t;
  };
  RowRegistration reg({host_array(bytes, n, 1, DType::UInt8, {}, "bytes")}, 0, std::size_t{4} << 30);
  DeviceStage stage;
  struct Made {
    Tensor index, out;
  };
  auto make = [&](const Tensor& index) {
    stage.begin(static_cast<std::size_t>((index.size(0) + 63) / 64 * 64));
    return Made{index, stage.gather_rows(index, reg.device_rows(0), 1, DType::UInt8, {})};
  };
  auto check = [&](const Made& m) {
    const Tensor out = to_host(m.out, stage.consumer_stream()).get();
    for (std::int64_t k = 0; k < m.index.size(0); ++k) {
      const std::int64_t row = m.index.data<std::int64_t>()[k] & ~DeviceStage::gather_flip_bit;
      REQUIRE(out.data<std::uint8_t>()[k] == value(row));
    }
  };
  // Narrow, then wide: 3,000 rows held; 100 more no longer fit a launch of 64-bit words.
  Made a = make(index_of(2000, 1, false));
  REQUIRE(stage.end_held());
  Made b = make(index_of(1000, 5, true));
  REQUIRE(stage.end_held());
  Made c = make(index_of(100, 9, false));
  CHECK_FALSE(stage.end_held());
  const std::uint64_t launches = stage.stats().gather_launches;
  std::vector<std::shared_ptr<const EventFence>> first = stage.issue_held();
  REQUIRE(first.size() == 2);
  // After that launch the held one is narrow again: 100 + 3,000 + 3,000 rows fit, 45 more (6,145) do not.
  REQUIRE(stage.end_held());
  Made d = make(index_of(3000, 13, false));
  REQUIRE(stage.end_held());
  Made e = make(index_of(3000, 17, false));
  REQUIRE(stage.end_held());
  Made f = make(index_of(45, 19, false));
  CHECK_FALSE(stage.end_held());
  std::vector<std::shared_ptr<const EventFence>> second = stage.issue_held();
  REQUIRE(second.size() == 3);
  // A wide batch alone, at the most rows a batch may have.
  REQUIRE(stage.end_held());
  std::vector<std::shared_ptr<const EventFence>> third = stage.issue_held();
  REQUIRE(third.size() == 1);
  Made g = make(index_of(DeviceStage::gather_index_in_launch, 23, true));
  REQUIRE(stage.end_held());
  std::vector<std::shared_ptr<const EventFence>> fourth = stage.issue_held();
  REQUIRE(fourth.size() == 1);
  CHECK(stage.stats().gather_launches == launches + 4);
  stage.deliver(*fourth[0]);
  for (const Made* m : {&a, &b, &c, &d, &e, &f, &g}) check(*m);
  stage.consumer_stream().synchronize();
}

TEST_CASE("device gather: small batches share a device buffer, reused only behind the consumer's use of its last batch",
          "[gpu][gather][shared]") {
  // 16 ids a batch (int64 rows: row i holds i), 8 batches a shared buffer.
  const std::int64_t n = 4096, rows = 16;
  Tensor ids = Tensor::empty(DType::Int64, {n});
  for (std::int64_t i = 0; i < n; ++i) ids.data<std::int64_t>()[i] = i;
  RowRegistration reg({host_array(ids, n, 8, DType::Int64, {}, "ids")}, 0, std::size_t{1} << 30);
  DeviceStage stage;
  const std::size_t bytes = rows * 8;  // one 64-byte-aligned field
  // Batch k of round r gathers rows first(r, k) + 0..15; its expected ids wait on the device.
  auto first = [](int r, int k) { return static_cast<std::int64_t>((r * 8 + k) * 16 % 4000); };
  std::vector<std::int64_t*> want;
  for (int r = 0; r < 10; ++r)
    for (int k = 0; k < 8; ++k) {
      Tensor w = Tensor::empty(DType::Int64, {rows});
      for (std::int64_t j = 0; j < rows; ++j) w.data<std::int64_t>()[j] = first(r, k) + j;
      auto* d = static_cast<std::int64_t*>(cuda::device_alloc(w.nbytes()));
      cuda::memcpy_async(d, w.raw(), w.nbytes(), cuda::CopyKind::HostToDevice, stage.consumer_stream());
      want.push_back(d);
    }
  stage.consumer_stream().synchronize();
  unsigned long long* bad = test::alloc_counter();
  for (int r = 0; r < 10; ++r) {
    std::vector<Tensor> batch;
    for (int k = 0; k < 8; ++k) {
      Tensor index = Tensor::empty(DType::Int64, {rows});
      for (std::int64_t j = 0; j < rows; ++j) index.data<std::int64_t>()[j] = first(r, k) + j;
      stage.begin(bytes, true);
      batch.push_back(stage.gather_rows(index, reg.device_rows(0), 8, DType::Int64, {}));
      stage.deliver(*stage.end());
    }
    // One buffer holds the round's 8 batches, one after another.
    for (int k = 1; k < 8; ++k) {
      CHECK(batch[static_cast<std::size_t>(k)].storage().owner() == batch[0].storage().owner());
      CHECK(static_cast<const std::byte*>(batch[static_cast<std::size_t>(k)].raw()) ==
            static_cast<const std::byte*>(batch[static_cast<std::size_t>(k) - 1].raw()) + bytes);
    }
    // The consumer reads each batch 20 ms from now, then drops them all: the next round's gathers
    // into the same buffer must wait for those reads.
    test::launch_spin(stage.consumer_stream().native(), 20000.0);
    for (int k = 0; k < 8; ++k)
      test::launch_count_differences(stage.consumer_stream().native(),
                                     static_cast<const std::int64_t*>(batch[static_cast<std::size_t>(k)].raw()),
                                     want[static_cast<std::size_t>(r * 8 + k)], static_cast<int>(rows), bad);
  }
  CHECK(test::read_counter(bad) == 0);
  // The buffer came back each round (the stage moved on to a new one with its batches dropped).
  CHECK(stage.stats().device_allocations == 1);
  CHECK(stage.stats().batches == 80);
  // A batch begun unshared has a buffer of its own.
  {
    Tensor index = Tensor::empty(DType::Int64, {rows});
    for (std::int64_t j = 0; j < rows; ++j) index.data<std::int64_t>()[j] = j;
    stage.begin(bytes);
    const Tensor own = stage.gather_rows(index, reg.device_rows(0), 8, DType::Int64, {});
    stage.deliver(*stage.end());
    CHECK(stage.stats().device_allocations == 2);
    stage.consumer_stream().synchronize();
  }
  test::free_counter(bad);
  for (std::int64_t* d : want) cuda::device_free(d);
}

// Note [Token windows on the GPU] (ferry/loaders/tokens.h): windows of a mapped token file (uint16
// and uint32) and of a Megatron .bin in memory, ordered and random-offset, int64 and int32, raw:
// the device gather's batches equal the host path's; packed windows and a vocab_size check are
// refused under Gather::Device with their reason.
TEST_CASE("device gather: token windows equal the host path's", "[gpu][gather][tokens]") {
  test::TempDir dir;
  std::vector<std::uint16_t> narrow(50000);
  std::vector<std::uint32_t> wide(50000);
  for (std::size_t i = 0; i < narrow.size(); ++i) {
    narrow[i] = static_cast<std::uint16_t>((i * 7919 + 3) % 65536);  // ids past 32767: zero-extended
    wide[i] = static_cast<std::uint32_t>(i * 2654435761u);           // ids past 2^31
  }
  test::write_file(dir / "u16.bin", test::raw_bytes(narrow));
  test::write_file(dir / "u32.bin", test::raw_bytes(wide));
  const test::Bytes idx = test::megatron_idx_bytes(8, {20000, 30000}, {0, 40000}, {0, 1, 2});
  const test::Bytes bin = test::raw_bytes(narrow);
  std::vector<std::shared_ptr<const TokenCorpus>> corpora = {open_token_file(dir / "u16.bin", {.type = TokenType::UInt16}),
                                                             open_token_file(dir / "u32.bin", {.type = TokenType::UInt32}),
                                                             megatron_from_memory(idx, bin, "mem")};
  for (const auto& corpus : corpora)
    for (const TokenSequenceOptions& so :
         {TokenSequenceOptions{.seq_len = 128}, TokenSequenceOptions{.seq_len = 100, .random_offset = true},
          TokenSequenceOptions{.seq_len = 64, .dtype = DType::Int32}, TokenSequenceOptions{.seq_len = 96, .raw = true}}) {
      INFO(corpus->name() << " seq_len " << so.seq_len);
      const TokenSequences seqs(corpus, so);
      DataLoaderOptions o = options(Gather::Host, 2);
      o.batch_size = 24;
      bool gathered = true;
      const auto host = epochs(seqs, o, &gathered);
      CHECK_FALSE(gathered);
      o.gather = Gather::Device;
      check_equal(epochs(seqs, o, &gathered), host);
      CHECK(gathered);
    }
  {  // The GPU reads a copy of the mapped file, held while the loader lives (Note [Device gather], "mapped files").
    DataLoader loader(TokenSequences(corpora[0], {.seq_len = 128}), options(Gather::Device, 0));
    CHECK(RowRegistration::registered_bytes_now() == 100000);
  }
  CHECK(RowRegistration::registered_bytes_now() == 0);
  // Auto leaves a mapped file to the host path, as for a .npy.
  bool gathered = true;
  (void)epochs(TokenSequences(corpora[0], {.seq_len = 128}), options(Gather::Auto, 1), &gathered);
  CHECK_FALSE(gathered);
  auto refused = [&](std::shared_ptr<const TokenCorpus> c, TokenSequenceOptions so) {
    try {
      DataLoader loader(TokenSequences(std::move(c), so), options(Gather::Device, 0));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(refused(open_token_file(dir / "u16.bin", {.type = TokenType::UInt16, .eod = 7}), {.seq_len = 64, .packed = true}),
             Catch::Contains("gather = Device") && Catch::Contains("position_ids"));
  CHECK_THAT(refused(open_token_file(dir / "u16.bin", {.type = TokenType::UInt16, .vocab_size = 65536}), {.seq_len = 64}),
             Catch::Contains("vocab_size"));
  CHECK(RowRegistration::registered_bytes_now() == 0);
}
