// ferry — the command-line tool: bench, tune and trace any dataset ferry can load.
//
//   ferry bench synthetic -c n=20000,shape=3x224x224 --batch-size 256 --workers 4 --pin
//   ferry bench idx -c images=/usr/share/.../train-images-idx3-ubyte.gz,labels=... --json
//   ferry bench ramp --plugin build/examples/plugin/libferry_ramp_plugin.so -c n=100000
//   ferry bench tar -c dir=shards/,size=224 --workers 8
//   ferry bench tar_index -c dir=shards/,random_crop=1,decode=gpu --workers 2 --device 0
//   ferry tune synthetic -c n=20000 --batch-size 256 --pin --cpus 8
//   ferry trace image_folder -c root=photos --workers 4 --pin --batches 20 -o trace.json
//
// Datasets come from the registry (ferry/loaders/registry.h: idx, npy, image_folder, tar_index,
// synthetic, and whatever --plugin libraries register), plus "tar" (WebDataset shards read as a stream:
// dir=<folder of .tar> or shards=a.tar:b.tar, size=224, random_crop=0|1). Every batch is a
// std::vector<Tensor>; its first tensor's first dimension counts the samples.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <unistd.h>

#include "cpu_time.h"  // bench/: the benchmarks' busy-cores clock
#include "ferry/ferry.h"

namespace {

using ferry::DataLoaderOptions;
using ferry::Tensor;
using Clock = std::chrono::steady_clock;

// The loader options the tool exposes, with PyTorch's names where there is one.
struct Flags {
  std::string dataset;
  std::string config;
  std::vector<std::string> plugins;
  std::size_t batch_size = 256;
  int workers = 4;
  int prefetch = 2;
  bool pin = false;
  std::string pin_mode = "direct";
  int pin_threads = 4;
  int device = -1;
  std::string gather = "auto";
  int intra = 1;
  bool shuffle = true;
  bool drop_last = false;
  std::uint64_t seed = 0;
  std::size_t batches = 0;  // 0: whole epochs
  int epochs = 1;
  double consumer_ms = 0;  // simulated training step per batch
  std::string on_error = "raise";
  std::size_t max_errors = 0;
  double max_error_fraction = 0.1;
  int timeout_ms = 0;
  bool persistent = false;
  bool ahead = true;
  int gpu_decode_threads = DataLoaderOptions{}.gpu_decode_threads;

