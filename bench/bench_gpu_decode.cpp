// bench_gpu_decode — images through the loader with JPEG decode on the CPU or on the GPU.
//
// Workload: an image folder of JPEG photographs (scripts/gpu.sh bench makes 10,260 from the 171
// tiles of scripts/bench-loaders.sh), RandomResizedCrop 224 + flip + to_float + normalize, batch
// 256, batches delivered on cuda:0, in order. Rows, one run:
//   ferry, CPU decode (TurboJPEG in the workers), all cores;
//   ferry, GPU decode (workers read bytes and draw crops; nvJPEG + one fused kernel on the device
//   stage), 1, 2 and 4 workers;
//   the ceiling: nvJPEG's batched decode alone (the same files in memory, batch 256, the backend
//   the decoder picks: hardware where the GPU has JPEG engines), one CPU thread.
// Each row: images/s (median of --runs epochs after a warm-up epoch) and the CPU cores the
// process kept busy (CPU time / wall time), and images/s per busy core.
//
// Then a training loop: each step runs --step-ms of GPU work (a spin kernel) on the batch's
// stream and synchronizes; GPU waiting for data = 1 - steps x (the step alone) / wall. The spin
// is timed by the GPU's clock, so it cannot show how much the decode slows a real step down.
//
// Usage: bench_gpu_decode --photos DIR [--runs N] [--step-ms 20] [--steps 100 (0: no training loop)]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu_time.h"
#include "ferry/ferry.h"

#ifdef FERRY_BENCH_NVJPEG
#include <cuda_runtime.h>
#include <nvjpeg.h>
#endif
#ifdef FERRY_BENCH_TRAINING_LOOP
#include "kernels.h"
#endif

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

using bench::cpu_seconds;

struct Row {
  double images_per_s = 0, busy_cores = 0;
};

Row median_row(std::vector<Row> rows) {
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.images_per_s < b.images_per_s; });
  return rows[rows.size() / 2];
}

void print(const char* name, Row r, double ceiling) {
  std::printf("| %-52s | %9.0f | %5.2f | %8.0f | %5.2f |\n", name, r.images_per_s, r.busy_cores,
              r.images_per_s / std::max(r.busy_cores, 1e-9), ceiling > 0 ? r.images_per_s / ceiling : 0.0);
  std::fflush(stdout);
}

// The workload: the folder with RandomResizedCrop 224 + flip + to_float + normalize, and the
// loader options every row shares.
ImageFolder images(const std::string& photos, ImageFolderOptions::Decode decode) {
  ImageFolderOptions io;
  io.transform.random_resized_crop(224, 224).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                   {0.229f, 0.224f, 0.225f});
  io.decode = decode;
  return ImageFolder(photos, io);
}

DataLoaderOptions options(int workers) {
  DataLoaderOptions o;
  o.batch_size = 256;
  o.shuffle = true;
  o.num_workers = workers;
  o.device = 0;
  o.pinned_memory_limit = std::size_t{8} << 30;
  return o;
}

Row loader_row(const std::string& photos, ImageFolderOptions::Decode decode, int workers, int runs) {
  DataLoader loader(images(photos, decode), options(workers));
  std::vector<Row> rows;
  for (int r = 0; r < runs + 1; ++r) {
    std::size_t n = 0;
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    for (LabeledBatch& b : loader) n += static_cast<std::size_t>(b.label.size(0));
    loader.stream()->synchronize();
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) rows.push_back({static_cast<double>(n) / wall, (cpu_seconds() - c0) / wall});
  }
  if (decode == ImageFolderOptions::Decode::Gpu)
    std::fprintf(stderr, "  (GPU decode backend: %s)\n", loader.device_stage()->decode_backend().c_str());
  return median_row(rows);
}

#ifdef FERRY_BENCH_TRAINING_LOOP
void training_loop(const std::string& photos, ImageFolderOptions::Decode decode, int workers, double step_ms, int steps) {
  DataLoaderOptions o = options(workers);
  o.persistent_workers = true;
  DataLoader loader(images(photos, decode), o);
  const double base_ms = test::step_alone_ms(loader.stream()->native(), step_ms, 20);
  const double wall = test::training_loop_ms(loader, step_ms, steps);
  std::printf("| ferry, %s decode, %d workers | %.2f ms | %d | %.0f ms | %.2f%% |\n",
              decode == ImageFolderOptions::Decode::Gpu ? "GPU" : "CPU", workers, base_ms, steps, wall,
              100.0 * std::max(0.0, 1.0 - steps * base_ms / wall));
  std::fflush(stdout);
}
#endif

