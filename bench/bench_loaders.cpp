// bench_loaders — the loaders on real data.
//
// 1. JPEG decode plus random_resized_crop(224) + flip + to_float + normalize, per core, on real
//    photographs cut into tiles (500x375, ImageNet's typical size, or larger), against a plain
//    TurboJPEG decode loop over the same files. Rows: a full decode then the transform (ferry's
//    CPU path before region decode), decode_transformed_into (only the crop's rows and columns
//    decoded, Note [Region decode]), the same with DCT scaling, ImageFolder::get_into, and the
//    whole DataLoader on every core.
// 2. Fashion-MNIST (Debian's dataset-fashion-mnist) through the loader at 0, 1 and 2 workers.
//
// Usage: bench_loaders --photos DIR [--fmnist DIR] [--runs N]
//        bench_loaders --make-tiles SRC_DIR OUT_DIR [WxH]   (cut JPEG tiles, 500x375 unless given, quality 90)
#include <turbojpeg.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<std::byte> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> b(c.size());
  std::memcpy(b.data(), c.data(), c.size());
  return b;
}

// Median over `runs` epochs of samples delivered per second by a loader of LabeledBatches.
template <class Loader>
double samples_per_second(Loader& loader, int runs) {
  std::vector<double> ts;
  for (int r = 0; r < runs; ++r) {
    std::size_t n = 0;
    const auto t0 = Clock::now();
    for (LabeledBatch& b : loader) n += static_cast<std::size_t>(b.label.size(0));
    ts.push_back(static_cast<double>(n) / seconds_since(t0));
  }
  return median(ts);
}

int make_tiles(const std::string& src, const std::string& out, int tw, int th) {
  tjhandle enc = tjInitCompress();
  int written = 0;
  std::vector<fs::path> files;
  for (auto& e : fs::directory_iterator(src))
    if (e.path().extension() == ".jpg") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const fs::path& p : files) {
    Tensor img = read_image(p.string(), {.channels = 3});
    const int H = static_cast<int>(img.size(0)), W = static_cast<int>(img.size(1));
    const fs::path dir = fs::path(out) / p.stem();
    int k = 0;
    for (int y = 0; y + th <= H; y += th)
      for (int x = 0; x + tw <= W; x += tw) {
        const auto* src_px = img.data<std::uint8_t>() + (static_cast<std::size_t>(y) * W + x) * 3;
        unsigned char* buf = nullptr;
        unsigned long size = 0;
        if (tjCompress2(enc, src_px, tw, W * 3, th, TJPF_RGB, &buf, &size, TJSAMP_420, 90, 0) != 0) return 1;
        fs::create_directories(dir);  // only photographs that give a tile get a class folder
        std::ofstream((dir / (std::to_string(k++) + ".jpg")).string(), std::ios::binary)
            .write(reinterpret_cast<char*>(buf), static_cast<std::streamsize>(size));
        tjFree(buf);
        ++written;
      }
  }
  tjDestroy(enc);
  std::printf("make-tiles: %d tiles of %dx%d from %zu photographs into %s\n", written, tw, th, files.size(), out.c_str());
  return 0;
}

ImageTransform train_transform() {
  return ImageTransform().random_resized_crop(224, 224).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                               {0.229f, 0.224f, 0.225f});
}

