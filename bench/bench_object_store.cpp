// The image pipeline over s3:// against the same shards on local disk, side by side in one run:
// a real S3-compatible server (SeaweedFS, started on loopback as the tests start it), and the same
// server behind a proxy that holds every answer's first byte for --latency-ms (a cloud store's
// first-byte latency). Indexed tar shards (TarImages: one ranged GET a record, a batch's records
// requested together) and the stream (TarShards: 8 MiB ranged GETs, a shard's open sent while the
// last is parsed; mapped with decode_labeled_image, and as TarDecodeStream, which decodes into the
// batch's rows), RandomResizedCrop 224 + flip, uint8, CPU decode; with a GPU, both again with
// decode=gpu (nvJPEG, device 0; the stream's records as EncodedImages); and the stream's records
// read and not decoded (what the reads alone give). Prints a Markdown table: images/s (median of
// --runs epochs), the ratio to local, the busy cores of this process and images/s per busy core
// (the proxy's threads included), the server's busy cores apart, and the rate between each epoch's
// batches at 10% and 90% (its start and tail left out). With --server-cpus N the server runs on the machine's last N
// CPUs and this process (every row, local disk too) on the others: a store on cores of its own,
// as a store on another machine would be; without it both share every CPU.
//
//   build/release/bench/bench_object_store --images 2048 --workers 2 --runs 3 --latency-ms 20 [--server-cpus 4] [--only gpu]
//       [--per-shard 128] [--batch 64] [--drop-last] [--float (to_float + ImageNet's mean/std)] [--local-only]
//       [--persistent | --loader-per-epoch] [--prefetch N] [--keep-mib N] [--sse2-pass] [--no-next-epoch-ahead] [--detail] [--no-cache-row] [--watchdog-s N]
//       [--keep-shards DIR] [--photos DIR] [--round-robin]
// --local-only: the local-disk rows alone (no server started). --keep-shards DIR: the shards
// written to DIR and left there (train-000.tar, ...), for bench/tar_peers.py to read the same bytes.
// --photos DIR: the images are DIR's JPEGs, repeated (else synthetic 500x375 ones of ~171 KB).
// --no-next-epoch-ahead: prefetch_next_epoch = false (a stream then sends no read for the next
// epoch's first shard as an epoch ends). With --server-cpus the latency proxy runs on the server's
// CPUs (it stands for the store), or with --proxy-with-loader on the loader's.
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_time.h"
#include "proc_threads.h"
#include "ferry/detail/pass_paths.h"
#include "ferry/ferry.h"
#include "loaders/fault_proxy.h"
#include "loaders/files.h"
#include "loaders/object_store.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

int arg(int argc, char** argv, const std::string& name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return std::atoi(argv[i + 1]);
  return fallback;
}

bool flag(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i)
    if (argv[i] == name) return true;
  return false;
}

// --watchdog-s N: when no batch has come for N seconds, every thread's stack goes to stderr, the
// server is killed and the benchmark ends (exit code 3): a hang shows where it is.
pid_t g_server = 0;  // the object-store server's process
std::atomic<std::int64_t> g_last_batch_ns{0};
std::atomic<bool> g_watchdog_off{false};

void start_watchdog(int seconds) {
  if (seconds <= 0) return;
  ferry::bench::install_stack_dump();
  g_last_batch_ns = Clock::now().time_since_epoch().count();
  std::thread([seconds] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      if (g_watchdog_off || Clock::now().time_since_epoch().count() - g_last_batch_ns.load() < std::int64_t{seconds} * 1000000000)
        continue;
      std::fprintf(stderr, "watchdog: no batch for %d s; every thread's stack:\n", seconds);
      ferry::bench::dump_every_stack();
      if (g_server > 0) ::kill(g_server, SIGKILL);  // the server goes with the benchmark
      std::_Exit(3);
    }
  }).detach();
}

// What a timed epoch gives: its images, and its rate between its batches at 10% and at 90% of
// the epoch (its start and its tail left out; 0 for fewer than 3 batches).
struct Epoch {
  std::size_t images = 0;
  double mid = 0;
};

struct Result {
  double images_per_second = 0, busy = 0, server = 0, mid = 0;
  std::size_t images = 0;  // delivered in the epoch
};

