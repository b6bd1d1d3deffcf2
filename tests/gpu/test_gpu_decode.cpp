// GPU decode (ImageFolderOptions::decode = Gpu): every image of a generated JPEG set, decoded by
// nvJPEG and transformed by the fused kernel, matches the CPU path (TurboJPEG + ImageTransform)
// with the same crops and flips, within the two decoders' difference; a damaged JPEG is a
// DataError at its batch and the next batches are intact; 100,000 images go through with device
// and pinned memory recycled within the pipeline's depth and the decoder's own memory constant
// after warm-up.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <stdlib.h>

#include "ferry/ferry.h"
#include "gpu_decode.h"
#include "kernels.h"
#include "loaders/files.h"
#include "pipeline_depth.h"

using namespace ferry;
using namespace ferry::test;

namespace {

// A smooth image with some texture, so decoders agree closely but a wrong crop or flip shows.
Bytes photo_like(int w, int h, int seed, int quality, bool gray = false) {
  const int c = gray ? 1 : 3;
  std::vector<std::uint8_t> p(static_cast<std::size_t>(w * h * c));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int k = 0; k < c; ++k)
        p[static_cast<std::size_t>((y * w + x) * c + k)] =
            static_cast<std::uint8_t>(128 + 90 * std::sin(0.05 * x + 0.031 * y * (k + 1) + seed) * std::cos(0.021 * (x - y) + k));
  return encode_jpeg(p, w, h, c, quality);
}

void make_folder(const TempDir& dir, int per_class) {
  for (int label = 0; label < 4; ++label)
    for (int k = 0; k < per_class; ++k) {
      const int w = 64 + 37 * ((k + label) % 7), h = 48 + 29 * ((k * 3 + label) % 5);  // odd sizes too
      write_file(dir / ("root/c" + std::to_string(label) + "/" + std::to_string(k) + ".jpg"),
                 photo_like(w, h, k * 4 + label, 80 + (k % 3) * 8, /*gray=*/k % 11 == 5));
    }
}

ImageFolderOptions train_options(ImageFolderOptions::Decode decode) {
  ImageFolderOptions o;
  o.transform.random_resized_crop(56, 56).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                 {0.229f, 0.224f, 0.225f});
  o.decode = decode;
  return o;
}

DataLoaderOptions loader_options(int workers) {
  DataLoaderOptions o;
  o.batch_size = 16;
  o.shuffle = true;
  o.seed = 42;
  o.num_workers = workers;
  o.device = 0;
  return o;
}

Tensor host_copy(const Tensor& t, const cuda::Stream& s) { return to_host(t, s).get(); }

}  // namespace

