// bench_gpu_decode — images through the loader with JPEG decode on the CPU or on the GPU.
//
// Workload: an image folder of JPEG photographs (scripts/gpu.sh bench makes 10,260 from the 171
// tiles of scripts/bench-loaders.sh), RandomResizedCrop 224 + flip + to_float + normalize, batch
// 256, batches delivered on cuda:0, in order. Rows, one run:
//   the ceiling: nvJPEG's batched decode alone (the same files in memory, batch 256, the backend
//   the decoder picks: hardware where the GPU has JPEG engines), one CPU thread; and with two
//   threads, each its own decoder (as ferry's two decode threads);
//   ferry, GPU decode (workers read bytes and draw crops; nvJPEG + one fused kernel issued by the
//   device stage's decode threads), 2 workers with 1 decode thread, and 1, 2 and 4 workers with 2;
//   ferry, CPU decode (TurboJPEG in the workers), all cores.
// Each row: images/s (median of --runs epochs after a warm-up epoch) and the CPU cores the
// process kept busy (CPU time / wall time), and images/s per busy core.
//
// With --tar DIR: the same files written as WebDataset shards (DIR/shard-NNN.tar, 1,000 records
// each, made once) and the row of TarImages (indexed shards) with GPU decode.
//
// Then a training loop (persistent workers): each step is either cuBLAS bfloat16 products of
// 4096 x 4096 matrices (bench/matmul_step.h; built where CMake finds cuBLAS) or a fixed amount of
// arithmetic on every SM (4 or 2 blocks of 256 threads a SM, one kernel or 40), calibrated to
// about --step-ms alone, on the batch's stream, then a synchronize, so the GPU is idle from the
// end of a step until the next batch is in hand. GPU waiting for data = the sum of those waits
// (timed on the host) over the wall time, and the part of it spent waiting for an epoch's first
// batch; the step's slowdown = its GPU time (events) in the loop over its GPU time alone: what
// sharing the GPU with the decode costs the step; wall lost = 1 - steps x (the step alone, wall)
// / wall: the two together.
//
// nvJPEG launches its kernels on streams of its own (Note [Decode threads]); with CUDA's default of
// 8 hardware queues they share the step's and wait behind its kernels. Unless the environment
// says otherwise, this program sets CUDA_DEVICE_MAX_CONNECTIONS=32 before its first CUDA call.
//
// With --trace-dir DIR, each training loop writes its loader's Chrome trace there
// (loop-<gpu|cpu>-<matmul | kernels-b<blocks>>-t<decode threads>.json), and each loop says the decode's GPU time a batch.
//
// Usage: bench_gpu_decode --photos DIR [--tar DIR] [--loop-only] [--runs N] [--step-ms 20] [--steps 100 (0: no training loop)]
//                         [--step all|matmul|arith] [--decode-threads 1,2] [--step-kernels 1,40] [--step-blocks 4,2]
//                         [--trace-dir DIR]

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cpu_time.h"
#include "tar_writer.h"
#include "ferry/ferry.h"

#ifdef FERRY_BENCH_NVJPEG
#include <cuda_runtime.h>
#include <nvjpeg.h>
#endif
#ifdef FERRY_BENCH_TRAINING_LOOP
#include "work_step.h"
#ifdef FERRY_BENCH_CUBLAS
#include "matmul_step.h"
#endif
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
ImageTransform train_transform() {
  return ImageTransform().random_resized_crop(224, 224).horizontal_flip().to_float().normalize({0.485f, 0.456f, 0.406f},
                                                                                               {0.229f, 0.224f, 0.225f});
}

ImageFolder images(const std::string& photos, ImageFolderOptions::Decode decode) {
  ImageFolderOptions io;
  io.transform = train_transform();
  io.decode = decode;
  return ImageFolder(photos, io);
}