  DataLoaderOptions options() const {
    DataLoaderOptions o;
    o.batch_size = batch_size;
    o.num_workers = workers;
    o.prefetch_factor = prefetch;
    o.pin_memory = pin;  // a device implies it (ferry::detail::normalize_options)
    if (pin_mode != "copy" && pin_mode != "direct")
      throw ferry::Error("--pin-mode must be 'copy' or 'direct', got '" + pin_mode + "'");
    o.pin_mode = pin_mode == "copy" ? DataLoaderOptions::PinMode::Copy : DataLoaderOptions::PinMode::Direct;
    o.pin_threads = pin_threads;
    if (device >= 0) o.device = device;
    o.gather = ferry::parse_gather(gather, "--gather");
    o.intra_batch_threads = intra;
    o.shuffle = shuffle;
    o.drop_last = drop_last;
    o.seed = seed;
    o.on_error = ferry::parse_on_error(on_error, "--on-error");
    o.max_errors = max_errors;
    o.max_error_fraction = max_error_fraction;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    o.persistent_workers = persistent;  // with no worker, normalize_options says why
    o.prefetch_next_epoch = ahead;
    o.gpu_decode_threads = gpu_decode_threads;
    return o;
  }
};

// Whether a loader with these flags pins its batches: the library's rule (a device implies it).
bool pins(const Flags& f) {
  DataLoaderOptions o = f.options();
  o.shuffle = false;  // irrelevant here, and refused for a stream
  return ferry::detail::normalize_options(o, false).pin_memory;
}

void add_loader_flags(CLI::App& app, Flags& f) {
  app.add_option("dataset", f.dataset,
                 "dataset name: idx, npy, image_folder, tar_index, tar, tokens, megatron, synthetic, or one a plugin registers")
      ->required();
  app.add_option("-c,--config", f.config, "dataset options, key=value,key=value (see `ferry list`)");
  app.add_option("--plugin", f.plugins, "load a dataset plugin library first (repeatable)");
  app.add_option("-b,--batch-size", f.batch_size, "samples per batch")->check(CLI::PositiveNumber);
  app.add_option("-w,--workers", f.workers, "num_workers (0: batches made on the consumer thread)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--prefetch", f.prefetch, "prefetch_factor: batches in flight per worker")->check(CLI::PositiveNumber);
  app.add_flag("--pin", f.pin, "pin_memory: deliver batches in pinned memory");
  app.add_option("--pin-mode", f.pin_mode, "copy or direct")->check(CLI::IsMember({"copy", "direct"}));
  app.add_option("--pin-threads", f.pin_threads, "threads copying one batch into pinned memory")->check(CLI::PositiveNumber);
  app.add_option("--device", f.device, "deliver batches on CUDA device N (implies --pin)");
  app.add_option("--gather", f.gather,
                 "with --device: how the rows of npy and idx datasets reach the GPU: host (workers copy and transform them; also "
                 "what auto does for a mapped file) or device (the GPU gathers them from registered memory, idx's flip and "
                 "normalize included)")
      ->check(CLI::IsMember({"auto", "host", "device"}));
  app.add_option("--gpu-decode-threads", f.gpu_decode_threads,
                 "with --device and decode=gpu: batches nvJPEG decodes at once, each on a host thread of its own "
                 "(0, the default: 2 where the GPU has JPEG engines and the host 8 CPUs, else 1)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--intra-threads", f.intra, "intra_batch_threads: threads per batch")->check(CLI::PositiveNumber);
  app.add_option("--shuffle", f.shuffle, "shuffle (map-style datasets)");
  app.add_flag("--drop-last", f.drop_last, "drop a last, smaller batch");
  app.add_option("--seed", f.seed, "seed of the shuffle and the augmentations");
  app.add_option("--on-error", f.on_error,
                 "what a damaged or stuck sample costs: raise (its batch), skip (itself), replace (nothing: another sample takes "
                 "its row)")
      ->check(CLI::IsMember({"raise", "skip", "replace"}));
  app.add_option("--max-errors", f.max_errors,
                 "skip/replace: more bad samples than this in an epoch is an error (0: no count limit)");
  app.add_option("--max-error-fraction", f.max_error_fraction, "skip/replace: the same as a fraction of the epoch")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--timeout-ms", f.timeout_ms,
                 "timeout: a batch stuck this long fails (or, with skip/replace, is made again without its stuck sample)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--persistent-workers", f.persistent, "keep the workers across epochs");
  app.add_option("--prefetch-next-epoch", f.ahead,
                 "with persistent workers: make the next epoch's first batches while the current epoch ends (default 1)");
  app.add_option("-n,--batches", f.batches, "stop after this many batches (0: whole epochs)");
  app.add_option("--epochs", f.epochs, "epochs to run when --batches is 0")->check(CLI::PositiveNumber);
  app.add_option("--consumer-ms", f.consumer_ms, "simulated work per batch on the consumer, in ms (a training step)")
      ->check(CLI::NonNegativeNumber);
}

// --- datasets -----------------------------------------------------------------------------------

// Calls fn(loader) with a loader over the named dataset (DatasetRegistry::open).
template <class Fn>
auto with_loader(const Flags& f, const DataLoaderOptions& o, Fn&& fn) {
  auto& registry = ferry::DatasetRegistry::global();
  for (const auto& p : f.plugins) registry.load_plugin(p);
  ferry::OpenedDataset opened = registry.open(f.dataset, f.config);
  return std::visit(
      [&](auto& dataset) {
        DataLoaderOptions so = o;
        if constexpr (ferry::IterableDataset<std::decay_t<decltype(dataset)>>)
          so.shuffle = false;  // a stream: the dataset shuffles its shard order itself
        ferry::DataLoader loader(std::move(dataset), so);
        return fn(loader);
      },
      opened);
}

// Calls fn(tensor) for each tensor of a batch, whichever batch type the loader delivers.
template <class Fn>
void for_each_field(const std::vector<Tensor>& b, Fn&& fn) {
  for (const Tensor& t : b) fn(t);
}
template <class Fn>
void for_each_field(const ferry::LabeledBatch& b, Fn&& fn) {
  fn(b.image);
  fn(b.label);
}

// --- running ------------------------------------------------------------------------------------