TEST_CASE("GPU-decoded batches match the CPU path for every image", "[gpu][decode]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 30);
  ImageFolder cpu(dir / "root", train_options(ImageFolderOptions::Decode::Cpu));
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  DataLoader cpu_loader(cpu, loader_options(2));
  DataLoaderOptions two = loader_options(3);
  two.gpu_decode_threads = 2;  // more than the default: batches decoded at once still land in order
  DataLoader gpu_loader(gpu, two);
  auto a = cpu_loader.begin();
  auto b = gpu_loader.begin();
  double sum = 0, worst = 0;
  std::size_t values = 0, images = 0;
  for (; a != cpu_loader.end(); ++a, ++b) {
    const bool more = b != gpu_loader.end();
    REQUIRE(more);
    LabeledBatch& x = *a;
    LabeledBatch& y = *b;
    REQUIRE(y.image.device().kind == MemoryKind::Device);
    REQUIRE_FALSE(y.encoded.defined());
    REQUIRE(x.image.shape() == y.image.shape());
    const Tensor xi = host_copy(x.image, *cpu_loader.stream()), yi = host_copy(y.image, *gpu_loader.stream());
    const Tensor xl = host_copy(x.label, *cpu_loader.stream()), yl = host_copy(y.label, *gpu_loader.stream());
    for (std::int64_t r = 0; r < xl.numel(); ++r) REQUIRE(xl.data<std::int64_t>()[r] == yl.data<std::int64_t>()[r]);
    for (std::int64_t k = 0; k < xi.numel(); ++k) {
      const double d = std::abs(static_cast<double>(xi.data<float>()[k]) - yi.data<float>()[k]) * 0.226 * 255;  // in pixel units
      sum += d;
      worst = std::max(worst, d);
    }
    values += static_cast<std::size_t>(xi.numel());
    images += static_cast<std::size_t>(xl.numel());
  }
  const bool done = b == gpu_loader.end();
  CHECK(done);
  CHECK(images == 120);
  CHECK(gpu_loader.stats().decode_threads == 2);
  const double mean = sum / static_cast<double>(values);
  std::printf("GPU decode vs CPU path over %zu images (backend %s): mean |diff| %.3f, max %.2f (pixel units)\n", images,
              gpu_loader.device_stage()->decode_backend().c_str(), mean, worst);
  // The crops, flips and resampling are the same computation (bit-identical on the same pixels,
  // tests/loaders/test_transforms.cpp); what differs is nvJPEG's IDCT and chroma upsampling.
  CHECK(mean < 1.5);
  CHECK(worst < 48);
  // The comparison can fail: another seed's crops differ.
  DataLoaderOptions other = loader_options(3);
  other.seed = 43;
  DataLoader gpu_other(gpu, other);
  DataLoader cpu_again(cpu, loader_options(2));
  auto c = cpu_again.begin();
  auto d = gpu_other.begin();
  const Tensor ci = host_copy(c->image, *cpu_again.stream()), di = host_copy(d->image, *gpu_other.stream());
  double other_sum = 0;
  for (std::int64_t k = 0; k < ci.numel(); ++k) other_sum += std::abs(ci.data<float>()[k] - di.data<float>()[k]);
  CHECK(other_sum / static_cast<double>(ci.numel()) * 0.226 * 255 > 5);
}

// nvJPEG's hardware backend writes its output during the call, not in its stream's order (Note
// [Decode threads] in pinning/gpu_decode.cu): a decode must not reuse a scratch that a kernel queued
// earlier still reads. Here each batch's consumer fills every SM for about 15 ms, so the fused
// kernels of the batches decoded meanwhile wait for SMs while the next decodes are issued.
TEST_CASE("GPU decode beside a step that fills every SM: every batch still equals the CPU path", "[gpu][decode][order]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 24);
  ImageFolder cpu(dir / "root", train_options(ImageFolderOptions::Decode::Cpu));
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  const int threads = GENERATE(1, 2);  // decode threads: one scratch reused, and two in turn
  INFO("decode threads: " << threads);
  DataLoaderOptions o = loader_options(2);
  o.batch_size = 8;
  o.persistent_workers = true;
  o.gpu_decode_threads = threads;
  DataLoader cpu_loader(cpu, o);
  DataLoader gpu_loader(gpu, o);
  // The step: full blocks of arithmetic on every SM, about 15 ms.
  const cuda::Stream& s = *gpu_loader.stream();
  long long iters = 20000;
  for (int k = 0; k < 3; ++k) {
    cuda::Event e0 = cuda::Event::create(s.device(), true), e1 = cuda::Event::create(s.device(), true);
    e0.record(s);
    test::launch_work(s.native(), iters, 8);
    e1.record(s);
    e1.synchronize();
    iters = static_cast<long long>(static_cast<double>(iters) * 15.0 / std::max(cuda::Event::elapsed_ms(e0, e1), 0.01));
  }
  double sum = 0, worst = 0;
  std::size_t values = 0, batches = 0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<Tensor> got;  // copied after each step, compared once the epoch is through
    for (LabeledBatch& b : gpu_loader) {
      test::launch_work(s.native(), iters, 8);
      got.push_back(to_host(b.image, s).get());
    }
    std::size_t i = 0;
    for (LabeledBatch& b : cpu_loader) {
      REQUIRE(i < got.size());
      const Tensor want = host_copy(b.image, *cpu_loader.stream());
      REQUIRE(want.shape() == got[i].shape());
      for (std::int64_t k = 0; k < want.numel(); ++k) {
        const double d = std::abs(static_cast<double>(want.data<float>()[k]) - got[i].data<float>()[k]) * 0.226 * 255;
        sum += d;
        worst = std::max(worst, d);
      }
      values += static_cast<std::size_t>(want.numel());
      ++i;
    }
    CHECK(i == got.size());
    batches += i;
  }
  CHECK(batches == 24);
  CHECK(gpu_loader.device_stage()->stats().images_decoded >= 192);  // decoded on the GPU
  std::printf("GPU decode beside a full-SM step, %d decode thread(s), %zu batches: mean |diff| %.3f, max %.2f (pixel units)\n",
              threads, batches, sum / static_cast<double>(values), worst);
  CHECK(sum / static_cast<double>(values) < 1.5);  // as in the first test: nvJPEG's IDCT differs a little
  CHECK(worst < 48);
}