#ifdef FERRY_BENCH_NVJPEG
Row nvjpeg_ceiling(const std::string& photos, int runs) {
  std::vector<std::vector<unsigned char>> files;
  for (auto& e : std::filesystem::recursive_directory_iterator(photos)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    files.emplace_back((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  nvjpegHandle_t h = nullptr;
  const char* backend = "hardware";
  if (nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, 0, &h) != NVJPEG_STATUS_SUCCESS) {
    backend = "GPU hybrid";
    if (nvjpegCreateEx(NVJPEG_BACKEND_GPU_HYBRID, nullptr, nullptr, 0, &h) != NVJPEG_STATUS_SUCCESS) return {};
  }
  std::fprintf(stderr, "  (nvJPEG ceiling backend: %s)\n", backend);
  nvjpegJpegState_t st = nullptr;
  nvjpegJpegStateCreate(h, &st);
  const int B = 256;
  cudaStream_t s;
  cudaStreamCreate(&s);
  std::vector<unsigned char*> outs(B);
  std::size_t max_image = 0;  // the largest decoded image: every output buffer holds it
  for (const auto& f : files) {
    int nc = 0, w[NVJPEG_MAX_COMPONENT], hh[NVJPEG_MAX_COMPONENT];
    nvjpegChromaSubsampling_t sub;
    if (nvjpegGetImageInfo(h, f.data(), f.size(), &nc, &sub, w, hh) == NVJPEG_STATUS_SUCCESS)
      max_image = std::max(max_image, static_cast<std::size_t>(w[0]) * static_cast<std::size_t>(hh[0]) * 3);
  }
  for (auto& p : outs) cudaMalloc(&p, max_image);
  std::vector<Row> rows;
  for (int r = 0; r < runs + 1; ++r) {
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    std::size_t n = 0;
    for (std::size_t i = 0; i + B <= files.size(); i += B) {
      std::vector<const unsigned char*> data(B);
      std::vector<std::size_t> len(B);
      std::vector<nvjpegImage_t> img(B);
      for (int k = 0; k < B; ++k) {
        data[k] = files[i + k].data();
        len[k] = files[i + k].size();
        int nc = 0, w[NVJPEG_MAX_COMPONENT], hh[NVJPEG_MAX_COMPONENT];
        nvjpegChromaSubsampling_t sub;
        nvjpegGetImageInfo(h, data[k], len[k], &nc, &sub, w, hh);
        img[k] = {};
        img[k].channel[0] = outs[k];
        img[k].pitch[0] = static_cast<unsigned>(w[0] * 3);
      }
      if (nvjpegDecodeBatchedInitialize(h, st, B, 1, NVJPEG_OUTPUT_RGBI) != NVJPEG_STATUS_SUCCESS ||
          nvjpegDecodeBatched(h, st, data.data(), len.data(), img.data(), s) != NVJPEG_STATUS_SUCCESS) {
        std::fprintf(stderr, "nvjpegDecodeBatched failed\n");
        return {};
      }
      n += B;
    }
    cudaStreamSynchronize(s);
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) rows.push_back({static_cast<double>(n) / wall, (cpu_seconds() - c0) / wall});
  }
  for (auto& p : outs) cudaFree(p);
  nvjpegJpegStateDestroy(st);
  nvjpegDestroy(h);
  cudaStreamDestroy(s);
  return median_row(rows);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string photos;
  int runs = 3, steps = 100;
  double step_ms = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--photos" && i + 1 < argc) photos = argv[++i];
    else if (a == "--runs" && i + 1 < argc) runs = std::atoi(argv[++i]);
    else if (a == "--step-ms" && i + 1 < argc) step_ms = std::atof(argv[++i]);
    else if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
  }
  if (photos.empty()) {
    std::fprintf(stderr, "usage: bench_gpu_decode --photos DIR [--runs N]\n");
    return 2;
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  std::printf("bench_gpu_decode: %s, %d hardware threads; RandomResizedCrop 224 + flip + to_float + normalize, batch 256, on cuda:0\n\n",
              photos.c_str(), cores);
  double ceiling = 0;
#ifdef FERRY_BENCH_NVJPEG
  const Row c = nvjpeg_ceiling(photos, runs);
  ceiling = c.images_per_s;
#endif
  std::printf("| pipeline | images/s | busy cores | images/s per busy core | of the ceiling |\n|---|---:|---:|---:|---:|\n");
#ifdef FERRY_BENCH_NVJPEG
  print("nvJPEG batched decode alone (the ceiling), 1 thread", c, ceiling);
#endif
  for (int w : {1, 2, 4}) {
    const std::string name = "ferry, GPU decode, " + std::to_string(w) + " worker" + (w > 1 ? "s" : "");
    print(name.c_str(), loader_row(photos, ImageFolderOptions::Decode::Gpu, w, runs), ceiling);
  }
  const std::string name = "ferry, CPU decode, " + std::to_string(cores) + " workers";
  print(name.c_str(), loader_row(photos, ImageFolderOptions::Decode::Cpu, cores, runs), ceiling);
#ifdef FERRY_BENCH_TRAINING_LOOP
  if (steps > 0) std::printf("\n## training loop: %.0f ms GPU steps of 256 images (%.0f images/s)\n\n", step_ms, 256 * 1000 / step_ms);
  if (steps > 0) {
    std::printf("| loader | step alone | steps | wall | GPU waiting for data |\n|---|---:|---:|---:|---:|\n");
    training_loop(photos, ImageFolderOptions::Decode::Gpu, 2, step_ms, steps);
    training_loop(photos, ImageFolderOptions::Decode::Cpu, cores, step_ms, steps);
  }
#endif
  (void)step_ms;
  (void)steps;
  return 0;
}