struct Run {
  ferry::LoaderStats stats;
  ferry::ObjectStoreStats store;  // what this run read from object storage (s3:// paths)
  std::uint64_t samples = 0, bytes = 0, errors = 0;
  double seconds = 0;
  double cpu_seconds = 0;  // the process's CPU time (user + system, every thread) over the timed run
  std::string first_error;
  double samples_per_second() const { return seconds > 0 ? samples / seconds : 0; }
  double mb_per_second() const { return seconds > 0 ? bytes / seconds / 1e6 : 0; }
};

// A progress line is on the terminal, not yet ended by a newline (an error printed then starts a line of its own).
bool g_progress_open = false;

// Iterates the loader (f.batches batches, or f.epochs epochs); a progress line on stderr when
// `progress`. Bad samples (DataError) are counted and skipped, as a training loop would.
template <class Loader>
Run run_loader(Loader& loader, const Flags& f, bool progress, std::size_t warmup = 0) {
  Run r;
  const ferry::ObjectStoreStats store0 = ferry::object_store_stats();
  auto t0 = Clock::now();
  double cpu0 = ferry::bench::cpu_seconds();
  auto last_print = t0;
  std::size_t seen = 0;
  bool warm = warmup == 0;
  // A progress line rewritten in place on a terminal; into a log or pipe, only the final line
  // (carriage returns there make one unreadable line).
  const bool tty = isatty(STDERR_FILENO) != 0;
  auto print = [&](bool final) {
    if (!tty && !final) return;
    g_progress_open = tty && !final;
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::fprintf(stderr, "%s%8llu batches  %9.1f batches/s  %11.0f samples/s  %9.1f MB/s%s", tty ? "\r" : "",
                 static_cast<unsigned long long>(seen), seen / std::max(s, 1e-9), r.samples / std::max(s, 1e-9),
                 r.bytes / std::max(s, 1e-9) / 1e6, final ? "\n" : "");
    std::fflush(stderr);
  };
  for (int epoch = 0; f.batches > 0 || epoch < f.epochs; ++epoch) {
    bool any = false;
    auto it = loader.begin();
    for (;;) {
      try {
        if (it == loader.end()) break;
        const auto& b = *it;
        any = true;
        if (!warm && ++seen >= warmup) {
          warm = true;
          seen = 0;
          loader.reset_stats();
          t0 = Clock::now();
          cpu0 = ferry::bench::cpu_seconds();
          Run fresh;  // the warm-up's errors stay counted
          fresh.errors = r.errors;
          fresh.first_error = r.first_error;
          r = std::move(fresh);
        } else if (warm) {
          ++seen;
          bool first = true;  // the first field's rows are the batch's samples
          for_each_field(b, [&](const Tensor& t) {
            if (first && t.dim() > 0) r.samples += static_cast<std::uint64_t>(t.size(0));
            first = false;
            r.bytes += t.nbytes();
          });
        }
        if (f.consumer_ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(f.consumer_ms));
        ++it;
      } catch (const ferry::DataError& e) {
        // The failed batch is consumed: the iterator already stands on the next one (no ++it).
        ++r.errors;
        if (r.first_error.empty()) r.first_error = e.what();
      }
      if (progress && Clock::now() - last_print > std::chrono::milliseconds(250)) {
        last_print = Clock::now();
        print(false);
      }
      if (f.batches > 0 && warm && seen >= f.batches) break;
    }
    if (f.batches > 0 && warm && seen >= f.batches) break;
    if (!any) {
      const ferry::LoaderStats s = loader.stats();
      const std::string first = !s.first_errors.empty() ? s.first_errors.front() : r.first_error;
      if (s.samples_skipped > 0)
        throw ferry::Error("no batch was left: " + std::to_string(s.samples_skipped) + " record" +
                           (s.samples_skipped == 1 ? " was" : "s were") + " skipped as damaged (--on-error " + f.on_error +
                           "); the first: " + first);
      if (r.errors > 0)
        throw ferry::Error("every batch failed (" + std::to_string(r.errors) + " data error" + (r.errors == 1 ? "" : "s") +
                           "; --on-error skip or replace costs a bad sample only itself); the first: " + r.first_error);
      throw ferry::Error("the dataset produced no batches (is it empty, or smaller than one batch with --drop-last?)");
    }
  }
  // Device batches: the run ends when the GPU has written the last of them.
  if (const ferry::cuda::Stream* stream = loader.stream()) stream->synchronize();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.cpu_seconds = ferry::bench::cpu_seconds() - cpu0;
  r.stats = loader.stats();
  const ferry::ObjectStoreStats store1 = ferry::object_store_stats();
  r.store = store1.since(store0);
  if (progress) print(true);
  return r;
}