// Note [Decode threads] in pinning/gpu_decode.cu: a decode thread that opened its nvJPEG state
// while another decoded on the hardware backend could deadlock both (bench_object_store saw it in
// about one loader in three). Loaders made one after another, two decode threads each, each one
// epoch: every one must finish (a hang here ends the test at its time limit).
TEST_CASE("GPU decode: loaders started one after another, two decode threads each, all finish their epoch",
          "[gpu][decode][start]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 40);  // 160 images, 10 batches
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  DataLoaderOptions o = loader_options(2);
  o.gpu_decode_threads = 2;
  for (int k = 0; k < 12; ++k) {
    INFO("loader " << k);
    DataLoader loader(gpu, o);
    std::int64_t images = 0;
    for (LabeledBatch& b : loader) images += b.label.numel();
    loader.stream()->synchronize();
    CHECK(images == 160);
    CHECK(loader.stats().decode_threads == 2);
  }
}

// Note [A decode that never returns] in pinning/gpu_decode.cu. FERRY_TEST_GPU_DECODE_STALL_MS holds
// the decoder's third decode (batch 2, with one decode thread) before it calls nvJPEG, as a call
// that does not come back would. The variable is read when the decoder starts (the first batch).
namespace {
struct StalledDecodes {
  explicit StalledDecodes(int ms) { ::setenv("FERRY_TEST_GPU_DECODE_STALL_MS", std::to_string(ms).c_str(), 1); }
  ~StalledDecodes() { ::unsetenv("FERRY_TEST_GPU_DECODE_STALL_MS"); }
};

std::vector<std::vector<std::int64_t>> labels_of(DataLoader<ImageFolder>& loader) {
  std::vector<std::vector<std::int64_t>> out;
  for (LabeledBatch& b : loader) {
    const Tensor l = to_host(b.label, *loader.stream()).get();
    out.emplace_back(l.data<std::int64_t>(), l.data<std::int64_t>() + l.numel());
  }
  return out;
}
}  // namespace

TEST_CASE("GPU decode held up: the consumer's wait polls, is interrupted and loses no batch", "[gpu][decode][stuck]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 20);  // 80 images, 5 batches
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  DataLoaderOptions o = loader_options(2);
  o.gpu_decode_threads = 1;
  DataLoader reference(gpu, o);
  const auto expected = labels_of(reference);
  REQUIRE(expected.size() == 5);
  // After the first batch (the decoder's start), the poll interrupts a wait once it has lasted
  // 200 ms (40 polls), twice in all: only the held decode makes a wait that long.
  std::atomic<int> polls{0}, interruptions{0};
  std::atomic<bool> armed{false};
  o.wait_poll = [&] {
    if (!armed.load() || ++polls < 40 || interruptions.load() >= 2) return false;
    polls = 0;
    ++interruptions;
    return true;
  };
  o.wait_poll_period = std::chrono::milliseconds(5);
  StalledDecodes stall(1500);
  DataLoader loader(gpu, o);
  std::vector<std::vector<std::int64_t>> got;
  std::vector<std::size_t> interrupted_at;
  auto it = loader.begin();
  for (bool more = true; more;) {
    try {
      more = it != loader.end();
      if (!more) break;
      const Tensor l = to_host(it->label, *loader.stream()).get();
      got.emplace_back(l.data<std::int64_t>(), l.data<std::int64_t>() + l.numel());
      polls = 0;
      armed = true;
      ++it;
    } catch (const Interrupted&) {
      interrupted_at.push_back(got.size());
      CHECK(loader.state().batches == got.size());  // none taken
    }
  }
  REQUIRE(interrupted_at.size() == 2);
  CHECK(interrupted_at[0] == interrupted_at[1]);  // both in the held batch's wait
  CHECK(interrupted_at[0] >= 2);                  // the decoder's third decode or later
  CHECK(got == expected);                         // every batch, in order
}