// The folder's files as ustar shards of 1,000 records (<key>.jpg + <key>.cls), in the folder's
// order; made once (kept when dir already holds shards).
std::vector<std::string> write_shards(const ImageFolder& folder, const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> shards;
  fs::create_directories(dir);
  const bool made = fs::exists(fs::path(dir) / "shard-000.tar");
  std::optional<bench::TarWriter> out;
  for (std::size_t i = 0; i < folder.size(); ++i) {
    if (i % 1000 == 0) {
      char name[32];
      std::snprintf(name, sizeof name, "shard-%03zu.tar", i / 1000);
      shards.push_back((fs::path(dir) / name).string());
      if (!made) out.emplace(shards.back());
    }
    if (made) continue;
    std::ifstream f(folder.path(i), std::ios::binary);
    const std::string jpg((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    char key[32];
    std::snprintf(key, sizeof key, "%08zu", i);
    out->member(std::string(key) + ".jpg", jpg);
    out->member(std::string(key) + ".cls", std::to_string(folder.label(i)));
  }
  return shards;
}

TarImages tar_images(const std::vector<std::string>& shards) {
  TarImagesOptions o;
  o.transform = train_transform();
  o.decode = ImageFolderOptions::Decode::Gpu;
  return TarImages(shards, o);
}

DataLoaderOptions options(int workers, int decode_threads = 2) {
  DataLoaderOptions o;
  o.gpu_decode_threads = decode_threads;
  o.batch_size = 256;
  o.shuffle = true;
  o.num_workers = workers;
  o.device = 0;
  o.pinned_memory_limit = std::size_t{8} << 30;
  return o;
}

template <class Dataset>
Row loader_row(Dataset dataset, int workers, int runs, int decode_threads = 2) {
  DataLoader loader(std::move(dataset), options(workers, decode_threads));
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
  if (loader.dataset().decodes_on_device())
    std::fprintf(stderr, "  (GPU decode backend: %s)\n", loader.device_stage()->decode_backend().c_str());
  return median_row(rows);
}

#ifdef FERRY_BENCH_TRAINING_LOOP
// A step is `kernels` launches of the same arithmetic (one long kernel holds every SM until it
// ends; a real step is many short kernels, between which the loader's kernels can be scheduled).
void training_loop(const std::string& photos, ImageFolderOptions::Decode decode, int workers, double step_ms, int steps,
                   int kernels, int blocks_per_sm, int decode_threads, const std::string& trace_dir) {
  DataLoaderOptions o = options(workers, decode_threads);
  o.persistent_workers = true;
  if (!trace_dir.empty()) o.trace = std::make_shared<TraceRecorder>(1 << 20);
  DataLoader loader(images(photos, decode), o);
  cuda::DeviceGuard guard(0);
  // blocks_per_sm 0: the step is cuBLAS matrix products (bench/matmul_step.h), `kernels` of them
  std::function<void(const cuda::Stream&)> launch;
  double alone_wall = 0, alone_gpu = 0;
  std::string footprint = std::to_string(blocks_per_sm);
  std::shared_ptr<bench::MatmulStep> mm;
  if (blocks_per_sm == 0) {
#ifdef FERRY_BENCH_CUBLAS
    mm = bench::MatmulStep::calibrate(*loader.stream(), step_ms);
    kernels = mm->count;
    alone_wall = mm->alone_wall_ms;
    alone_gpu = mm->alone_gpu_ms;
    footprint = "cuBLAS " + std::to_string(mm->n) + "³ bf16";
    launch = [mm](const cuda::Stream& s) { mm->launch(s); };
#else
    return;
#endif
  } else {
    const bench::WorkStep work = bench::WorkStep::calibrate(*loader.stream(), step_ms, kernels, blocks_per_sm);
    alone_wall = work.alone_wall_ms;
    alone_gpu = work.alone_gpu_ms;
    launch = [work](const cuda::Stream& s) { work.launch(s); };
  }
  cuda::Event e0 = cuda::Event::create(0, true), e1 = cuda::Event::create(0, true);
  // The loop: 10 unmeasured steps, then `steps`, across epochs; the wait for each batch is timed
  // on the host (from the end of the last step to the batch in hand).
  double loop_gpu = 0, epoch_start_wait = 0, wait = 0;
  int step = 0, epochs_started = 0;
  Clock::time_point t0 = Clock::now(), last = t0;
  while (step < steps + 10) {
    bool first = true;
    for (LabeledBatch& b : loader) {
      (void)b;
      const auto now = Clock::now();
      if (step == 10) t0 = now;
      if (step == steps + 10) break;
      if (step > 10) {
        const double waited = std::chrono::duration<double, std::milli>(now - last).count();
        wait += waited;
        if (first) {
          epoch_start_wait += waited;
          ++epochs_started;
        }
      }
      first = false;
      e0.record(*loader.stream());
      launch(*loader.stream());
      e1.record(*loader.stream());
      loader.stream()->synchronize();
      if (step >= 10) loop_gpu += cuda::Event::elapsed_ms(e0, e1);
      last = Clock::now();
      ++step;
    }
  }
  const double wall = std::chrono::duration<double, std::milli>(last - t0).count();
  const std::string threads = decode == ImageFolderOptions::Decode::Gpu ? std::to_string(decode_threads) : "-";
  std::printf(
      "| ferry, %s decode, %d workers | %s | %d | %s | %.2f ms | %.2f ms | %d | %.2f%% | %.2f%% (%d epoch starts) | %+.2f%% | "
      "%.2f%% |\n",
      decode == ImageFolderOptions::Decode::Gpu ? "GPU" : "CPU", workers, threads.c_str(), kernels, footprint.c_str(), alone_wall,
      alone_gpu, steps, 100.0 * wait / wall, 100.0 * epoch_start_wait / wall, epochs_started,
      100.0 * (loop_gpu / steps / alone_gpu - 1.0), 100.0 * std::max(0.0, 1.0 - steps * alone_wall / wall));
  std::fflush(stdout);
  const LoaderStats st = loader.stats();
  if (st.batches > 0 && st.decode_seconds > 0)
    std::fprintf(stderr, "  (the decode threads' time a batch, nvJPEG's call and the kernel's launch: %.2f ms)\n",
                 1e3 * st.decode_seconds / static_cast<double>(st.batches));
  if (o.trace) {
    const std::string path = trace_dir + "/loop-" + (decode == ImageFolderOptions::Decode::Gpu ? "gpu" : "cpu") + "-" +
                             (mm ? "matmul" : std::to_string(kernels) + "-b" + std::to_string(blocks_per_sm)) + "-t" + threads +
                             ".json";
    std::ofstream f(path);
    o.trace->write_chrome_json(f);
  }
}
#endif

#ifdef FERRY_BENCH_NVJPEG
// nvJPEG's batched decode alone: the same files in memory, batches of 256, the hardware backend
// where there is one; `threads` threads, each with its own handle, state and stream, take the
// batches in turn (nvjpegDecodeBatched holds its thread for the whole decode).
Row nvjpeg_ceiling(const std::string& photos, int runs, int threads) {
  std::vector<std::vector<unsigned char>> files;
  for (auto& e : std::filesystem::recursive_directory_iterator(photos)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    files.emplace_back((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  const int B = 256;
  struct Decoder {
    nvjpegHandle_t h = nullptr;
    nvjpegJpegState_t st = nullptr;
    cudaStream_t s = nullptr;
    std::vector<unsigned char*> outs;
  };
  std::vector<Decoder> decoders(static_cast<std::size_t>(threads));
  const char* backend = "hardware";
  for (Decoder& d : decoders) {
    if (nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, nullptr, nullptr, 0, &d.h) != NVJPEG_STATUS_SUCCESS) {
      backend = "GPU hybrid";
      if (nvjpegCreateEx(NVJPEG_BACKEND_GPU_HYBRID, nullptr, nullptr, 0, &d.h) != NVJPEG_STATUS_SUCCESS) return {};
    }
    nvjpegJpegStateCreate(d.h, &d.st);
    cudaStreamCreateWithFlags(&d.s, cudaStreamNonBlocking);
  }
  std::fprintf(stderr, "  (nvJPEG ceiling backend: %s)\n", backend);
  std::size_t max_image = 0;  // the largest decoded image: every output buffer holds it
  for (const auto& f : files) {
    int nc = 0, w[NVJPEG_MAX_COMPONENT], hh[NVJPEG_MAX_COMPONENT];
    nvjpegChromaSubsampling_t sub;
    if (nvjpegGetImageInfo(decoders[0].h, f.data(), f.size(), &nc, &sub, w, hh) == NVJPEG_STATUS_SUCCESS)
      max_image = std::max(max_image, static_cast<std::size_t>(w[0]) * static_cast<std::size_t>(hh[0]) * 3);
  }
  for (Decoder& d : decoders) {
    d.outs.resize(B);
    for (auto& p : d.outs) cudaMalloc(&p, max_image);
  }
  std::atomic<bool> failed{false};
  auto decode_batches = [&](Decoder& d, std::size_t first) {  // batches first, first + threads, ...
    std::vector<const unsigned char*> data(B);
    std::vector<std::size_t> len(B);
    std::vector<nvjpegImage_t> img(B);
    for (std::size_t i = first * B; i + B <= files.size(); i += static_cast<std::size_t>(threads) * B) {
      for (int k = 0; k < B; ++k) {
        data[k] = files[i + k].data();
        len[k] = files[i + k].size();
        int nc = 0, w[NVJPEG_MAX_COMPONENT], hh[NVJPEG_MAX_COMPONENT];
        nvjpegChromaSubsampling_t sub;
        nvjpegGetImageInfo(d.h, data[k], len[k], &nc, &sub, w, hh);
        img[k] = {};
        img[k].channel[0] = d.outs[k];
        img[k].pitch[0] = static_cast<unsigned>(w[0] * 3);
      }
      if (nvjpegDecodeBatchedInitialize(d.h, d.st, B, 1, NVJPEG_OUTPUT_RGBI) != NVJPEG_STATUS_SUCCESS ||
          nvjpegDecodeBatched(d.h, d.st, data.data(), len.data(), img.data(), d.s) != NVJPEG_STATUS_SUCCESS)
        failed = true;
    }
    cudaStreamSynchronize(d.s);
  };
  std::vector<Row> rows;
  const std::size_t n = files.size() / B * B;
  for (int r = 0; r < runs + 1; ++r) {
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        cudaSetDevice(0);
        decode_batches(decoders[static_cast<std::size_t>(t)], static_cast<std::size_t>(t));
      });
    for (auto& t : ts) t.join();
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) rows.push_back({static_cast<double>(n) / wall, (cpu_seconds() - c0) / wall});
  }
  for (Decoder& d : decoders) {
    for (auto& p : d.outs) cudaFree(p);
    nvjpegJpegStateDestroy(d.st);
    nvjpegDestroy(d.h);
    cudaStreamDestroy(d.s);
  }
  if (failed) {
    std::fprintf(stderr, "nvjpegDecodeBatched failed\n");
    return {};
  }
  return median_row(rows);
}
#endif

// "1,2,4" -> {1, 2, 4}
std::vector<int> int_list(const std::string& s) {
  std::vector<int> v;
  for (std::size_t k = 0; k < s.size();) {
    const std::size_t e = std::min(s.find(',', k), s.size());
    v.push_back(std::atoi(s.substr(k, e - k).c_str()));
    k = e + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  // before any CUDA call; an explicit value stays
  std::string photos, tar, trace_dir, step_kind = "all";
  std::vector<int> decode_threads = {1, 2}, step_kernels = {1, 40}, step_blocks = {4, 2};
  bool loop_only = false;
  int runs = 3, steps = 100;
  double step_ms = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--photos" && i + 1 < argc)
      photos = argv[++i];
    else if (a == "--tar" && i + 1 < argc)
      tar = argv[++i];
    else if (a == "--loop-only")
      loop_only = true;
    else if (a == "--step" && i + 1 < argc)
      step_kind = argv[++i];
    else if (a == "--decode-threads" && i + 1 < argc)
      decode_threads = int_list(argv[++i]);
    else if (a == "--step-kernels" && i + 1 < argc)
      step_kernels = int_list(argv[++i]);
    else if (a == "--step-blocks" && i + 1 < argc)
      step_blocks = int_list(argv[++i]);
    else if (a == "--trace-dir" && i + 1 < argc)
      trace_dir = argv[++i];
    else if (a == "--runs" && i + 1 < argc)
      runs = std::atoi(argv[++i]);
    else if (a == "--step-ms" && i + 1 < argc)
      step_ms = std::atof(argv[++i]);
    else if (a == "--steps" && i + 1 < argc)
      steps = std::atoi(argv[++i]);
  }
  if (photos.empty()) {
    std::fprintf(stderr, "usage: bench_gpu_decode --photos DIR [--runs N]\n");
    return 2;
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  std::printf(
      "bench_gpu_decode: %s, %d hardware threads; RandomResizedCrop 224 + flip + to_float + normalize, batch 256, on cuda:0; "
      "CUDA_DEVICE_MAX_CONNECTIONS=%s\n\n",
      photos.c_str(), cores, std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"));
  double ceiling = 0;
#ifdef FERRY_BENCH_NVJPEG
  const Row c = loop_only ? Row{} : nvjpeg_ceiling(photos, runs, 1);
  const Row c2 = loop_only ? Row{} : nvjpeg_ceiling(photos, runs, 2);
  ceiling = c.images_per_s;
#endif
  if (!loop_only) {
    std::printf("| pipeline | images/s | busy cores | images/s per busy core | of the ceiling |\n|---|---:|---:|---:|---:|\n");
#ifdef FERRY_BENCH_NVJPEG
    print("nvJPEG batched decode alone (the ceiling), 1 thread", c, ceiling);
    print("nvJPEG batched decode alone, 2 threads", c2, ceiling);
#endif
    print("ferry, GPU decode, 2 workers, 1 decode thread",
          loader_row(images(photos, ImageFolderOptions::Decode::Gpu), 2, runs, 1), ceiling);
    for (int w : {1, 2, 4}) {
      const std::string name = "ferry, GPU decode, " + std::to_string(w) + " worker" + (w > 1 ? "s" : "") + ", 2 decode threads";
      print(name.c_str(), loader_row(images(photos, ImageFolderOptions::Decode::Gpu), w, runs), ceiling);
    }
    if (!tar.empty()) {
      const std::vector<std::string> shards = write_shards(images(photos, ImageFolderOptions::Decode::Cpu), tar);
      const auto t0 = Clock::now();
      TarImages indexed = tar_images(shards);
      std::fprintf(stderr, "  (%zu shards, %zu records indexed in %.0f ms)\n", shards.size(), indexed.size(),
                   std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      print("ferry, GPU decode, indexed tar shards (TarImages), 2 workers", loader_row(std::move(indexed), 2, runs), ceiling);
    }
    const std::string name = "ferry, CPU decode, " + std::to_string(cores) + " workers";
    print(name.c_str(), loader_row(images(photos, ImageFolderOptions::Decode::Cpu), cores, runs), ceiling);
  }
#ifdef FERRY_BENCH_TRAINING_LOOP
  if (steps > 0)
    std::printf("\n## training loop: %.0f ms GPU steps of 256 images (%.0f images/s)\n\n", step_ms, 256 * 1000 / step_ms);
  if (steps > 0) {
    std::printf(
        "| loader | decode threads | kernels a step | step's blocks of 256 a SM, or its products | step alone (wall) | step "
        "alone (GPU) | steps | "
        "GPU waiting for data | of it, for an epoch's first batch | step's GPU time vs. alone | wall lost vs. steps alone |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    // The step's footprint decides what nvJPEG gets of the GPU (Note [Decode threads]). Matrix
    // products (a model's step: short blocks that fill an SM); then the arithmetic kernel, whose
    // blocks hold 4 or 2 of 8 blocks of 256 a SM for the whole kernel, as one long kernel and as 40.
    if (step_kind != "arith") {
      for (int threads : decode_threads)
        training_loop(photos, ImageFolderOptions::Decode::Gpu, 2, step_ms, steps, 0, 0, threads, trace_dir);
      if (!loop_only) training_loop(photos, ImageFolderOptions::Decode::Cpu, cores, step_ms, steps, 0, 0, 2, trace_dir);
    }
    if (step_kind != "matmul") {
      for (int kernels : step_kernels)
        for (int blocks : step_blocks)
          for (int threads : decode_threads)
            training_loop(photos, ImageFolderOptions::Decode::Gpu, 2, step_ms, steps, kernels, blocks, threads, trace_dir);
      if (!loop_only) training_loop(photos, ImageFolderOptions::Decode::Cpu, cores, step_ms, steps, 40, 4, 2, trace_dir);
    }
  }
#endif
  (void)step_ms;
  (void)steps;
  return 0;
}