// The server process's CPU seconds so far (utime + stime of /proc/<pid>/stat); 0 if unreadable.
double server_cpu_seconds() {
  std::ifstream in("/proc/" + std::to_string(g_server) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int k = 3; k <= 15 && rest >> field; ++k) {
    if (k == 14) utime = std::stod(field);
    if (k == 15) stime = std::stod(field);
  }
  return (utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// CPUs [first, first + count) for this process's threads from now on (and children it starts).
void use_cpus(int first, int count) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c = first; c < first + count; ++c) CPU_SET(c, &set);
  if (::sched_setaffinity(0, sizeof set, &set) != 0) std::perror("sched_setaffinity");
}

// Median images/s of `runs` epochs of `epoch` (each returns the images it delivered).
Result measure(int runs, const std::function<Epoch()>& epoch) {
  std::vector<Result> rs;
  for (int r = 0; r < runs; ++r) {
    const double c0 = bench::cpu_seconds(), s0 = server_cpu_seconds();
    const auto t0 = Clock::now();
    const Epoch e = epoch();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    rs.push_back({e.images / s, (bench::cpu_seconds() - c0) / s, (server_cpu_seconds() - s0) / s, e.mid, e.images});
  }
  std::vector<double> mids;
  for (const Result& r : rs) mids.push_back(r.mid);
  std::sort(mids.begin(), mids.end());
  std::sort(rs.begin(), rs.end(), [](const Result& a, const Result& b) { return a.images_per_second < b.images_per_second; });
  Result m = rs[rs.size() / 2];
  m.mid = mids[mids.size() / 2];
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const int images = arg(argc, argv, "--images", 2048);
  const int workers = arg(argc, argv, "--workers", 2);
  const int runs = arg(argc, argv, "--runs", 3);
  const int latency = arg(argc, argv, "--latency-ms", 20);
  const int server_cpus = arg(argc, argv, "--server-cpus", 0);
  const int watchdog = arg(argc, argv, "--watchdog-s", 0);
  std::string only;  // --only TEXT: the rows whose pipeline names TEXT ("gpu", "stream"; "a|b": a or b)
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--only") only = argv[i + 1];
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  if (server_cpus < 0 || server_cpus >= cpus) {
    std::fprintf(stderr, "bench_object_store: --server-cpus must be 0 (shared) or below the %d CPUs\n", cpus);
    return 2;
  }
  const int per_shard = arg(argc, argv, "--per-shard", 128);
  const int shards = (images + per_shard - 1) / per_shard;

  // --local-only: the local-disk rows alone, and no server started.
  const bool local_only = flag(argc, argv, "--local-only");
  if (server_cpus > 0) use_cpus(cpus - server_cpus, server_cpus);  // the server, started now, inherits these
  test::ObjectStore* store = local_only ? nullptr : &test::ObjectStore::get();
  if (server_cpus > 0) use_cpus(0, cpus - server_cpus);
  if (store) {
    g_server = store->pid();
    store->use();
    store->bucket("bench");
  }
  // --keep-shards DIR: the local shards written there and left for a peer to read (else a
  // temporary folder).
  test::TempDir temp;
  std::string keep;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--keep-shards") keep = argv[i + 1];
  const test::TempDir& dir = temp;
  const auto shard_path = [&](const std::string& name) { return keep.empty() ? dir / name : keep + "/" + name; };
  std::vector<std::string> local, remote;
  std::size_t bytes = 0;
  // The images are encoded on every CPU (most of the set-up), then put in shards, written and put in order.
  std::vector<test::Bytes> tars(static_cast<std::size_t>(shards));
  {
    std::vector<test::Bytes> jpgs(static_cast<std::size_t>(images));
    // --photos DIR: the JPEGs under DIR (sorted by path), repeated to make --images, instead of
    // the synthetic ones (bench-loaders.sh cuts 171 photographs' 500x375 tiles: --images 10260 is
    // each 60 times, the set of the stream's first measurements).
    std::string photos;
    for (int i = 1; i + 1 < argc; ++i)
      if (std::string(argv[i]) == "--photos") photos = argv[i + 1];
    std::vector<test::Bytes> found;
    if (!photos.empty()) {
      std::vector<std::string> paths;
      for (const auto& e : std::filesystem::recursive_directory_iterator(photos))
        if (e.is_regular_file() && e.path().extension() == ".jpg") paths.push_back(e.path().string());
      std::sort(paths.begin(), paths.end());
      for (const std::string& path : paths) found.push_back(test::read_bytes(path));
      if (found.empty()) {
        std::fprintf(stderr, "bench_object_store: no .jpg under --photos %s\n", photos.c_str());
        return 2;
      }
      for (int i = 0; i < images; ++i) jpgs[static_cast<std::size_t>(i)] = found[static_cast<std::size_t>(i) % found.size()];
    }
    std::atomic<int> next{0};
    std::vector<std::thread> makers;
    const int encoders = photos.empty() ? std::max(1, cpus - server_cpus) : 0;  // with --photos, none to encode
    for (int m = 0; m < encoders; ++m)
      makers.emplace_back([&] {
        for (int i; (i = next.fetch_add(1)) < images;) {
          // 500x375 photographs' size class: smooth gradients with texture, about 171 KB at quality 90.
          std::vector<std::uint8_t> p = test::gradient(500, 375, 3, i);
          const std::vector<std::uint8_t> noise = test::textured(500, 375, 3, static_cast<std::uint32_t>(i + 1));
          for (std::size_t k = 0; k < p.size(); ++k) p[k] = static_cast<std::uint8_t>((p[k] * 3 + noise[k]) / 4);
          jpgs[static_cast<std::size_t>(i)] = test::encode_jpeg(p, 500, 375, 3, 90);
        }
      });
    for (std::thread& t : makers) t.join();
    for (int s = 0; s < shards; ++s) {
      test::TarBuilder t;
      for (int r = 0; r < per_shard && s * per_shard + r < images; ++r) {
        const std::string key = "s" + std::to_string(s) + "/" + std::to_string(r);
        t.file(key + ".jpg", jpgs[static_cast<std::size_t>(s * per_shard + r)]);
        t.file(key + ".cls", std::to_string(r % 1000));
      }
      tars[static_cast<std::size_t>(s)] = t.finish();
    }
  }
  for (int s = 0; s < shards; ++s) {
    const test::Bytes& tar = tars[static_cast<std::size_t>(s)];
    bytes += tar.size();
    char name[32];
    std::snprintf(name, sizeof name, "train-%03d.tar", s);
    test::write_file(shard_path(name), tar);
    local.push_back(shard_path(name));
    if (!store) continue;
    store->put(std::string("bench/") + name, tar);
    remote.push_back(std::string("s3://bench/") + name);
  }
  tars.clear();
  TarImagesOptions io;
  io.transform = ImageTransform().random_resized_crop(224, 224).horizontal_flip();
  const bool to_float = flag(argc, argv, "--float");
  if (to_float) io.transform.to_float().normalize({0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f});
  DataLoaderOptions o;
  o.batch_size = static_cast<std::size_t>(arg(argc, argv, "--batch", 64));
  o.drop_last = flag(argc, argv, "--drop-last");
  o.shuffle = true;
  o.num_workers = workers;
  // The indexed rows' datasets, indexed once, outside the timing (and only when such a row runs).
  const auto selected = [&only](const std::string& kind) {  // --only "a|b": the rows naming a or b
    if (only.empty()) return true;
    for (std::size_t start = 0; start <= only.size();) {
      const std::size_t end = std::min(only.find('|', start), only.size());
      if (end > start && kind.find(only.substr(start, end - start)) != std::string::npos) return true;
      start = end + 1;
    }
    return false;
  };
  const bool any_indexed = selected("indexed (TarImages)") || selected("indexed, decode=gpu (TarImages)");
  std::optional<TarImages> local_index, remote_index;
  if (any_indexed) local_index.emplace(local, io);
  if (any_indexed && store) remote_index.emplace(remote, io);
  // decode=gpu (with a GPU): the same shards, each record's JPEG decoded on the device.
  const bool gpu = cuda::available();
  TarImagesOptions gio = io;
  gio.decode = ImageFolderOptions::Decode::Gpu;
  std::optional<TarImages> local_gpu, remote_gpu;
  if (gpu && any_indexed) local_gpu.emplace(local, gio);
  if (gpu && any_indexed && store) remote_gpu.emplace(remote, gio);
  // Each row's epochs: one loader a row, its first epoch untimed and the next ones timed one after
  // another, as a training loop runs them (--persistent: its workers kept across epochs); with
  // --loader-per-epoch a new loader every epoch (its start-up, nvJPEG's included, counted in every
  // epoch: this benchmark's method before 2026-11-26). --detail prints each epoch's time to its
  // first batch, its length, the consumer's wait in the loader and the stages' seconds (stderr).
  const bool one_loader = !flag(argc, argv, "--loader-per-epoch"), detail = flag(argc, argv, "--detail");
  const bool no_cache_row = flag(argc, argv, "--no-cache-row");
  o.persistent_workers = flag(argc, argv, "--persistent");
  // --round-robin: batch b made by worker b mod W on the map-style rows too (PyTorch's
  // assignment, and the stream's), where they otherwise go to whichever worker is free.
  o.round_robin = flag(argc, argv, "--round-robin");
  o.prefetch_factor = arg(argc, argv, "--prefetch", o.prefetch_factor);
  o.prefetch_next_epoch = !flag(argc, argv, "--no-next-epoch-ahead");
  // --sse2-pass: the image pass's SSE2 kernels where the CPU has AVX2 (the pass before 2026-11-29).
  if (flag(argc, argv, "--sse2-pass")) ferry::detail::allow_avx2_pass(false);
  // --keep-mib N: pinned_memory_limit, which caps the host batches kept for reuse (unset, the cap
  // grows to the pipeline's depth; 2048 is the cap before 2026-11-29's change).
  if (const int keep = arg(argc, argv, "--keep-mib", 0); keep > 0) o.pinned_memory_limit = std::size_t(keep) << 20;
  const bool proxy_with_loader = flag(argc, argv, "--proxy-with-loader");
  const auto count = [](const auto& b) -> std::size_t {
    if constexpr (std::is_same_v<std::decay_t<decltype(b)>, Tensor>)
      return static_cast<std::size_t>(b.numel());
    else
      return static_cast<std::size_t>(b.label.numel());
  };
  const auto timed = [detail, count](auto& loader, bool on_gpu) {
    loader.reset_stats();
    const auto t0 = Clock::now();
    Epoch e;
    std::vector<std::pair<Clock::time_point, std::size_t>> arrived;  // (when, images so far) a batch
    for (auto& b : loader) {
      e.images += count(b);
      arrived.emplace_back(Clock::now(), e.images);
      g_last_batch_ns = arrived.back().first.time_since_epoch().count();
    }
    if (on_gpu) loader.stream()->synchronize();  // the last batch decoded, not just issued
    if (arrived.size() >= 3) {
      const auto& [ta, na] = arrived[arrived.size() / 10];
      const auto& [tb, nb] = arrived[arrived.size() * 9 / 10];
      e.mid = static_cast<double>(nb - na) / std::chrono::duration<double>(tb - ta).count();
    }
    if (detail) {
      const LoaderStats st = loader.stats();
      const auto ms = [t0](Clock::time_point t) { return std::chrono::duration<double, std::milli>(t - t0).count(); };
      std::fprintf(stderr,
                   "  epoch: first batch %.0f ms, %.0f ms, %zu images, consumer waited %.0f ms; workers' fetch %.2f s, collate "
                   "%.2f s; pin %.2f s; decode %.2f s\n",
                   arrived.empty() ? -1.0 : ms(arrived.front().first), ms(Clock::now()), e.images, st.wait_seconds * 1e3,
                   st.fetch_seconds, st.collate_seconds, st.pin_seconds, st.decode_seconds);
    }
    return e;
  };
  // An epoch of a loader made by `make`: a new one each call, or one kept by the returned function.
  const auto epochs = [one_loader, timed](auto make, bool on_gpu) -> std::function<Epoch()> {
    using Loader = decltype(make());
    if (!one_loader)
      return [make, timed, on_gpu] {
        Loader loader = make();
        return timed(loader, on_gpu);
      };
    auto kept = std::make_shared<std::optional<Loader>>();
    return [make, timed, on_gpu, kept] {
      if (!*kept) kept->emplace(make());
      return timed(**kept, on_gpu);
    };
  };
  const auto indexed = [&](const std::vector<std::string>& paths, bool on_gpu) {
    const TarImages* ds =
        on_gpu ? (paths == local ? &*local_gpu : &*remote_gpu) : (paths == local ? &*local_index : &*remote_index);
    DataLoaderOptions go = o;
    if (on_gpu) go.device = 0;
    return epochs([ds, go] { return DataLoader(*ds, go); }, on_gpu);
  };
  // The stream's records, read and not decoded (their JPEG's size each): what the reads alone give.
  const auto records = [&](const std::vector<std::string>& paths) {
    DataLoaderOptions ro = o;
    ro.shuffle = false;
    return epochs(
        [paths, ro] {
          return DataLoader(TarShards(paths, TarShardsOptions{}).map([](TarRecord r, SampleContext&) {
            return static_cast<std::int64_t>(r.field("jpg").size());
          }),
                            ro);
        },
        false);
  };
  const auto stream = [&](const std::vector<std::string>& paths, bool on_gpu) {
    TarShardsOptions so;
    const TarRecordDecodeOptions tio{.transform = io.transform};
    DataLoaderOptions so2 = o;
    so2.shuffle = false;
    if (on_gpu) {
      so2.device = 0;
      return epochs(
          [paths, so, tio, so2] {
            return DataLoader(TarShards(paths, so).map([tio](TarRecord r, SampleContext& ctx) {
              return encode_labeled_image(std::move(r), tio, ctx.rng());
            }),
                              so2);
          },
          true);
    }
    return epochs(
        [paths, so, tio, so2] {
          return DataLoader(TarShards(paths, so).map(
                                [tio](TarRecord r, SampleContext& ctx) { return decode_labeled_image(r, tio, ctx.rng()); }),
                            so2);
        },
        false);
  };
  // The stream decoded into the batch's rows (TarDecodeStream: no tensor a sample, no collate copy).
  const auto stream_direct = [&](const std::vector<std::string>& paths) {
    TarShardsOptions so;
    const TarRecordDecodeOptions tio{.transform = io.transform};
    DataLoaderOptions so2 = o;
    so2.shuffle = false;
    return epochs([paths, so, tio, so2] { return DataLoader(TarDecodeStream(TarShards(paths, so), tio), so2); }, false);
  };

  utsname u{};
  uname(&u);
  std::printf("## The image pipeline over s3:// against local disk\n\n");
  const std::string where = !store ? "local disk only (no server)"
                            : server_cpus > 0
                                ? "SeaweedFS 4.48 on loopback; " +
                                      std::string(proxy_with_loader ? "the server" : "the server and the latency proxy") +
                                      " on " + std::to_string(server_cpus) + " CPUs of their own, the loader on the other " +
                                      std::to_string(cpus - server_cpus)
                                : "SeaweedFS 4.48 on loopback; the server and the loader share every CPU";
  std::printf(
      "%d JPEGs of 500x375 (%.0f MB) in %d tar shards; RandomResizedCrop 224 + flip, %s, batch %zu%s, %d workers; "
      "%u CPUs (%s); %s; median of %d epochs\n\n",
      images, bytes / 1e6, shards, to_float ? "float, mean/std" : "uint8", o.batch_size, o.drop_last ? " (drop_last)" : "",
      workers, std::thread::hardware_concurrency(), u.machine, where.c_str(), runs);
  std::printf(
      "| pipeline | source | images/s | of local | busy cores | images/s a busy core | server's busy cores | "
      "mid-epoch images/s | of local | images an epoch |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  start_watchdog(watchdog);
  std::vector<const char*> kinds{"indexed (TarImages)", "stream (TarShards)", "stream into the batch (TarDecodeStream)"};
  if (gpu) kinds.push_back("indexed, decode=gpu (TarImages)"), kinds.push_back("stream, decode=gpu (TarShards)");
  kinds.push_back("stream, records read, not decoded (TarShards)");
  for (const char* kind : kinds) {
    if (!selected(kind)) continue;
    const bool idx = kind[0] == 'i', on_gpu = std::string(kind).find("gpu") != std::string::npos;
    const auto epoch = [&](const std::vector<std::string>& paths) -> std::function<Epoch()> {
      if (idx) return indexed(paths, on_gpu);
      if (std::string(kind).find("records") != std::string::npos) return records(paths);
      if (std::string(kind).find("TarDecodeStream") != std::string::npos) return stream_direct(paths);
      return stream(paths, on_gpu);
    };
    // With --one-loader, a row's first epoch (its loader's start-up) is not timed.
    const auto run = [&](const std::vector<std::string>& paths) {
      const std::function<Epoch()> e = epoch(paths);
      if (one_loader) measure(1, e);
      return measure(runs, e);
    };
    if (detail) std::fprintf(stderr, "%s\n", kind);
    measure(1, epoch(local));  // warm the page cache
    const Result l = run(local);
    std::printf("| %s | local disk | %.0f | 1.00 | %.2f | %.0f | - | %.0f | 1.00 | %zu |\n", kind, l.images_per_second, l.busy,
                l.images_per_second / l.busy, l.mid, l.images);
    std::fflush(stdout);
    if (local_only) continue;
    const Result r = run(remote);
    std::printf("| %s | s3:// | %.0f | %.2f | %.2f | %.0f | %.2f | %.0f | %.2f | %zu |\n", kind, r.images_per_second,
                r.images_per_second / l.images_per_second, r.busy, r.images_per_second / r.busy, r.server, r.mid,
                l.mid > 0 ? r.mid / l.mid : 0.0, r.images);
    std::fflush(stdout);
    {
      // The proxy stands for the store's side (its first-byte latency): with --server-cpus it runs
      // on the server's CPUs (its threads inherit the CPUs of the thread that starts them), unless
      // --proxy-with-loader puts it on the loader's (where it relays every byte on the loader's
      // CPUs: this benchmark's placement before 2026-11-26).
      if (server_cpus > 0 && !proxy_with_loader) use_cpus(cpus - server_cpus, server_cpus);
      test::FaultProxy proxy(store->port());
      if (server_cpus > 0) use_cpus(0, cpus - server_cpus);
      proxy.delay(std::chrono::milliseconds(latency));
      ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
      const Result p = run(remote);
      std::printf("| %s | s3://, +%d ms a request | %.0f | %.2f | %.2f | %.0f | %.2f | %.0f | %.2f | %zu |\n", kind, latency,
                  p.images_per_second, p.images_per_second / l.images_per_second, p.busy, p.images_per_second / p.busy, p.server,
                  p.mid, l.mid > 0 ? p.mid / l.mid : 0.0, p.images);
      std::fflush(stdout);
      if (no_cache_row) {
        store->use();
        continue;
      }
      // The on-disk cache: one epoch fills it, the measured epochs read the disk.
      test::TempDir cache;
      ::setenv("FERRY_S3_CACHE_DIR", cache.path().c_str(), 1);
      if (!one_loader) measure(1, epoch(remote));
      const Result c = run(remote);
      ::unsetenv("FERRY_S3_CACHE_DIR");
      store->use();
      std::printf(
          "| %s | s3://, +%d ms a request, later epochs from the disk cache | %.0f | %.2f | %.2f | %.0f | %.2f | %.0f | %.2f | "
          "%zu "
          "|\n",
          kind, latency, c.images_per_second, c.images_per_second / l.images_per_second, c.busy, c.images_per_second / c.busy,
          c.server, c.mid, l.mid > 0 ? c.mid / l.mid : 0.0, c.images);
      std::fflush(stdout);
    }
  }
  g_watchdog_off = true;
  const ObjectStoreStats s = object_store_stats();
  std::printf(
      "\nobject store: %llu requests, %.0f MB, %llu retried, %llu hedged (%llu answered first); %llu reads (%.0f MB) "
      "from the disk cache\n",
      static_cast<unsigned long long>(s.requests), s.bytes / 1e6, static_cast<unsigned long long>(s.retries),
      static_cast<unsigned long long>(s.hedges), static_cast<unsigned long long>(s.hedges_won),
      static_cast<unsigned long long>(s.cache_hits), s.cache_bytes / 1e6);
  return 0;
}
