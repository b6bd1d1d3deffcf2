// bench_first_batch — how long a new loader takes to hand over its first batch.
//
// In-memory data: 2,048 samples of 3x224x224 uint8 in one tensor (a TensorDataset, so workers copy
// rows straight into the batch the allocator gives: pageable, pinned or, with a device, pinned and
// then copied), batch 256 (38.5 MB). For each route and worker count, the median of --runs new
// loaders of: making the DataLoader, and begin() to the first batch in hand (with a device, after
// its copy has finished: the stream is synchronized). One loader with a device is made and
// dropped first, so CUDA's own start-up (reported on its own) is not in the rows.
// With --images DIR (an image folder, DIR/<class>/<image>.jpg): the same for ImageFolder with
// RandomResizedCrop 224 + flip + normalize to float32, decoded by the workers (pinned batch) and
// on the GPU (decode = Gpu, device 0: until the batch is decoded on the device).
// Usage: bench_first_batch [--runs N] [--workers 0,1,4,8,12,16] [--no-device] [--images DIR]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

enum class Route { Pageable, Pinned, Device };
const char* name(Route r) { return r == Route::Pageable ? "pageable" : r == Route::Pinned ? "pinned" : "device"; }

struct Times {
  double make_ms, first_ms;
};

// Making a loader over `data` with `o`, then begin() to the first batch in hand (with a device,
// until its work on the device has finished).
template <class Dataset>
Times first_batch(const Dataset& data, const DataLoaderOptions& o) {
  const auto t0 = Clock::now();
  DataLoader loader(data, o);
  const double made = ms_since(t0);
  const auto t1 = Clock::now();
  auto it = loader.begin();
  (void)*it;
  if (o.device) loader.stream()->synchronize();
  return {made, ms_since(t1)};
}

DataLoaderOptions options(int workers, bool pinned, bool device) {
  DataLoaderOptions o;
  o.batch_size = 256;
  o.shuffle = true;
  o.num_workers = workers;
  o.pin_memory = pinned || device;
  if (device) o.device = 0;
  return o;
}

Times one(const TensorDataset& data, Route route, int workers) {
  return first_batch(data, options(workers, route != Route::Pageable, route == Route::Device));
}

// The same for an image folder: workers decode (pinned batches), or the GPU does (decode = Gpu).
Times one_folder(const ImageFolder& folder, bool gpu, int workers) { return first_batch(folder, options(workers, true, gpu)); }

}  // namespace

int main(int argc, char** argv) {
  int runs = 7;
  bool device = true;
  std::string images;
  std::vector<int> workers = {0, 1, 4, 8, 12, 16};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc)
      runs = std::stoi(argv[++i]);
    else if (a == "--no-device")
      device = false;
    else if (a == "--images" && i + 1 < argc)
      images = argv[++i];
    else if (a == "--workers" && i + 1 < argc) {
      workers.clear();
      std::stringstream list(argv[++i]);
      for (std::string w; std::getline(list, w, ',');) workers.push_back(std::stoi(w));
    }
  }
  device = device && cuda::available();
  Tensor x = Tensor::empty(DType::UInt8, {2048, 3, 224, 224});
  std::memset(x.data<std::uint8_t>(), 7, static_cast<std::size_t>(x.numel()));
  const TensorDataset data({x});
  std::printf(
      "bench_first_batch: 2,048 x 3x224x224 uint8 in memory, batch 256 (38.5 MB), shuffled; %u hardware threads; "
      "median of %d new loaders\n\n",
      std::thread::hardware_concurrency(), runs);
  if (device) {
    const auto t0 = Clock::now();
    (void)one(data, Route::Device, 1);
    std::printf("CUDA's start-up and the first device loader (once a process): %.1f ms\n\n", ms_since(t0));
  }
  std::printf(
      "| route | workers | make the loader, ms | begin() to the first batch, ms | total, ms |\n|---|---:|---:|---:|---:|\n");
  std::vector<Route> routes = {Route::Pageable};
  if (device) routes.insert(routes.end(), {Route::Pinned, Route::Device});
  for (Route r : routes)
    for (int w : workers) {
      std::vector<double> make, first, total;
      for (int k = 0; k < runs; ++k) {
        const Times t = one(data, r, w);
        make.push_back(t.make_ms);
        first.push_back(t.first_ms);
        total.push_back(t.make_ms + t.first_ms);
      }
      std::printf("| %s | %d | %.2f | %.2f | %.2f |\n", name(r), w, median(make), median(first), median(total));
      std::fflush(stdout);
    }
  if (images.empty()) return 0;
  ImageFolderOptions fo;
  fo.transform = ImageTransform().random_resized_crop(224, 224).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                                       {0.229f, 0.224f, 0.225f});
  const ImageFolder cpu(images, fo);
  fo.decode = ImageFolderOptions::Decode::Gpu;
  const ImageFolder gpu(images, fo);
  std::printf(
      "\nImage folder %s (%zu images), RandomResizedCrop 224 + flip + normalize to float32, batch 256, shuffled; "
      "the folder listed once, outside the rows\n\n| decode | workers | make the loader, ms | begin() to the first batch, ms | "
      "total, ms |\n|---|---:|---:|---:|---:|\n",
      images.c_str(), cpu.size());
  for (const bool on_gpu : {false, true}) {
    if (on_gpu && !device) break;
    for (int w : workers) {
      std::vector<double> make, first, total;
      for (int k = 0; k < runs; ++k) {
        const Times t = one_folder(on_gpu ? gpu : cpu, on_gpu, w);
        make.push_back(t.make_ms);
        first.push_back(t.first_ms);
        total.push_back(t.make_ms + t.first_ms);
      }
      std::printf("| %s | %d | %.2f | %.2f | %.2f |\n", on_gpu ? "GPU (nvJPEG), batch on cuda:0" : "CPU (workers), pinned", w,
                  median(make), median(first), median(total));
      std::fflush(stdout);
    }
  }
  return 0;
}