// Every LoaderStats field and derived value, by the library's names (LoaderStats::for_each).
nlohmann::json stats_json(const ferry::LoaderStats& s) {
  nlohmann::json j = nlohmann::json::object();
  s.for_each([&](const char* name, const auto& value) { j[name] = value; });
  return j;
}

nlohmann::json store_json(const ferry::ObjectStoreStats& s) {
  nlohmann::json j = nlohmann::json::object();
  s.for_each([&](const char* name, std::uint64_t value) { j[name] = value; });
  return j;
}

nlohmann::json to_json(const Run& r, const Flags& f) {
  const auto& s = r.stats;
  return {{"dataset", f.dataset},
          {"config", f.config},
          {"options",
           {{"batch_size", f.batch_size},
            {"num_workers", f.workers},
            {"prefetch_factor", f.prefetch},
            {"pin_memory", pins(f)},
            {"pin_mode", f.pin_mode},
            {"pin_threads", f.pin_threads},
            {"device", f.device},
            {"gather", f.gather},
            {"intra_batch_threads", f.intra}}},
          {"batches", s.batches},
          {"samples", r.samples},
          {"bytes", r.bytes},
          {"seconds", r.seconds},
          {"cpu_seconds", r.cpu_seconds},
          {"batches_per_second", s.batches / std::max(r.seconds, 1e-9)},
          {"samples_per_second", r.samples_per_second()},
          {"mb_per_second", r.mb_per_second()},
          {"data_errors", r.errors},
          {"stats", stats_json(s)},
          {"object_store", store_json(r.store)},
          {"bottleneck", s.bottleneck()}};
}

void print_report(const Run& r, const Flags& f) {
  const std::string pin =
      !r.stats.pinning ? (f.pin ? "not pinned (no CUDA device)" : "not pinned")
                       : "pin " + f.pin_mode + (f.pin_mode == "copy" ? " (" + std::to_string(f.pin_threads) + " threads)" : "");
  std::printf("dataset %s%s%s, batch %zu, %d workers, prefetch %d, %s%s\n", f.dataset.c_str(), f.config.empty() ? "" : " ",
              f.config.c_str(), f.batch_size, f.workers, f.prefetch, pin.c_str(),
              f.device >= 0 ? (", device cuda:" + std::to_string(f.device)).c_str() : "");
  std::printf("%.1f batches/s, %.0f samples/s, %.1f MB/s over %.2f s, %.2f busy cores (the process's CPU time over that)\n",
              r.stats.batches / std::max(r.seconds, 1e-9), r.samples_per_second(), r.mb_per_second(), r.seconds,
              r.cpu_seconds / std::max(r.seconds, 1e-9));
  if (r.errors)
    std::printf("%llu batch%s failed with bad data (--on-error skip or replace costs a bad sample only itself); the first: %s\n",
                static_cast<unsigned long long>(r.errors), r.errors == 1 ? "" : "es", r.first_error.c_str());
  if (r.store.requests || r.store.cache_hits)
    std::printf(
        "object store: %llu requests, %.1f MB, %llu retried, %llu hedged (%llu answered first); on-disk cache: %llu "
        "reads, %.1f MB\n",
        static_cast<unsigned long long>(r.store.requests), r.store.bytes / 1e6, static_cast<unsigned long long>(r.store.retries),
        static_cast<unsigned long long>(r.store.hedges), static_cast<unsigned long long>(r.store.hedges_won),
        static_cast<unsigned long long>(r.store.cache_hits), r.store.cache_bytes / 1e6);
  std::printf("%s", r.stats.report().c_str());
}

// --- tune ---------------------------------------------------------------------------------------

struct Trial {
  Flags flags;
  double batches_per_second = 0;
  std::string bottleneck;
};

