// The demo: trains a small MLP on Fashion-MNIST through ferry, on the GPU when there is one.
//
// Workers decode nothing here (the IDX files are memory-mapped) but augment every image (random
// horizontal flip), convert it to float and normalize it, writing it straight into its row of a
// pinned batch (direct mode); with a GPU, the device stage copies each batch on a side stream
// while the model (cuBLAS) trains on the previous one. Without a GPU the same loop runs on the
// CPU. Reaching 80%+ test accuracy proves images and labels stayed paired through every stage.
//
//   build/default/examples/fashion_mnist/train_fashion_mnist [--epochs 3] [--cpu] [--min-accuracy 0.8]
//       [--checkpoint-dir DIR --checkpoint-every N] [--resume] [--stop-after N]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <unistd.h>

#include "ferry/ferry.h"
#include "data.h"
#include "mlp.h"

namespace {

using Clock = std::chrono::steady_clock;

// The progress bar is for a terminal: into a log it would be one long line of carriage returns.
const bool kProgress = isatty(STDERR_FILENO) != 0;

void progress(int epoch, int epochs, std::size_t done, std::size_t total, const demo::Metrics& m, double seconds) {
  if (!kProgress) return;
  constexpr int kWidth = 30;
  const int filled = total ? static_cast<int>(kWidth * done / total) : kWidth;
  std::string bar(static_cast<std::size_t>(filled), '=');
  if (filled < kWidth) bar += '>' + std::string(static_cast<std::size_t>(kWidth - filled - 1), ' ');
  std::fprintf(stderr, "\repoch %d/%d [%s] %4zu/%zu  loss %.4f  acc %5.1f%%  %6.0f img/s", epoch, epochs, bar.c_str(), done,
               total, m.samples ? m.loss / m.samples : 0.0, m.samples ? 100.0 * m.correct / m.samples : 0.0,
               seconds > 0 ? m.samples / seconds : 0.0);
  std::fflush(stderr);
}

demo::Metrics& operator+=(demo::Metrics& a, const demo::Metrics& b) {
  a.loss += b.loss;
  a.correct += b.correct;
  a.samples += b.samples;
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line in order with stderr's, also into a file
  CLI::App app{"Train an MLP on Fashion-MNIST through ferry"};
  std::string data = "/usr/share/datasets/fashion-mnist";
  int epochs = 3, workers = -1, hidden = 256;
  std::size_t batch_size = 128;
  float lr = 0.05f;
  bool cpu = false;
  double min_accuracy = 0;
  std::uint64_t seed = 1;
  app.add_option("--data", data, "folder with the four IDX files (Debian's dataset-fashion-mnist)");
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size)->check(CLI::PositiveNumber);
  app.add_option("--workers", workers,
                 "loader workers (default: none with a GPU, which gathers and transforms the rows itself; up to 8 with "
                 "--gather host; 4, or 1 on a small CPU-only machine)");
  std::string gather = "auto";
  app.add_option("--gather", gather,
                 "with a GPU: auto or device (the GPU gathers, flips and normalizes the images from "
                 "registered host memory), or host (workers do it on the CPU)")
      ->check(CLI::IsMember({"auto", "host", "device"}));
  app.add_option("--hidden", hidden, "hidden units")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "learning rate (SGD, momentum 0.9)")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed);
  app.add_flag("--cpu", cpu, "train on the CPU even when a GPU is present");
  app.add_option("--min-accuracy", min_accuracy, "exit 1 unless the final test accuracy reaches this (0..1)");
  std::string checkpoint_dir;
  std::size_t checkpoint_every = 0, stop_after = 0;
  bool resume = false;
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "where checkpoints go: the model (model.bin) and the loader's state (loader.state)");
  app.add_option("--checkpoint-every", checkpoint_every, "save a checkpoint every N training steps (needs --checkpoint-dir)");
  app.add_flag("--resume", resume, "continue from the checkpoint in --checkpoint-dir, if there is one");
  app.add_option("--stop-after", stop_after,
                 "stop after N training steps of this run, as a preempted job would (for trying --resume)");
  CLI11_PARSE(app, argc, argv);

  try {
    namespace fs = std::filesystem;
    const bool gpu = FERRY_DEMO_GPU && !cpu && ferry::cuda::available();
    const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    // The GPU eats batches faster than 4 workers augment them (the loader report says so): give
    // the loader most of a large host; on a small CPU-only machine the model needs the cores.
    const ferry::Gather how = ferry::parse_gather(gather, "--gather");
    // With a GPU the loader gathers each batch's rows on the device (flip and normalize included,
    // Note [Device gather]): workers would only write the batch's indices.
    if (workers < 0) workers = gpu ? (how == ferry::Gather::Host ? std::clamp(hw - 2, 1, 8) : 0) : (hw > 4 ? 4 : 1);

    // Augment (flip) while training; both sets become float32, normalized with the dataset's stats.
    auto [train, test] =
        demo::load_fashion_mnist(data, "install Debian's dataset-fashion-mnist (scripts/install-deps.sh) or pass --data");

    ferry::DataLoaderOptions o;
    o.batch_size = batch_size;
    o.shuffle = true;
    o.num_workers = workers;
    o.seed = seed;
    o.persistent_workers = workers > 0;
    if (gpu) o.device = 0;  // batches made on a side stream, ordered before the model's work
    if (gpu) o.gather = how;
    ferry::DataLoader loader(train, o);
    ferry::DataLoaderOptions eo = o;
    eo.shuffle = false;
    eo.batch_size = 1000;
    // Test batches are delivered on the training loader's stream, where the model runs.
    if (gpu) eo.consumer_stream = loader.stream()->native();
    ferry::DataLoader test_loader(test, eo);

    demo::MlpConfig mc;
    mc.hidden = hidden;
    mc.lr = lr;
    mc.seed = seed;
    std::unique_ptr<demo::Mlp> model;
#if FERRY_DEMO_GPU
    if (gpu) model = demo::make_gpu_mlp(mc, 0, loader.stream()->native());  // on the stream batches arrive on
#endif
    if (!model) model = demo::make_cpu_mlp(mc, hw);  // the loader's workers are mostly idle: all cores
    std::printf("ferry demo: MLP %d-%d-10 on Fashion-MNIST (%zu train, %zu test images), %s, batch %zu, %d worker%s%s\n", mc.in,
                mc.hidden, train.size(), test.size(), model->where(), batch_size, workers, workers == 1 ? "" : "s",
                !gpu                           ? (ferry::cuda::available() ? "" : " (no CUDA device: CPU)")
                : loader.stats().device_gather ? ", device gather (flip + normalize on the GPU)"
                                               : ", pinned + device stage");

    if ((checkpoint_every || resume) && checkpoint_dir.empty())
      throw ferry::Error("--checkpoint-every and --resume need --checkpoint-dir");
    const std::string model_file = checkpoint_dir + "/model.bin", state_file = checkpoint_dir + "/loader.state";
    if (resume && fs::exists(state_file)) {
      // The checkpoint: the model's weights, and where the loader stood when they were saved. The
      // loader goes on with the next batch (same order, same augmentations), any worker count.
      model->load(demo::read_checkpoint(model_file, mc));
      std::ifstream in(state_file);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      loader.restore(ferry::LoaderState::from_string(text));
      const ferry::LoaderState s = loader.state();
      std::printf("resumed from %s: epoch %llu, after batch %llu of %llu\n", checkpoint_dir.c_str(),
                  static_cast<unsigned long long>(s.epoch + 1), static_cast<unsigned long long>(s.batches),
                  static_cast<unsigned long long>(s.batches_per_epoch));
    }
    if (!checkpoint_dir.empty()) fs::create_directories(checkpoint_dir);
    auto save_checkpoint = [&] {
      demo::write_checkpoint(model_file, model->save(), mc);  // (synchronizes with the GPU)
      const std::string tmp = state_file + ".tmp";
      std::ofstream(tmp) << loader.state().to_string();
      fs::rename(tmp, state_file);  // the model first: a state never points past its weights
    };

    double accuracy = 0;
    const bool tty = isatty(2) != 0;
    std::size_t steps = 0;
    while (loader.next_epoch() < static_cast<std::uint64_t>(epochs)) {
      const int epoch = static_cast<int>(loader.next_epoch()) + 1;
      const auto t0 = Clock::now();
      auto last = t0;
      demo::Metrics seen;
      std::size_t done = loader.state().batches;  // past 0 in a resumed epoch
      for (ferry::LabeledBatch& b : loader) {
        model->train_step(b.image, b.label);
        ++done;
        ++steps;
        if (checkpoint_every && steps % checkpoint_every == 0) save_checkpoint();
        if (stop_after && steps == stop_after) {
          std::printf("stopped after %zu steps (--stop-after); --resume continues from the last checkpoint\n", steps);
          return 0;
        }
        // A live bar on a terminal; in a log, one line per epoch.
        if ((tty && Clock::now() - last > std::chrono::milliseconds(200)) || done == loader.size()) {
          last = Clock::now();
          seen += model->take();  // synchronizes with the GPU: only a few times a second
          progress(epoch, epochs, done, loader.size(), seen, std::chrono::duration<double>(last - t0).count());
        }
      }
      seen += model->take();
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      for (ferry::LabeledBatch& b : test_loader) model->evaluate(b.image, b.label);
      const demo::Metrics t = model->take();
      accuracy = static_cast<double>(t.correct) / static_cast<double>(t.samples);
      if (kProgress) std::fprintf(stderr, "\n");
      std::printf(
          "epoch %d: train loss %.4f, train accuracy %.1f%%, test loss %.4f, test accuracy %.1f%% (%.2f s, %.0f images/s)\n",
          epoch, seen.loss / seen.samples, 100.0 * seen.correct / seen.samples, t.loss / t.samples, 100 * accuracy, seconds,
          seen.samples / seconds);
    }
    std::printf("\nloader report (training loader, all epochs):\n%s", loader.stats().report().c_str());
    if (loader.pinned_pool()) {
      const ferry::PinnedPoolStats p = loader.pinned_pool()->stats();
      std::printf("pinned pool: %.1f MiB in %zu blocks; %llu cudaHostAlloc calls served %llu leases; %llu waits\n",
                  p.bytes_pinned / 1048576.0, p.blocks, static_cast<unsigned long long>(p.allocations),
                  static_cast<unsigned long long>(p.leases), static_cast<unsigned long long>(p.waits));
    }
    if (accuracy < min_accuracy) {
      std::fprintf(stderr, "test accuracy %.1f%% is below --min-accuracy %.1f%%\n", 100 * accuracy, 100 * min_accuracy);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\ntrain_fashion_mnist: %s\n", e.what());
    return 1;
  }
  return 0;
}