TEST_CASE("GPU decode that does not come back: TimeoutError at its batch, and the loader's destruction leaves it",
          "[gpu][decode][stuck]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 20);
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  DataLoaderOptions o = loader_options(2);
  o.gpu_decode_threads = 1;
  o.timeout = std::chrono::milliseconds(1500);  // twice that, past the decoder's start (nvJPEG's handles, on the pin thread)
  const auto held = std::chrono::milliseconds(static_cast<int>(detail::GpuJpegDecoder::kStuckDecodeSeconds * 1000) +
                                              5000);  // past stop()'s patience
  const auto t0 = std::chrono::steady_clock::now();
  {
    StalledDecodes stall(static_cast<int>(held.count()));
    DataLoader loader(gpu, o);
    auto it = loader.begin();
    std::size_t taken = 0;
    std::string what;
    try {
      for (; it != loader.end(); ++it) {
        CHECK(it->label.numel() == 16);
        ++taken;
      }
    } catch (const TimeoutError& e) {
      what = e.what();
    }
    INFO(what);
    CHECK(taken >= 2);  // the decoder's third decode or later is held
    CHECK(taken < 5);
    CHECK(what.find("GPU decode of batch " + std::to_string(taken) + ":") != std::string::npos);
    CHECK(what.find("3000 ms") != std::string::npos);
  }  // the destruction gives up on the held decode after kStuckDecodeSeconds instead of waiting for it
  const auto destroyed = std::chrono::steady_clock::now() - t0;
  CHECK(destroyed < held);
  // The held thread comes back later into the memory left to it; let it, before the next test.
  std::this_thread::sleep_for(held - destroyed + std::chrono::seconds(2));
  // A loader made afterwards decodes as usual.
  o.timeout = std::chrono::milliseconds(0);
  DataLoader after(gpu, o);
  CHECK(labels_of(after).size() == 5);
}

// An epoch left early drops the batches whose decodes are still queued, and their device buffers
// go back to the stage while those decodes may be unissued; the next epoch must not get a buffer
// that such a decode will write later (DeviceStage's Buffer::writer). The decoder's third decode is
// held 300 ms, so the next epoch starts while it is queued and its batches decode on the other
// thread; the consumer holds each of them 40 ms before reading it, so that held decode, when it
// comes, would land in a batch being read if its buffer had been handed out again.
TEST_CASE("GPU decode: an epoch left early, the next epoch's batches are its own", "[gpu][decode][stuck]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 40);  // 160 images, 10 batches
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  DataLoaderOptions o = loader_options(2);
  o.gpu_decode_threads = 2;
  auto images_of_epoch = [&](DataLoader<ImageFolder>& loader) {
    std::vector<Tensor> out;
    for (LabeledBatch& b : loader) {
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
      out.push_back(to_host(b.image, *loader.stream()).get());
    }
    return out;
  };
  DataLoader reference(gpu, o);
  reference.set_epoch(1);
  const std::vector<Tensor> expected = images_of_epoch(reference);
  REQUIRE(expected.size() == 10);
  StalledDecodes stall(300);
  DataLoader loader(gpu, o);
  {
    auto it = loader.begin();  // epoch 0: one batch, then left with the rest queued
    CHECK(it->label.numel() == 16);
  }
  const std::vector<Tensor> got = images_of_epoch(loader);  // epoch 1
  REQUIRE(got.size() == expected.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    INFO("batch " << k);
    REQUIRE(got[k].nbytes() == expected[k].nbytes());
    CHECK(std::memcmp(got[k].raw(), expected[k].raw(), got[k].nbytes()) == 0);
  }
  CHECK(loader.stats().decode_threads == 2);
}