int tune(Flags base, int cpus, double seconds_per_trial) {
  const int hw = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (cpus <= 0) cpus = hw;
  // Threads a setting keeps busy: workers x intra-batch threads, plus the pin thread's copiers.
  auto threads = [](const Flags& f) {
    return std::max(f.workers, 1) * f.intra + (pins(f) && f.pin_mode == "copy" ? f.pin_threads : 0);
  };
  std::vector<Trial> trials;
  auto measure = [&](Flags f) -> double {
    if (threads(f) > cpus) return -1;
    for (const Trial& t : trials)
      if (t.flags.workers == f.workers && t.flags.prefetch == f.prefetch && t.flags.pin_mode == f.pin_mode &&
          t.flags.pin_threads == f.pin_threads && t.flags.intra == f.intra)
        return t.batches_per_second;
    // Enough batches for seconds_per_trial at the rate of a short first look.
    f.batches = 8;
    const Run probe = with_loader(f, f.options(), [&](auto& loader) { return run_loader(loader, f, false, 4); });
    const double rate = probe.stats.batches / std::max(probe.seconds, 1e-9);
    f.batches = std::max<std::size_t>(16, static_cast<std::size_t>(rate * seconds_per_trial));
    const Run r = with_loader(f, f.options(), [&](auto& loader) { return run_loader(loader, f, false, 4); });
    Trial t{f, r.stats.batches / std::max(r.seconds, 1e-9), r.stats.bottleneck()};
    std::printf("  workers %2d  intra %d  prefetch %d  %-22s %9.1f batches/s  bottleneck %s\n", f.workers, f.intra, f.prefetch,
                pins(f) ? ("pin " + f.pin_mode + (f.pin_mode == "copy" ? " x" + std::to_string(f.pin_threads) : "")).c_str() : "",
                t.batches_per_second, t.bottleneck.c_str());
    std::fflush(stdout);
    trials.push_back(t);
    return t.batches_per_second;
  };
  std::printf("tuning %s on %d of %d cpus, about %.1f s per trial\n", base.dataset.c_str(), cpus, hw, seconds_per_trial);
  // 1. workers: 1, 2, 4, ... up to the budget (one thread per batch).
  Flags best = base;
  best.intra = 1;
  best.pin_threads = 1;
  double best_rate = -1;
  // Measures the best setting so far with `change` applied; keeps it when over 3% faster.
  auto try_change = [&](auto&& change) {
    Flags f = best;
    change(f);
    const double rate = measure(f);
    if (rate > best_rate * 1.03) {
      best_rate = rate;
      best = f;
    }
  };
  for (int w = 1; w <= cpus; w *= 2) try_change([&](Flags& f) { f.workers = w; });
  // 2. fewer workers, several threads each (large batches gather faster that way).
  for (int intra : {2, 4, 8})
    for (int w : {1, 2}) try_change([&](Flags& f) { f.workers = w, f.intra = intra; });
  // 3. prefetch depth.
  for (int p : {4, 8}) try_change([&](Flags& f) { f.prefetch = p; });
  // 4. pin mode, and pin threads for copy mode.
  if (pins(base)) {
    try_change([](Flags& f) { f.pin_mode = "direct", f.pin_threads = 1; });
    for (int pt : {1, 4, 8}) try_change([&](Flags& f) { f.pin_mode = "copy", f.pin_threads = pt; });
  }
  if (best_rate <= 0) throw ferry::Error("tune: no setting fits in --cpus " + std::to_string(cpus));
  double fastest = 0;
  for (const Trial& t : trials) fastest = std::max(fastest, t.batches_per_second);
  std::printf(
      "\nbest: %.1f batches/s (%d trials). A change is kept only when it is over 3%% faster than the setting\n"
      "kept before it (trials differ by a few percent run to run), so the fewest threads that reach the\n"
      "rate win%s. Paste:\n\n",
      best_rate, static_cast<int>(trials.size()),
      fastest > best_rate ? (" (the fastest trial, " + std::to_string(static_cast<long>(fastest)) +
                             " batches/s, was within 3% of a simpler setting)")
                                .c_str()
                          : "");
  std::printf("  ferry::DataLoaderOptions options;\n");
  std::printf("  options.batch_size = %zu;\n", best.batch_size);
  std::printf("  options.num_workers = %d;\n", best.workers);
  std::printf("  options.prefetch_factor = %d;\n", best.prefetch);
  if (best.intra > 1) std::printf("  options.intra_batch_threads = %d;\n", best.intra);
  if (best.pin && best.device < 0 && !ferry::cuda::available()) {
    std::printf("  // pin_memory left out: no CUDA device here (%s), so pinning would deliver pageable batches\n",
                ferry::cuda::unavailable_reason().c_str());
  } else if (pins(best)) {
    std::printf("  options.pin_memory = true;\n");
    std::printf("  options.pin_mode = ferry::DataLoaderOptions::PinMode::%s;\n", best.pin_mode == "copy" ? "Copy" : "Direct");
    if (best.pin_mode == "copy") std::printf("  options.pin_threads = %d;\n", best.pin_threads);
  }
  if (best.device >= 0) std::printf("  options.device = %d;\n", best.device);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // nvJPEG's kernels run on streams of its own, which with CUDA's default of 8 hardware queues wait
  // behind the consumer's work (Note [Decode threads]); an explicit value in the environment stays.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  CLI::App app{"ferry: benchmark, tune and trace ferry data loaders"};
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // every option's help shows its default

  Flags bench_flags;
  bool json = false;
  auto* bench = app.add_subcommand("bench", "iterate a dataset and report throughput and where the time went");
  add_loader_flags(*bench, bench_flags);
  bench->add_flag("--json", json, "print the report as JSON on stdout (no progress line)");
  std::size_t warmup = 4;
  bench->add_option("--warmup", warmup, "batches run before measuring");

  Flags tune_flags;
  int cpus = 0;
  double trial_seconds = 2.0;
  auto* tune_cmd = app.add_subcommand("tune", "search workers, intra-batch threads, prefetch and pin settings for throughput");
  add_loader_flags(*tune_cmd, tune_flags);
  tune_cmd->add_option("--cpus", cpus, "CPU budget: threads the loader may keep busy (default: all)");
  tune_cmd->add_option("--seconds", trial_seconds, "seconds per trial")->check(CLI::PositiveNumber);

  Flags trace_flags;
  std::string trace_out = "ferry-trace.json";
  auto* trace_cmd =
      app.add_subcommand("trace", "write a Chrome trace of the first N batches (chrome://tracing, ui.perfetto.dev)");
  add_loader_flags(*trace_cmd, trace_flags);
  trace_cmd->add_option("-o,--out", trace_out, "output file");

  auto* list = app.add_subcommand("list", "list the datasets and their options");
  std::vector<std::string> list_plugins;
  list->add_option("--plugin", list_plugins, "load a dataset plugin library first");

  CLI11_PARSE(app, argc, argv);
  try {
    if (bench->parsed()) {
      const Run r = with_loader(bench_flags, bench_flags.options(),
                                [&](auto& loader) { return run_loader(loader, bench_flags, !json, warmup); });
      if (json)
        std::cout << to_json(r, bench_flags).dump(2) << "\n";
      else
        print_report(r, bench_flags);
    } else if (tune_cmd->parsed()) {
      return tune(tune_flags, cpus, trial_seconds);
    } else if (trace_cmd->parsed()) {
      Flags f = trace_flags;
      if (f.batches == 0) f.batches = 20;
      auto trace = std::make_shared<ferry::TraceRecorder>(static_cast<std::int64_t>(f.batches));
      DataLoaderOptions o = f.options();
      o.trace = trace;
      const Run r = with_loader(f, o, [&](auto& loader) { return run_loader(loader, f, true, 0); });
      std::ofstream out(trace_out);
      if (!out) throw ferry::Error("trace: cannot write '" + trace_out + "'");
      trace->write_chrome_json(out);
      out.close();
      if (!out) throw ferry::Error("trace: writing '" + trace_out + "' failed");
      std::printf("%zu events of %llu batches written to %s (open in chrome://tracing or ui.perfetto.dev)\n", trace->events(),
                  static_cast<unsigned long long>(r.stats.batches), trace_out.c_str());
      std::printf("%s", r.stats.report().c_str());
    } else if (list->parsed()) {
      auto& registry = ferry::DatasetRegistry::global();
      for (const auto& p : list_plugins) registry.load_plugin(p);
      // Each dataset's schema (key=default, what it does, its range), "tar" (a stream) in its place.
      std::vector<std::string> names = registry.names();
      names.push_back("tar");
      std::sort(names.begin(), names.end());
      for (const auto& name : names) {
        const ferry::DatasetSchema* schema = registry.schema(name);
        std::printf("%s: %s\n", name.c_str(), schema ? schema->help().c_str() : registry.help(name).c_str());
      }
    }
  } catch (const std::exception& e) {
    // A progress line left open on the terminal ends first; otherwise the error is the first line.
    std::fprintf(stderr, "%sferry: %s\n", g_progress_open ? "\n" : "", e.what());
    return 1;
  }
  return 0;
}
