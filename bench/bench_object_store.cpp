// The image pipeline over s3:// against the same shards on local disk, side by side in one run:
// a real S3-compatible server (SeaweedFS, started on loopback as the tests start it), and the same
// server behind a proxy that holds every answer's first byte for --latency-ms (a cloud store's
// first-byte latency). Indexed tar shards (TarImages: one ranged GET a record, a batch's records
// requested together) and the stream (TarShards: 8 MiB ranged GETs, a shard's open sent while the
// last is parsed), RandomResizedCrop 224 + flip, uint8, CPU decode; with a GPU, both again with
// decode=gpu (nvJPEG, device 0; the stream's records as EncodedImages). Prints a Markdown table: images/s (median of --runs),
// the ratio to local, the busy cores of this process and images/s per busy core (the proxy's threads included), and
// the server's busy cores apart. With --server-cpus N the server runs on the machine's last N
// CPUs and this process (every row, local disk too) on the others: a store on cores of its own,
// as a store on another machine would be; without it both share every CPU.
//
//   build/release/bench/bench_object_store --images 2048 --workers 2 --runs 3 --latency-ms 20 [--server-cpus 4] [--only gpu]
#include <sched.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu_time.h"
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

struct Result {
  double images_per_second = 0, busy = 0, server = 0;
};