TEST_CASE("GPU decode writes float16, bfloat16 and channels_last batches as the CPU path does", "[gpu][decode]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 6);
  auto value = [](const Tensor& t, std::int64_t k) -> double {
    if (t.dtype() == DType::Float16) {
      _Float16 h;
      std::memcpy(&h, &t.data<Half>()[k], sizeof h);
      return static_cast<double>(h);
    }
    std::uint32_t bits = static_cast<std::uint32_t>(t.data<BFloat16>()[k].bits) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  for (const auto& [dtype, last] : std::vector<std::pair<DType, bool>>{{DType::Float16, false}, {DType::BFloat16, true}}) {
    INFO(dtype_name(dtype) << (last ? " channels_last" : ""));
    auto options = [&](ImageFolderOptions::Decode decode) {
      ImageFolderOptions o;
      o.transform.random_resized_crop(40, 32).horizontal_flip().to_float(dtype);
      if (last) o.transform.channels_last();
      o.transform.normalize({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
      o.decode = decode;
      return o;
    };
    ImageFolder cpu(dir / "root", options(ImageFolderOptions::Decode::Cpu));
    ImageFolder gpu(dir / "root", options(ImageFolderOptions::Decode::Gpu));
    DataLoader cpu_loader(cpu, loader_options(2));
    DataLoader gpu_loader(gpu, loader_options(2));
    auto a = cpu_loader.begin();
    auto b = gpu_loader.begin();
    double sum = 0;
    std::size_t values = 0;
    for (; a != cpu_loader.end() && b != gpu_loader.end(); ++a, ++b) {
      REQUIRE(b->image.dtype() == dtype);
      REQUIRE(b->image.shape() == a->image.shape());
      REQUIRE(b->image.shape()[last ? 3 : 1] == 3);
      const Tensor xi = host_copy(a->image, *cpu_loader.stream()), yi = host_copy(b->image, *gpu_loader.stream());
      for (std::int64_t k = 0; k < xi.numel(); ++k) sum += std::abs(value(xi, k) - value(yi, k)) * 0.226 * 255;
      values += static_cast<std::size_t>(xi.numel());
    }
    CHECK(values == std::size_t{24} * 40 * 32 * 3);
    CHECK(sum / static_cast<double>(values) < 1.5);  // nvJPEG's decode differs a little, as for float32
  }
}

TEST_CASE("GPU decode: a damaged JPEG is a DataError at its batch, a PNG is refused by name, the rest is intact",
          "[gpu][decode][errors]") {
  TempDir dir;
  make_folder(dir, 8);
  Bytes broken = photo_like(80, 60, 1, 90);
  for (std::size_t i = 2; i < 40; ++i) broken[i] = std::byte{0x11};  // the header's markers are gone
  write_file(dir / "root/c1/5-broken.jpg", broken);
  std::vector<std::uint8_t> px(32 * 32 * 3, 77);
  write_file(dir / "root/c2/6-a-png.jpg", encode_png(px, 32, 32, 3));
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  DataLoaderOptions o = loader_options(2);
  o.shuffle = false;
  o.batch_size = 4;
  DataLoader loader(gpu, o);
  std::size_t good = 0;
  std::vector<std::string> errors;
  auto it = loader.begin();
  for (;;) {
    try {
      if (it == loader.end()) break;
      good += static_cast<std::size_t>(it->label.size(0));
      REQUIRE(it->image.device().kind == MemoryKind::Device);
    } catch (const DataError& e) {
      errors.push_back(e.what());
      continue;
    }
    ++it;
  }
  REQUIRE(errors.size() == 2);
  CHECK_THAT(errors[0] + errors[1], Catch::Contains("5-broken.jpg") && Catch::Contains("6-a-png.jpg") &&
                                        Catch::Contains("decode=gpu takes JPEG files only; this is a PNG"));
  CHECK(good == gpu.size() - 8);  // two batches of 4 lost, every other image delivered

  // With on_error = Replace, neither costs anything.
  o.on_error = OnError::Replace;
  DataLoader replacing(gpu, o);
  std::size_t rows = 0;
  for (LabeledBatch& b : replacing) rows += static_cast<std::size_t>(b.label.size(0));
  CHECK(rows == gpu.size());
  CHECK(replacing.stats().samples_replaced == 2);
}

TEST_CASE("GPU decode: 100,000 images, device and pinned memory recycled within the pipeline's depth", "[gpu][decode][memory]") {
  TempDir dir;
  make_folder(dir, 250);  // 1,000 images
  ImageFolder gpu(dir / "root", train_options(ImageFolderOptions::Decode::Gpu));
  DataLoaderOptions o = loader_options(4);
  o.batch_size = 100;
  DataLoader loader(gpu, o);
  std::size_t images = 0;
  DeviceStageStats warm{};
  std::uint64_t pinned_warm = 0;
  for (int epoch = 0; epoch < 100; ++epoch) {
    for (LabeledBatch& b : loader) images += static_cast<std::size_t>(b.label.size(0));
    if (epoch == 1) {
      warm = loader.device_stage()->stats();
      pinned_warm = loader.pinned_pool()->stats().allocations;
    }
  }
  const DeviceStageStats end = loader.device_stage()->stats();
  CHECK(images == 100000);
  CHECK(end.images_decoded >= 100000);
  // Device buffers: within the pipeline's depth, reached as timing allows (like the pinned blocks
  // below). The decoder's own memory (a scratch a decode thread, nvJPEG's pinned blocks) grows
  // only to the largest batch a thread has met, with headroom: a few allocations in all, not one a
  // batch. (Which thread meets which batch is timing, so a thread's scratch may still grow once
  // after warm-up: seen with two threads.)
  CHECK(end.device_allocations >= warm.device_allocations);
  CHECK(end.device_allocations <= test::max_device_buffers(o));
  std::printf("GPU decode, 1,000 batches: %llu decode allocations after 2 epochs, %llu after 100 (%d decode threads)\n",
              static_cast<unsigned long long>(warm.decode_allocations), static_cast<unsigned long long>(end.decode_allocations),
              end.decode_threads);
  CHECK(end.decode_allocations <=
        warm.decode_allocations + 2 * static_cast<std::uint64_t>(end.decode_threads));  // two scratches a thread
  CHECK(end.decode_allocations <= 16);
  // Pinned blocks: as many as the pipeline's depth lets live at once (their number settles as
  // timing varies), never more: (prefetch 2 x 4 workers + pin_depth 2 + device_prefetch 2 + 2)
  // batches of 3 blocks (labels, bytes, index).
  const PinnedPoolStats pool = loader.pinned_pool()->stats();
  CHECK(pool.allocations >= pinned_warm);
  CHECK(pool.blocks <= test::max_batches_alive(o) * 3);
  CHECK(pool.frees == 0);
}

namespace {
// The folder's files as two shards a.tar and b.tar in `dir`, in the folder's order, labels in .cls
// members.
std::vector<std::string> folder_as_shards(const ImageFolder& folder, const TempDir& dir) {
  TarBuilder a, b;
  for (std::size_t i = 0; i < folder.size(); ++i) {
    const std::string key = "r" + std::to_string(1000 + i);
    (i < folder.size() / 2 ? a : b)
        .file(key + ".jpg", read_bytes(folder.path(i)))
        .file(key + ".cls", std::to_string(folder.label(i)));
  }
  write_file(dir / "a.tar", a.finish());
  write_file(dir / "b.tar", b.finish());
  return {dir / "a.tar", dir / "b.tar"};
}

// Indexed shards decoded on the GPU with the folder's transform.
TarImagesOptions gpu_tar_options(const ImageFolderOptions& fo) {
  TarImagesOptions to;
  to.transform = fo.transform;
  to.decode = ImageFolderOptions::Decode::Gpu;
  return to;
}

// One epoch of each loader, batch by batch: the same images and labels, bit for bit, on the
// device; returns the images compared (y ended with x).
template <class X, class Y>
std::size_t same_device_batches(X& x, Y& y) {
  auto p = x.begin();
  auto q = y.begin();
  std::size_t images = 0;
  for (; p != x.end(); ++p, ++q) {
    const bool more = q != y.end();
    REQUIRE(more);
    REQUIRE(q->image.device().kind == MemoryKind::Device);
    CHECK_FALSE(q->encoded.defined());
    const Tensor xi = host_copy(p->image, *x.stream()), yi = host_copy(q->image, *y.stream());
    const Tensor xl = host_copy(p->label, *x.stream()), yl = host_copy(q->label, *y.stream());
    REQUIRE(xi.shape() == yi.shape());
    CHECK(std::memcmp(xi.raw(), yi.raw(), xi.nbytes()) == 0);
    CHECK(std::memcmp(xl.raw(), yl.raw(), xl.nbytes()) == 0);
    images += static_cast<std::size_t>(xl.numel());
  }
  const bool ended = q == y.end();
  CHECK(ended);
  return images;
}
}  // namespace

TEST_CASE("GPU decode of indexed tar shards equals the image folder's, bit for bit", "[gpu][decode][tar]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 12);
  ImageFolderOptions fo = train_options(ImageFolderOptions::Decode::Gpu);
  ImageFolder folder(dir / "root", fo);
  TarImages tar(folder_as_shards(folder, dir), gpu_tar_options(fo));
  REQUIRE(tar.size() == folder.size());
  DataLoader x(folder, loader_options(2));
  DataLoader y(tar, loader_options(3));
  CHECK(same_device_batches(x, y) == folder.size());
  CHECK(y.device_stage()->stats().images_decoded >= folder.size());
}

TEST_CASE("GPU decode from a tar stream (encode_labeled_image) equals the indexed shards', bit for bit", "[gpu][decode][tar]") {
  REQUIRE(DeviceStage::can_decode_images());
  TempDir dir;
  make_folder(dir, 12);
  ImageFolderOptions fo = train_options(ImageFolderOptions::Decode::Gpu);
  ImageFolder folder(dir / "root", fo);
  const std::vector<std::string> shards = folder_as_shards(folder, dir);
  TarImages tar(shards, gpu_tar_options(fo));
  TarRecordDecodeOptions ro;
  ro.transform = fo.transform;
  TarShardsOptions so;
  so.shuffle = false;
  auto stream = TarShards(shards, so).map([ro](TarRecord r, SampleContext& ctx) {
    return encode_labeled_image(std::move(r), ro, ctx.rng());
  });
  // Without workers the stream's k-th record draws its crop as the indexed k-th sample does (the
  // same seed, epoch and position), so the batches are the same bytes.
  DataLoaderOptions xo = loader_options(0), yo = loader_options(0);
  xo.shuffle = yo.shuffle = false;
  yo.batch_size = xo.batch_size = 7;  // batches that cross from one shard to the next
  DataLoader x(tar, xo);
  DataLoader y(stream, yo);
  for (int epoch = 0; epoch < 2; ++epoch) CHECK(same_device_batches(x, y) == folder.size());
  CHECK(y.device_stage()->stats().images_decoded >= 2 * folder.size());
  // With workers, every record once a epoch, decoded on the device.
  DataLoaderOptions wo = loader_options(3);
  wo.shuffle = false;
  DataLoader w(stream, wo);
  std::size_t images = 0;
  for (LabeledBatch& batch : w) {
    CHECK(batch.image.device().kind == MemoryKind::Device);
    images += static_cast<std::size_t>(batch.label.numel());
  }
  CHECK(images == folder.size());
}