void photos(const std::string& dir, int runs) {
  ImageFolderOptions o;
  o.transform = train_transform();
  ImageFolder ds(dir, o);
  std::vector<std::vector<std::byte>> files;
  for (std::size_t i = 0; i < ds.size(); ++i) files.push_back(slurp(ds.path(i)));
  const unsigned hw = std::thread::hardware_concurrency();
  std::printf("## JPEG decode + random_resized_crop(224) + flip + to_float + normalize\n\n");
  const Tensor first = decode_image(files.at(0), ds.path(0));
  std::printf(
      "%zu JPEG tiles of %lldx%lld (quality 90) cut from %zu photographs of Debian's mate-backgrounds; "
      "one thread unless noted; median of %d passes over all files.\n\n",
      ds.size(), static_cast<long long>(first.size(1)), static_cast<long long>(first.size(0)), ds.classes().size(), runs);
  std::printf("| pipeline | images/s | vs. TurboJPEG decode |\n|---|---:|---:|\n");

  // Ceiling: a plain TurboJPEG decode of the in-memory files into one reused RGB buffer.
  tjhandle tj = tjInitDecompress();
  std::vector<unsigned char> rgb(4096 * 4096 * 3);
  std::vector<double> t;
  for (int r = -1; r < runs; ++r) {  // pass -1 warms up, untimed
    const auto t0 = Clock::now();
    for (auto& f : files) {
      int w, h, ss, cs;
      tjDecompressHeader3(tj, reinterpret_cast<const unsigned char*>(f.data()), f.size(), &w, &h, &ss, &cs);
      tjDecompress2(tj, reinterpret_cast<const unsigned char*>(f.data()), f.size(), rgb.data(), w, 0, h, TJPF_RGB, 0);
    }
    if (r >= 0) t.push_back(static_cast<double>(files.size()) / seconds_since(t0));
  }
  tjDestroy(tj);
  const double ceiling = median(t);
  std::printf("| plain TurboJPEG decode loop (files in memory) | %.0f | 1.00 |\n", ceiling);

  auto row = [&](const char* name, auto&& body) {
    std::vector<double> ts;
    body(std::uint64_t{1000});  // warm-up pass, untimed
    for (int r = 0; r < runs; ++r) {
      const auto t0 = Clock::now();
      body(static_cast<std::uint64_t>(r));
      ts.push_back(static_cast<double>(files.size()) / seconds_since(t0));
    }
    const double m = median(ts);
    std::printf("| %s | %.0f | %.2f |\n", name, m, m / ceiling);
  };
  row("ferry decode_image (files in memory)", [&](std::uint64_t) {
    for (auto& f : files) (void)decode_image(f, "x");
  });
  Tensor out = Tensor::empty(DType::Float32, {3, 224, 224});
  const ImageTransform tr = train_transform();
  row("ferry decode_image + transform: full decode (files in memory)", [&](std::uint64_t epoch) {
    for (std::size_t i = 0; i < files.size(); ++i) {
      Generator g(1, epoch, i);
      tr.apply_into(decode_image(files[i], "x"), out, g);
    }
  });
  for (bool scaled : {false, true}) {
    row(scaled ? "ferry decode_transformed_into: region + DCT scaling (files in memory)"
               : "ferry decode_transformed_into: region decode (files in memory)",
        [&](std::uint64_t epoch) {
          for (std::size_t i = 0; i < files.size(); ++i) {
            Generator g(1, epoch, i);
            decode_transformed_into(files[i], "x", tr, g, out, {.channels = 3, .dct_scaling = scaled});
          }
        });
  }
  for (bool scaled : {false, true}) {
    ImageFolderOptions so = o;
    so.dct_scaling = scaled;
    const ImageFolder sds(dir, so);
    LabeledBatch batch = sds.make_batch(1, pageable_allocator());
    WorkerInfo w;
    row(scaled ? "ImageFolder::get_into, dct_scaling (read + decode + transform into a batch row)"
               : "ImageFolder::get_into (read + decode + transform into a batch row)",
        [&](std::uint64_t epoch) {
          for (std::size_t i = 0; i < sds.size(); ++i) {
            SampleContext ctx(i, 1, epoch, w);
            sds.get_into(i, batch, 0, ctx);
          }
        });
    // The whole loader on every core: batches of 64, all hardware threads as workers, 64 batches
    // per epoch drawn with replacement (the tiles are few).
    for (unsigned workers : {1u, hw}) {
      DataLoaderOptions lo;
      lo.batch_size = 64;
      lo.num_workers = static_cast<int>(workers);
      lo.sampler = std::make_shared<RandomSampler>(sds.size(), 9, true, std::size_t{64} * 64);
      DataLoader loader(sds, lo);
      const double m = samples_per_second(loader, runs);
      const char* how = scaled ? ", dct_scaling" : "";
      std::printf("| DataLoader(ImageFolder%s), %u workers, batch 64: per core | %.0f | %.2f |\n", how, workers, m / workers,
                  m / workers / ceiling);
      std::printf("| DataLoader(ImageFolder%s), %u workers, batch 64: total | %.0f | - |\n", how, workers, m);
    }
  }
}

void fmnist(const std::string& root, int runs) {
  std::printf("\n## Fashion-MNIST through the loader (60,000 training images, batch 256)\n\n");
  std::printf("| pipeline | workers | samples/s |\n|---|---:|---:|\n");
  for (bool transform : {false, true}) {
    IdxDatasetOptions o;
    if (transform) o.transform.horizontal_flip().to_float().normalize({0.2860f}, {0.3530f});
    IdxDataset ds(root + "/train-images-idx3-ubyte.gz", root + "/train-labels-idx1-ubyte.gz", o);
    for (int workers : {0, 1, 2}) {
      DataLoaderOptions lo;
      lo.batch_size = 256;
      lo.shuffle = true;
      lo.num_workers = workers;
      DataLoader loader(ds, lo);
      std::printf("| IdxDataset, shuffled, %s | %d | %.0f |\n", transform ? "flip + to_float + normalize" : "uint8 as stored",
                  workers, samples_per_second(loader, runs));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string photo_dir, fmnist_dir = "/usr/share/datasets/fashion-mnist";
  int runs = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--make-tiles" && i + 2 < argc) {
      int tw = 500, th = 375;
      if (i + 3 < argc && std::sscanf(argv[i + 3], "%dx%d", &tw, &th) != 2) {
        std::fprintf(stderr, "bench_loaders: --make-tiles SRC OUT [WxH]: bad size '%s'\n", argv[i + 3]);
        return 2;
      }
      return make_tiles(argv[i + 1], argv[i + 2], tw, th);
    }
    if (a == "--photos" && i + 1 < argc)
      photo_dir = argv[++i];
    else if (a == "--fmnist" && i + 1 < argc)
      fmnist_dir = argv[++i];
    else if (a == "--runs" && i + 1 < argc)
      runs = std::stoi(argv[++i]);
  }
  std::printf("# bench_loaders — %u hardware threads\n\n", std::thread::hardware_concurrency());
  if (!photo_dir.empty()) photos(photo_dir, runs);
  if (fs::exists(fmnist_dir + "/train-images-idx3-ubyte.gz"))
    fmnist(fmnist_dir, runs);
  else
    std::printf("\n(no Fashion-MNIST under %s: skipped)\n", fmnist_dir.c_str());
  return 0;
}