pid_t g_server = 0;

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
Result measure(int runs, const std::function<std::size_t()>& epoch) {
  std::vector<Result> rs;
  for (int r = 0; r < runs; ++r) {
    const double c0 = bench::cpu_seconds(), s0 = server_cpu_seconds();
    const auto t0 = Clock::now();
    const std::size_t n = epoch();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    rs.push_back({n / s, (bench::cpu_seconds() - c0) / s, (server_cpu_seconds() - s0) / s});
  }
  std::sort(rs.begin(), rs.end(), [](const Result& a, const Result& b) { return a.images_per_second < b.images_per_second; });
  return rs[rs.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int images = arg(argc, argv, "--images", 2048);
  const int workers = arg(argc, argv, "--workers", 2);
  const int runs = arg(argc, argv, "--runs", 3);
  const int latency = arg(argc, argv, "--latency-ms", 20);
  const int server_cpus = arg(argc, argv, "--server-cpus", 0);
  std::string only;  // --only TEXT: the rows whose pipeline names TEXT ("gpu", "stream")
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--only") only = argv[i + 1];
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  if (server_cpus < 0 || server_cpus >= cpus) {
    std::fprintf(stderr, "bench_object_store: --server-cpus must be 0 (shared) or below the %d CPUs\n", cpus);
    return 2;
  }
  const int per_shard = 128;
  const int shards = (images + per_shard - 1) / per_shard;

  if (server_cpus > 0) use_cpus(cpus - server_cpus, server_cpus);  // the server, started now, inherits these
  test::ObjectStore& store = test::ObjectStore::get();
  if (server_cpus > 0) use_cpus(0, cpus - server_cpus);
  g_server = store.pid();
  store.use();
  store.bucket("bench");
  test::TempDir dir;
  std::vector<std::string> local, remote;
  std::size_t bytes = 0;
  for (int s = 0; s < shards; ++s) {
    test::TarBuilder t;
    for (int r = 0; r < per_shard && s * per_shard + r < images; ++r) {
      // 500x375 photographs' size class: smooth gradients with texture, about 60 KB at quality 90.
      std::vector<std::uint8_t> p = test::gradient(500, 375, 3, s * per_shard + r);
      const std::vector<std::uint8_t> noise = test::textured(500, 375, 3, static_cast<std::uint32_t>(s * per_shard + r + 1));
      for (std::size_t k = 0; k < p.size(); ++k) p[k] = static_cast<std::uint8_t>((p[k] * 3 + noise[k]) / 4);
      const std::string key = "s" + std::to_string(s) + "/" + std::to_string(r);
      t.file(key + ".jpg", test::encode_jpeg(p, 500, 375, 3, 90));
      t.file(key + ".cls", std::to_string(r % 1000));
    }
    const test::Bytes tar = t.finish();
    bytes += tar.size();
    char name[32];
    std::snprintf(name, sizeof name, "train-%03d.tar", s);
    test::write_file(dir / name, tar);
    store.put(std::string("bench/") + name, tar);
    local.push_back(dir / name);
    remote.push_back(std::string("s3://bench/") + name);
  }
  TarImagesOptions io;
  io.transform = ImageTransform().random_resized_crop(224, 224).horizontal_flip();
  DataLoaderOptions o;
  o.batch_size = 64;
  o.shuffle = true;
  o.num_workers = workers;
  const TarImages local_index(local, io), remote_index(remote, io);  // indexed once, outside the timing
  // decode=gpu (with a GPU): the same shards, each record's JPEG decoded on the device.
  const bool gpu = cuda::available();
  TarImagesOptions gio = io;
  gio.decode = ImageFolderOptions::Decode::Gpu;
  std::optional<TarImages> local_gpu, remote_gpu;
  if (gpu) local_gpu.emplace(local, gio), remote_gpu.emplace(remote, gio);
  const auto indexed = [&](const std::vector<std::string>& paths, bool on_gpu) {
    const TarImages* ds = on_gpu ? (paths == local ? &*local_gpu : &*remote_gpu) : (paths == local ? &local_index : &remote_index);
    return [&, ds, on_gpu] {
      DataLoaderOptions go = o;
      if (on_gpu) go.device = 0;
      DataLoader loader(*ds, go);
      std::size_t n = 0;
      for (auto& b : loader) n += static_cast<std::size_t>(b.label.numel());
      if (on_gpu) loader.stream()->synchronize();  // the last batch decoded, not just issued
      return n;
    };
  };
  const auto stream = [&](const std::vector<std::string>& paths, bool on_gpu) {
    return [&, paths, on_gpu] {
      TarShardsOptions so;
      const TarRecordDecodeOptions tio{.transform = io.transform};
      DataLoaderOptions so2 = o;
      so2.shuffle = false;
      std::size_t n = 0;
      if (on_gpu) {
        so2.device = 0;
        auto ds = TarShards(paths, so).map([tio](TarRecord r, SampleContext& ctx) { return encode_labeled_image(std::move(r), tio, ctx.rng()); });
        DataLoader loader(ds, so2);
        for (auto& b : loader) n += static_cast<std::size_t>(b.label.numel());
        loader.stream()->synchronize();  // the last batch decoded, not just issued
        return n;
      }
      auto ds = TarShards(paths, so).map([tio](TarRecord r, SampleContext& ctx) { return decode_labeled_image(r, tio, ctx.rng()); });
      DataLoader loader(ds, so2);
      for (auto& b : loader) n += static_cast<std::size_t>(b.label.numel());
      return n;
    };
  };

  utsname u{};
  uname(&u);
  std::printf("## The image pipeline over s3:// against local disk\n\n");
  std::printf("%d JPEGs of 500x375 (%.0f MB) in %d tar shards; RandomResizedCrop 224 + flip, uint8, batch 64, %d workers; "
              "SeaweedFS %s on loopback; %u CPUs (%s); %s; median of %d epochs\n\n",
              images, bytes / 1e6, shards, workers, "4.48", std::thread::hardware_concurrency(), u.machine,
              server_cpus > 0 ? ("the server on " + std::to_string(server_cpus) + " CPUs of its own, the loader on the other " +
                                 std::to_string(cpus - server_cpus)).c_str()
                              : "the server and the loader share every CPU",
              runs);
  std::printf("| pipeline | source | images/s | of local | busy cores | images/s a busy core | server's busy cores |\n"
              "|---|---|---:|---:|---:|---:|---:|\n");
  std::vector<const char*> kinds{"indexed (TarImages)", "stream (TarShards)"};
  if (gpu) kinds.push_back("indexed, decode=gpu (TarImages)"), kinds.push_back("stream, decode=gpu (TarShards)");
  for (const char* kind : kinds) {
    if (!only.empty() && std::string(kind).find(only) == std::string::npos) continue;
    const bool idx = kind[0] == 'i', on_gpu = std::string(kind).find("gpu") != std::string::npos;
    const auto epoch = [&](const std::vector<std::string>& paths) -> std::function<std::size_t()> {
      if (idx) return indexed(paths, on_gpu);
      return stream(paths, on_gpu);
    };
    const auto run = [&](const std::vector<std::string>& paths) { return measure(runs, epoch(paths)); };
    measure(1, epoch(local));  // warm the page cache
    const Result l = run(local);
    std::printf("| %s | local disk | %.0f | 1.00 | %.2f | %.0f | - |\n", kind, l.images_per_second, l.busy, l.images_per_second / l.busy);
    std::fflush(stdout);
    const Result r = run(remote);
    std::printf("| %s | s3:// | %.0f | %.2f | %.2f | %.0f | %.2f |\n", kind, r.images_per_second, r.images_per_second / l.images_per_second,
                r.busy, r.images_per_second / r.busy, r.server);
    std::fflush(stdout);
    {
      test::FaultProxy proxy(store.port());
      proxy.delay(std::chrono::milliseconds(latency));
      ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
      const Result p = run(remote);
      std::printf("| %s | s3://, +%d ms a request | %.0f | %.2f | %.2f | %.0f | %.2f |\n", kind, latency, p.images_per_second,
                  p.images_per_second / l.images_per_second, p.busy, p.images_per_second / p.busy, p.server);
      std::fflush(stdout);
      // The on-disk cache: one epoch fills it, the measured epochs read the disk.
      test::TempDir cache;
      ::setenv("FERRY_S3_CACHE_DIR", cache.path().c_str(), 1);
      measure(1, epoch(remote));
      const Result c = run(remote);
      ::unsetenv("FERRY_S3_CACHE_DIR");
      store.use();
      std::printf("| %s | s3://, +%d ms a request, later epochs from the disk cache | %.0f | %.2f | %.2f | %.0f | %.2f |\n", kind,
                  latency, c.images_per_second, c.images_per_second / l.images_per_second, c.busy, c.images_per_second / c.busy,
                  c.server);
      std::fflush(stdout);
    }
  }
  const ObjectStoreStats s = object_store_stats();
  std::printf("\nobject store: %llu requests, %.0f MB, %llu retried, %llu hedged (%llu answered first); %llu reads (%.0f MB) "
              "from the disk cache\n",
              static_cast<unsigned long long>(s.requests), s.bytes / 1e6, static_cast<unsigned long long>(s.retries),
              static_cast<unsigned long long>(s.hedges), static_cast<unsigned long long>(s.hedges_won),
              static_cast<unsigned long long>(s.cache_hits), s.cache_bytes / 1e6);
  return 0;
}
