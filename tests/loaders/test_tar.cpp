// Tests that tar archives (ustar, GNU long names, pax) read member by member, that shards split
// across ranks and workers with every record read once, and that a damaged shard is a DataError
// with the shard and offset after which the stream goes on with its next shard.
#include <catch2/catch.hpp>

#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "ferry/detail/pass_math.h"
#include "ferry/ferry.h"
#include "files.h"
#include "helpers.h"

using namespace ferry;
using namespace ferry::test;

namespace {
// A shard of `n` records "s<shard>/<k>" with a .txt and a .cls field.
Bytes shard_bytes(int shard, int n) {
  TarBuilder t;
  for (int k = 0; k < n; ++k) {
    const std::string key = "s" + std::to_string(shard) + "/" + std::to_string(k);
    t.file(key + ".txt", key).file(key + ".cls", std::to_string(k % 10));
  }
  return t.finish();
}
std::vector<std::string> write_shards(const TempDir& dir, int shards, int per_shard) {
  std::vector<std::string> paths;
  for (int s = 0; s < shards; ++s) {
    paths.push_back(dir / ("shard-" + std::to_string(s) + ".tar"));
    write_file(paths.back(), shard_bytes(s, per_shard));
  }
  return paths;
}
// A record "s<shard>/<k>" as the number shard * 100 + k.
std::int64_t record_id(const TarRecord& r) {
  return std::stoi(r.key.substr(1, r.key.find('/') - 1)) * 100 + std::stoi(r.key.substr(r.key.find('/') + 1));
}
}  // namespace

TEST_CASE("TarReader reads ustar, GNU long-name and pax members, skipping directories", "[unit][tar]") {
  const std::string long_path = std::string(150, 'd') + "/sample.jpg";
  const Bytes archive = TarBuilder()
                            .dir("folder/")
                            .file("folder/a.txt", "alpha")
                            .long_file(long_path, bytes_of("long"))
                            .pax_file("pax/name.cls", bytes_of("7"))
                            .file("empty.bin", Bytes())
                            .finish();
  TarReader r(archive, "mem.tar");
  std::vector<std::pair<std::string, std::string>> got;
  while (auto m = r.next()) got.emplace_back(m->path, std::string(reinterpret_cast<const char*>(m->data.data()), m->data.size()));
  CHECK(got == std::vector<std::pair<std::string, std::string>>{
                   {"folder/a.txt", "alpha"}, {long_path, "long"}, {"pax/name.cls", "7"}, {"empty.bin", ""}});
}

TEST_CASE("damaged archives are DataErrors with the shard and offset", "[errors][tar]") {
  const Bytes good = TarBuilder().file("a.txt", "alpha").file("b.txt", "beta").finish();
  Bytes bad_sum = good;
  bad_sum[512 + 512 + 3] ^= std::byte{1};  // header of b.txt, in its name
  Bytes cut = good;
  cut.resize(512 + 512 + 512 + 2);                             // b.txt's data cut short
  Bytes half_header(good.begin(), good.begin() + 1024 + 100);  // inside b.txt's header
  auto err = [](const Bytes& b) -> std::pair<std::string, std::uint64_t> {
    try {
      TarReader r(b, "shard.tar");
      while (r.next()) {
      }
    } catch (const DataError& e) {
      return {e.what(), e.offset()};
    }
    return {"", 0};
  };
  auto [m1, o1] = err(bad_sum);
  CHECK_THAT(m1, Catch::Contains("shard.tar") && Catch::Contains("bad tar header checksum"));
  CHECK(o1 == 1024);
  auto [m2, o2] = err(cut);
  CHECK_THAT(m2, Catch::Contains("truncated member 'b.txt'"));
  CHECK(o2 == 1024);
  auto [m3, o3] = err(half_header);
  CHECK_THAT(m3, Catch::Contains("truncated tar header"));
  CHECK(o3 == 1024);
  CHECK_THAT(err(bytes_of(std::string(600, 'x'))).first, Catch::Contains("not a tar archive"));
  CHECK_THROWS_AS(TarReader(Bytes(), "empty.tar"), DataError);
  CHECK_THROWS_WITH(TarReader("/nonexistent/shard.tar"), Catch::Contains("cannot open"));
}

TEST_CASE("shards split across ranks (from the launcher's environment) and workers: every record once", "[unit][tar]") {
  TempDir dir;
  const auto paths = write_shards(dir, 7, 3);
  for (int world : {1, 2, 3})
    for (int workers : {1, 2, 4}) {
      std::multiset<std::string> keys;
      for (int rank = 0; rank < world; ++rank) {
        // The split comes from the launcher's environment, as a torchrun rank reads it.
        const std::string r = std::to_string(rank), ws = std::to_string(world);
        const DistributedEnv env = DistributedEnv::from([&](const char* name) -> const char* {
          const std::string n = name;
          return n == "RANK" ? r.c_str() : n == "WORLD_SIZE" ? ws.c_str() : n == "LOCAL_RANK" ? r.c_str() : nullptr;
        });
        TarShards shards(paths, TarShardsOptions::for_rank(env));
        for (int w = 0; w < workers; ++w) {
          auto s = shards.open(WorkerInfo{w, workers, 42, 3});
          while (auto rec = s.next()) {
            CHECK(rec->fields.size() == 2);
            keys.insert(rec->key);
          }
        }
      }
      CHECK(keys.size() == 21);
      CHECK(std::set<std::string>(keys.begin(), keys.end()).size() == 21);
    }
  TarShards shards(paths);
  CHECK(shards.assignment(0, 1, 1, 0) != shards.assignment(0, 1, 1, 1));  // reshuffled each epoch
  CHECK_THROWS_WITH(TarShards({}), Catch::Contains("empty"));
  CHECK_THROWS_WITH(TarShards(paths, {.rank = 2, .world_size = 2}), Catch::Contains("rank 2"));
}

TEST_CASE("tar shards through the loader, with a damaged shard", "[loader][tar]") {
  TempDir dir;
  auto paths = write_shards(dir, 4, 5);
  Bytes damaged = shard_bytes(9, 5);
  damaged[512 * 6 + 10] ^= std::byte{0x40};  // the header of the 4th member
  paths.push_back(dir / "damaged.tar");
  write_file(paths.back(), damaged);
  paths.push_back(dir / "missing.tar");
  TarShards shards(paths);
  auto labelled = shards.map([](TarRecord r) {
    const auto& cls = r.field("cls");
    return std::pair<std::string, std::int64_t>(r.key, static_cast<std::int64_t>(cls[0]) - '0');
  });
  for (int workers : {0, 2, 3}) {
    DataLoaderOptions o;
    o.batch_size = 1;  // a stream error fails the batch it happens in: one record per batch keeps the count exact
    o.num_workers = workers;
    DataLoader loader(labelled, o, [](std::vector<std::pair<std::string, std::int64_t>> v) { return v; });
    std::set<std::string> keys;
    auto messages = iterate_skipping_errors<DataError>(
        loader,
        [&](std::vector<std::pair<std::string, std::int64_t>>& batch) {
          for (auto& [key, label] : batch) {
            CHECK(keys.insert(key).second);
            CHECK(label == std::stoi(key.substr(key.find('/') + 1)) % 10);
          }
        },
        [&](const DataError& e) {
          const bool named = e.file() == dir / "damaged.tar" || e.file() == dir / "missing.tar";
          CHECK(named);
          return std::string();
        });
    const std::size_t errors = messages.size();
    CHECK(errors == 2);
    // The four good shards are complete, and the damaged one gave what preceded the damage.
    CHECK(keys.size() == 4 * 5 + 1);
  }
}

TEST_CASE("decode_labeled_image reads the image and class fields", "[unit][tar]") {
  TarRecord r{"k", "shard.tar", 0, {}};
  r.fields["png"] = encode_png(gradient(6, 4, 3), 6, 4, 3);
  r.fields["cls"] = bytes_of("3\n");
  Generator g(1);
  LabeledSample s = decode_labeled_image(r, {}, g);
  CHECK(s.label == 3);
  CHECK(s.image.shape() == Shape{4, 6, 3});
  r.fields["cls"] = bytes_of("three");
  CHECK_THROWS_WITH(decode_labeled_image(r, {}, g),
                    Catch::Contains("not a non-negative integer") && Catch::Contains("shard.tar"));
  r.fields.erase("png");
  CHECK_THROWS_WITH(decode_labeled_image(r, {}, g), Catch::Contains("has no 'jpg' field (it has: cls)"));
}

TEST_CASE("tar shards resume mid-epoch: every worker's shards from the record after its last batch's, none decoded twice",
          "[loader][tar][resume]") {
  TempDir dir;
  const auto paths = write_shards(dir, 5, 9);
  static std::atomic<long> decoded{0};
  auto labelled = [&] {
    TarShardsOptions so;
    so.shuffle = true;  // the shard order is the epoch's: a resume must follow it
    return TarShards(paths, so).map([](TarRecord r, SampleContext& ctx) {
      decoded.fetch_add(1);  // what a decode would cost
      return record_id(r) * 10 + static_cast<std::int64_t>(ctx.rng().randint(10));
    });
  };
  auto values = [](const Tensor& t) {
    return std::vector<std::int64_t>(t.data<std::int64_t>(), t.data<std::int64_t>() + t.numel());
  };
  for (int workers : {0, 2, 3}) {
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    o.seed = 12;
    std::vector<std::vector<std::int64_t>> all;
    DataLoader reference(labelled(), o);
    while (reference.next_epoch() < 2)
      for (Tensor& b : reference) all.push_back(values(b));
    for (std::size_t k : {std::size_t{1}, std::size_t{5}, std::size_t{9}}) {
      INFO(workers << " workers, saved after " << k << " batches");
      DataLoader first(labelled(), o);
      LoaderState saved;
      {
        auto it = first.begin();
        for (std::size_t i = 0; i + 1 < k; ++i, ++it) (void)*it;
        (void)*it;
        saved = first.state();
      }
      DataLoader resumed(labelled(), o);
      resumed.restore(LoaderState::from_string(saved.to_string()));
      decoded = 0;
      std::vector<std::vector<std::int64_t>> rest;
      while (resumed.next_epoch() < 2)
        for (Tensor& b : resumed) rest.push_back(values(b));
      REQUIRE(rest.size() == all.size() - k);
      CHECK(std::equal(rest.begin(), rest.end(), all.begin() + static_cast<std::ptrdiff_t>(k)));
      std::size_t n = 0;
      for (const auto& b : rest) n += b.size();
      CHECK(static_cast<std::size_t>(decoded.load()) == n);
    }
  }
}

// --- one batcher across workers ------------------------------------------------------------------

namespace {
// Shards of uneven sizes: shard s has 3 + (7 * s) % 11 records.
std::vector<std::string> write_uneven_shards(const TempDir& dir, int shards, std::size_t& records) {
  std::vector<std::string> paths;
  records = 0;
  for (int s = 0; s < shards; ++s) {
    const int n = 3 + (7 * s) % 11;
    paths.push_back(dir / ("uneven-" + std::to_string(s) + ".tar"));
    write_file(paths.back(), shard_bytes(s, n));
    records += static_cast<std::size_t>(n);
  }
  return paths;
}
// A record's identity (shard * 100 + k) * 10 + a draw from its generator.
auto identified(const std::vector<std::string>& paths) {
  return TarShards(paths).map(
      [](TarRecord r, SampleContext& ctx) { return record_id(r) * 10 + static_cast<std::int64_t>(ctx.rng().randint(10)); });
}
std::vector<std::int64_t> values_of(const Tensor& t) {
  return std::vector<std::int64_t>(t.data<std::int64_t>(), t.data<std::int64_t>() + t.numel());
}
template <class Loader>
std::vector<std::vector<std::int64_t>> epoch_batches(Loader& loader) {
  std::vector<std::vector<std::int64_t>> out;
  for (Tensor& b : loader) out.push_back(values_of(b));
  return out;
}
// Error messages without the worker that met them: any free worker makes a stream's batch.
std::vector<std::string> any_worker(std::vector<std::string> errors) {
  for (std::string& e : errors)
    if (const std::size_t at = e.find("[worker "); at != std::string::npos) e.replace(at, e.find(' ', at + 8) - at, "[a worker");
  return errors;
}
}  // namespace

TEST_CASE("a stream's batch is made by whichever worker is free: a slow worker holds back its own batches only",
          "[loader][tar]") {
  TempDir dir;
  std::size_t n = 0;
  const auto paths = write_uneven_shards(dir, 11, n);  // 88 records
  // Worker 0 takes 40 ms a record; the others none. With batch b bound to worker b mod 3, worker
  // 0 would make 14 or 15 of the 44 batches (and the others wait for it).
  auto ds = TarShards(paths).map([](TarRecord r, SampleContext& ctx) {
    if (ctx.worker().id == 0) std::this_thread::sleep_for(std::chrono::milliseconds(40));
    return record_id(r) * 10 + ctx.worker().id;
  });
  DataLoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 3;
  o.prefetch_factor = 4;
  o.drop_last = true;
  DataLoader loader(ds, o);
  std::vector<std::vector<std::int64_t>> batches = epoch_batches(loader);
  REQUIRE(batches.size() == n / 2);
  std::size_t by_worker0 = 0;
  std::vector<std::int64_t> ids;
  for (const auto& b : batches) {
    REQUIRE(b.size() == 2);
    CHECK(b[0] % 10 == b[1] % 10);  // one worker a batch
    by_worker0 += b[0] % 10 == 0 ? 1 : 0;
    for (std::int64_t v : b) ids.push_back(v / 10);
  }
  CHECK(by_worker0 < batches.size() / 3);
  // The records in the stream's order all the same, whichever worker made each batch.
  DataLoaderOptions one = o;
  one.num_workers = 0;
  DataLoader reference(ds, one);
  std::vector<std::int64_t> expected;
  for (const auto& b : epoch_batches(reference))
    for (std::int64_t v : b) expected.push_back(v / 10);
  CHECK(ids == expected);
}

TEST_CASE("a stream's batch whose records all fail is left out under Skip and Replace; the epoch goes on", "[loader][tar]") {
  TempDir dir;
  TarBuilder t;
  for (int k = 0; k < 14; ++k) {  // records 4-7 (batch 1 of 4) all bad
    const std::string key = "s0/" + std::to_string(k);
    t.file(key + ".txt", key).file(key + ".cls", k >= 4 && k < 8 ? std::string("bad") : std::to_string(k));
  }
  const std::string path = dir / "bad-batch.tar";
  write_file(path, t.finish());
  auto ds = TarShards({path}).map([](TarRecord r) {
    if (r.field("cls")[0] == std::byte{'b'}) throw DataError(r.shard, r.offset, "record '" + r.key + "' has a bad label");
    return static_cast<std::int64_t>(std::stoi(r.key.substr(3)));
  });
  for (OnError policy : {OnError::Skip, OnError::Replace})
    for (int workers : {0, 3})
      for (bool in_order : {true, false}) {
        INFO("policy " << static_cast<int>(policy) << ", " << workers << " workers, in_order " << in_order);
        DataLoaderOptions o;
        o.batch_size = 4;
        o.num_workers = workers;
        o.on_error = policy;
        o.in_order = in_order;
        DataLoader loader(ds, o);
        for (int epoch = 0; epoch < 2; ++epoch) {  // the second on learned offsets
          loader.reset_stats();
          std::vector<std::vector<std::int64_t>> batches = epoch_batches(loader);
          if (in_order) CHECK(batches == std::vector<std::vector<std::int64_t>>{{0, 1, 2, 3}, {8, 9, 10, 11}, {12, 13}});
          std::multiset<std::int64_t> seen;
          for (const auto& b : batches) seen.insert(b.begin(), b.end());
          CHECK(seen == std::multiset<std::int64_t>{0, 1, 2, 3, 8, 9, 10, 11, 12, 13});
          const LoaderStats st = loader.stats();
          CHECK(st.samples_skipped + st.samples_replaced == 4u);
        }
      }
}

TEST_CASE("a tar stream fills batches across workers: the same batches for any worker count, every record once",
          "[loader][tar]") {
  TempDir dir;
  for (int shards : {1, 3, 11}) {
    std::size_t n = 0;
    const auto paths = write_uneven_shards(dir, shards, n);
    const auto ds = identified(paths);
    for (bool drop_last : {false, true}) {
      std::vector<std::vector<std::int64_t>> reference;
      for (int workers : {0, 1, 2, 4, 16}) {
        INFO(shards << " shards (" << n << " records), " << workers << " workers, drop_last " << drop_last);
        DataLoaderOptions o;
        o.batch_size = 4;
        o.num_workers = workers;
        o.drop_last = drop_last;
        o.seed = 5;
        DataLoader loader(ds, o);
        loader.set_epoch(1);
        auto batches = epoch_batches(loader);
        const std::size_t full = n / 4, rest = n % 4;
        REQUIRE(batches.size() == full + (drop_last || rest == 0 ? 0 : 1));
        std::set<std::int64_t> seen;
        for (std::size_t b = 0; b < batches.size(); ++b) {
          CHECK(batches[b].size() == (b < full ? 4 : rest));
          for (std::int64_t v : batches[b]) CHECK(seen.insert(v / 10).second);  // no record twice
        }
        CHECK(seen.size() == (drop_last ? full * 4 : n));  // unseen: at most batch_size - 1
        if (workers == 0)
          reference = batches;
        else
          CHECK(batches == reference);  // the records and their generators' draws
      }
    }
  }
}

TEST_CASE("a loader's tar stream reads its next epoch ahead: the same batches, and no reader left after the loader",
          "[loader][tar]") {
  TempDir dir;
  std::size_t n = 0;
  const auto paths = write_uneven_shards(dir, 5, n);
  const auto ds = identified(paths);
  const std::size_t before = live_threads();
  // Ahead or not; with persistent workers the next epoch's first batches are also made while an
  // epoch ends (DataLoaderOptions::prefetch_next_epoch).
  std::map<std::pair<bool, bool>, std::vector<std::vector<std::int64_t>>> runs;
  for (auto [ahead, persistent] : {std::pair{true, false}, std::pair{false, false}, std::pair{true, true}}) {
    INFO("ahead " << ahead << ", persistent workers " << persistent);
    auto& batches = runs[{ahead, persistent}];
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = 3;
    o.seed = 2;
    o.prefetch_next_epoch = ahead;
    o.persistent_workers = persistent;
    {
      DataLoader loader(ds, o);
      while (loader.next_epoch() < 3)
        for (Tensor& b : loader) batches.push_back(values_of(b));
      loader.set_epoch(7);  // the epoch made ahead (3) is not this one: dropped, and 7 read afresh
      auto seventh = epoch_batches(loader);
      CHECK(seventh.size() == (n + 3) / 4);
    }
    // The reading made ahead for the next epoch ends with the loader (the dataset lives on).
    CHECK(eventually([&] { return live_threads() == before; }));
  }
  const auto& without = runs[{false, false}];
  CHECK(without.size() == 3 * ((n + 3) / 4));
  CHECK(runs[{true, false}] == without);
  CHECK(runs[{true, true}] == without);
}

TEST_CASE("a tar stream resumes mid-epoch at another worker count: the rest of the epoch is the uninterrupted run's",
          "[loader][tar][resume]") {
  TempDir dir;
  std::size_t n = 0;
  const auto paths = write_uneven_shards(dir, 5, n);
  const auto ds = identified(paths);
  DataLoaderOptions o;
  o.batch_size = 3;
  o.seed = 9;
  o.num_workers = 4;
  std::vector<std::vector<std::int64_t>> all;
  {
    DataLoader reference(ds, o);
    while (reference.next_epoch() < 2)
      for (Tensor& b : reference) all.push_back(values_of(b));
  }
  for (std::size_t k : {std::size_t{1}, std::size_t{6}, std::size_t{11}})
    for (int workers : {0, 2, 3, 7}) {
      INFO("saved after " << k << " batches with 4 workers, resumed with " << workers);
      DataLoader first(ds, o);
      LoaderState saved;
      {
        auto it = first.begin();
        for (std::size_t i = 0; i + 1 < k; ++i, ++it) (void)*it;
        (void)*it;
        saved = first.state();
      }
      DataLoaderOptions again = o;
      again.num_workers = workers;
      // Persistent workers make the next epoch's first batches ahead: from its start, not from
      // the resumed epoch's position.
      again.persistent_workers = workers >= 3;
      DataLoader resumed(ds, again);
      resumed.restore(LoaderState::from_string(saved.to_string()));
      std::vector<std::vector<std::int64_t>> rest;
      while (resumed.next_epoch() < 2)
        for (Tensor& b : resumed) rest.push_back(values_of(b));
      REQUIRE(rest.size() == all.size() - k);
      CHECK(std::equal(rest.begin(), rest.end(), all.begin() + static_cast<std::ptrdiff_t>(k)));
    }
}

TEST_CASE("a bad record in a shard the workers share: the error policy holds, nothing lost or delivered twice",
          "[loader][tar][errors]") {
  TempDir dir;
  TarBuilder t;
  for (int k = 0; k < 23; ++k) {
    const std::string key = "s0/" + std::to_string(k);
    t.file(key + ".txt", key).file(key + ".cls", k == 5 || k == 17 ? std::string("bad") : std::to_string(k % 10));
  }
  const std::string path = dir / "one.tar";
  write_file(path, t.finish());
  auto ds = TarShards({path}).map([](TarRecord r) {
    const auto& cls = r.field("cls");
    if (cls[0] == std::byte{'b'}) throw DataError(r.shard, r.offset, "record '" + r.key + "' has a bad label");
    return static_cast<std::int64_t>(std::stoi(r.key.substr(3)));
  });
  for (OnError policy : {OnError::Raise, OnError::Skip, OnError::Replace})
    for (int workers : {0, 4}) {
      INFO("policy " << static_cast<int>(policy) << ", " << workers << " workers");
      DataLoaderOptions o;
      o.batch_size = 4;
      o.num_workers = workers;
      o.on_error = policy;
      DataLoader loader(ds, o);
      std::multiset<std::int64_t> seen;
      auto errors = iterate_skipping_errors<DataError>(loader, [&](Tensor& b) {
        for (std::int64_t v : values_of(b)) seen.insert(v);
      });
      std::multiset<std::int64_t> good;
      for (int k = 0; k < 23; ++k)
        if (k != 5 && k != 17) good.insert(k);
      if (policy == OnError::Raise) {
        // Each bad record fails its batch; the batch's other records go with it.
        CHECK(errors.size() == 2);
        for (const auto& e : errors) CHECK_THAT(e, Catch::Contains("bad label"));
        for (std::int64_t v : seen) CHECK(good.count(v) == 1);
        CHECK(seen.size() == 23 - 8);
        CHECK(std::set<std::int64_t>(seen.begin(), seen.end()).size() == seen.size());
      } else {
        CHECK(errors.empty());
        CHECK(seen == good);
      }
    }
}

namespace {
// A record's whole content (key, fields, bytes) and its epoch position, as one number.
std::int64_t content_of(const TarRecord& r, SampleContext& ctx) {
  std::uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](const void* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ULL;
  };
  mix(r.key.data(), r.key.size());
  for (const auto& [name, bytes] : r.fields) {
    mix(name.data(), name.size());
    mix(bytes.data(), bytes.size());
  }
  const std::uint64_t at = ctx.index();
  mix(&at, sizeof at);
  return static_cast<std::int64_t>(h >> 1);
}
}  // namespace

TEST_CASE(
    "a local shard's record offsets are learned in its first reading: later epochs deal the same records, "
    "a changed shard is read again and a damaged one stays a stream",
    "[loader][tar]") {
  TempDir dir;
  std::size_t n = 0;
  auto paths = write_uneven_shards(dir, 4, n);
  TarShardsOptions so;
  so.shuffle = false;  // every epoch in one order: epochs comparable batch by batch
  for (int workers : {0, 3}) {
    INFO(workers << " workers");
    paths = write_uneven_shards(dir, 4, n);  // shard 1 as written first
    TarShards shards(paths, so);
    auto ds = shards.map([](TarRecord r, SampleContext& ctx) { return content_of(r, ctx); });
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    // An epoch made ahead deals its records before the shard below is rewritten (its workers would
    // then fail the shard as changed): each epoch made when it begins.
    o.prefetch_next_epoch = false;
    DataLoader loader(ds, o);
    CHECK(shards.learned_shards() == 0);
    loader.set_epoch(0);
    const auto streamed = epoch_batches(loader);
    CHECK(streamed.size() == (n + 3) / 4);
    CHECK(shards.learned_shards() == 4);  // a copy's learning is the dataset's
    loader.set_epoch(1);
    CHECK(epoch_batches(loader) == streamed);  // read at the learned offsets: the same records, bytes and positions

    // A shard rewritten: read as a stream again (its new records), and learned again.
    write_file(paths[1], shard_bytes(7, 9));
    loader.set_epoch(2);
    const auto rewritten = epoch_batches(loader);
    {
      TarShards fresh(paths, so);
      DataLoader reference(fresh.map([](TarRecord r, SampleContext& ctx) { return content_of(r, ctx); }), o);
      reference.set_epoch(2);
      CHECK(rewritten == epoch_batches(reference));
    }
    CHECK(rewritten != streamed);
    CHECK(shards.learned_shards() == 4);
    loader.set_epoch(3);
    CHECK(epoch_batches(loader) == rewritten);
  }

  // A damaged shard is not learned: each epoch fails it as the first did, the others learned.
  Bytes damaged = shard_bytes(9, 5);
  damaged[512 * 6 + 10] ^= std::byte{0x40};  // the header of the 4th member
  paths.push_back(dir / "damaged.tar");
  write_file(paths.back(), damaged);
  TarShards shards(paths, so);
  auto ds = shards.map([](TarRecord r) { return record_id(r); });
  DataLoaderOptions o;
  o.batch_size = 1;
  o.num_workers = 2;
  DataLoader loader(ds, o);
  std::vector<std::vector<std::string>> errors(2);
  std::vector<std::multiset<std::int64_t>> seen(2);
  for (int e = 0; e < 2; ++e) {
    loader.set_epoch(static_cast<std::uint64_t>(e));
    errors[e] = iterate_skipping_errors<DataError>(loader, [&](Tensor& b) {
      for (std::int64_t v : values_of(b)) seen[e].insert(v);
    });
    CHECK(shards.learned_shards() == 4);
  }
  CHECK(errors[0].size() == 1);
  CHECK(any_worker(errors[1]) == any_worker(errors[0]));
  CHECK(seen[1] == seen[0]);
  CHECK(seen[0].size() == n - 10 + 9 + 1);  // shard 1 (10 records) rewritten with 9; the damaged shard's first record
}

namespace {
// A user's stream: 0, 1, 2, ... n - 1, split by worker (each worker opens its own share).
struct Counting : DatasetBase<Counting> {
  std::int64_t n = 0;
  struct Stream {
    std::int64_t i, end;
    std::optional<std::int64_t> next() { return i < end ? std::optional<std::int64_t>(i++) : std::nullopt; }
  };
  Stream open(const WorkerInfo& w) const {
    auto [b, e] = shard_range(static_cast<std::size_t>(n), w.id, w.num_workers);
    return Stream{static_cast<std::int64_t>(b), static_cast<std::int64_t>(e)};
  }
};
}  // namespace

TEST_CASE("a user's stream opts in to one batcher across workers with across_workers()", "[loader][stream]") {
  Counting c;
  c.n = 29;
  auto ds = c.across_workers().map(
      [](std::int64_t v, SampleContext& ctx) { return v * 10 + static_cast<std::int64_t>(ctx.rng().randint(10)); });
  std::vector<std::vector<std::int64_t>> reference;
  for (int workers : {0, 2, 5}) {
    INFO(workers << " workers");
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    DataLoader loader(ds, o);
    auto batches = epoch_batches(loader);
    REQUIRE(batches.size() == 8);
    for (std::size_t b = 0; b < batches.size(); ++b)
      for (std::size_t i = 0; i < batches[b].size(); ++i) CHECK(batches[b][i] / 10 == static_cast<std::int64_t>(4 * b + i));
    if (workers == 0)
      reference = batches;
    else
      CHECK(batches == reference);
  }
  // Without across_workers, each worker batches its own share: 2 workers make 15 + 14 records
  // into 4 + 4 batches, two of them short.
  DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  DataLoader own(c, o);
  std::size_t shorts = 0, count = 0;
  for (Tensor& b : own) {
    ++count;
    if (b.numel() < 4) ++shorts;
  }
  CHECK(count == 8);
  CHECK(shorts == 2);
}

// --- TarImages: shards indexed as a map-style dataset -----------------------------------------

namespace {
// The same 3 classes x 5 images as a folder tree and as 2 shards (records in the folder's order,
// split 8 + 7), so both datasets index the same images the same way.
struct SameImages {
  TempDir dir;
  std::vector<std::string> shards;
  std::string root;
  SameImages() {
    root = dir / "root";
    TarBuilder a, b;
    int n = 0;
    for (int label = 0; label < 3; ++label)
      for (int k = 0; k < 5; ++k, ++n) {
        const int w = 40 + 9 * ((k + label) % 4), h = 30 + 7 * ((2 * k + label) % 3);
        const Bytes jpg =
            encode_jpeg(textured(w, h, 3, static_cast<std::uint32_t>(n + 1)), w, h, 3, 90, k % 2 ? TJSAMP_420 : TJSAMP_444);
        const std::string name = "c" + std::to_string(label) + "/" + std::to_string(k);
        write_file(root + "/" + name + ".jpg", jpg);
        (n < 8 ? a : b).file(name + ".jpg", jpg).file(name + ".cls", std::to_string(label) + "\n");
      }
    shards = {dir / "a.tar", dir / "b.tar"};
    write_file(shards[0], a.finish());
    write_file(shards[1], b.finish());
  }
};
ImageTransform train_transform() {
  return ImageTransform().random_resized_crop(24, 24).horizontal_flip().to_float().normalize({0.5f, 0.4f, 0.3f},
                                                                                             {0.2f, 0.2f, 0.2f});
}
}  // namespace

TEST_CASE("TarImages indexes shards into a map-style dataset whose batches equal ImageFolder's", "[loader][tar]") {
  SameImages same;
  TarImagesOptions to;
  to.transform = train_transform();
  TarImages tar(same.shards, to);
  REQUIRE(tar.size() == 15);
  CHECK(tar.key(0) == "c0/0");
  CHECK(tar.key(14) == "c2/4");
  CHECK(tar.shard(7) == same.shards[0]);
  CHECK(tar.shard(8) == same.shards[1]);
  ImageFolderOptions fo;
  fo.transform = train_transform();
  ImageFolder folder(same.root, fo);
  REQUIRE(folder.size() == tar.size());
  for (int workers : {0, 3}) {
    INFO(workers << " workers");
    DataLoaderOptions o;
    o.batch_size = 4;
    o.shuffle = true;  // across both shards
    o.seed = 9;
    o.num_workers = workers;
    DataLoader a(folder, o);
    DataLoader b(tar, o);
    auto x = a.begin();
    auto y = b.begin();
    std::size_t batches = 0;
    for (; x != a.end(); ++x, ++y, ++batches) {
      const bool more = y != b.end();
      REQUIRE(more);
      REQUIRE(x->image.shape() == y->image.shape());
      CHECK(std::memcmp(x->image.raw(), y->image.raw(), x->image.nbytes()) == 0);
      CHECK(std::memcmp(x->label.raw(), y->label.raw(), x->label.nbytes()) == 0);
    }
    const bool done = y == b.end();
    CHECK(done);
    CHECK(batches == 4);
  }
  // The comparison can fail: another epoch's crops are not the first's.
  DataLoaderOptions o;
  o.batch_size = 15;
  DataLoader a(folder, o);
  DataLoader b(tar, o);
  b.set_epoch(1);
  auto x = a.begin();
  auto y = b.begin();
  CHECK(std::memcmp(x->image.raw(), y->image.raw(), x->image.nbytes()) != 0);
}

TEST_CASE("TarDecodeStream writes a stream's images into the batch's rows: the mapped stream's batches, under every policy",
          "[loader][tar]") {
  SameImages same;
  // A third shard whose second record's label does not parse.
  TarBuilder bad;
  bad.file("c9/0.jpg", encode_jpeg(textured(40, 30, 3, 77), 40, 30, 3)).file("c9/0.cls", "1\n");
  bad.file("c9/1.jpg", encode_jpeg(textured(40, 30, 3, 78), 40, 30, 3)).file("c9/1.cls", "one\n");
  bad.file("c9/2.jpg", encode_jpeg(textured(40, 30, 3, 79), 40, 30, 3)).file("c9/2.cls", "2\n");
  const std::string third = same.dir / "c.tar";
  write_file(third, bad.finish());
  TarRecordDecodeOptions o;
  o.transform = train_transform();
  TarShardsOptions so;
  so.shuffle = true;
  for (bool damaged : {false, true}) {
    std::vector<std::string> shards = same.shards;
    if (damaged) shards.push_back(third);
    const TarDecodeStream direct(TarShards(shards, so), o);
    const auto mapped =
        TarShards(shards, so).map([o](TarRecord r, SampleContext& ctx) { return decode_labeled_image(r, o, ctx.rng()); });
    for (OnError policy : {OnError::Raise, OnError::Skip, OnError::Replace})
      for (int workers : {0, 3})
        for (bool drop_last : {false, true}) {
          INFO("damaged " << damaged << ", policy " << static_cast<int>(policy) << ", " << workers << " workers, drop_last "
                          << drop_last);
          DataLoaderOptions lo;
          lo.batch_size = 4;
          lo.num_workers = workers;
          lo.drop_last = drop_last;
          lo.on_error = policy;
          lo.seed = 3;
          DataLoader a(direct, lo);
          DataLoader b(mapped, lo);
          static_assert(std::is_same_v<decltype(a)::Batch, LabeledBatch>);
          for (std::uint64_t epoch : {0, 1}) {  // the second on learned offsets
            a.set_epoch(epoch);
            b.set_epoch(epoch);
            std::vector<LabeledBatch> from_a, from_b;
            const auto errors_a = iterate_skipping_errors<DataError>(a, [&](LabeledBatch& x) { from_a.push_back(x); });
            const auto errors_b = iterate_skipping_errors<DataError>(b, [&](LabeledBatch& x) { from_b.push_back(x); });
            CHECK(any_worker(errors_a) == any_worker(errors_b));
            CHECK(errors_a.size() == (damaged && policy == OnError::Raise ? 1u : 0u));
            REQUIRE(from_a.size() == from_b.size());
            for (std::size_t k = 0; k < from_a.size(); ++k) {
              CHECK(from_a[k].image.equal(from_b[k].image));
              CHECK(from_a[k].label.equal(from_b[k].label));
            }
            std::size_t rows = 0;
            for (const auto& x : from_a) rows += static_cast<std::size_t>(x.label.numel());
            const std::size_t good = 15 + (damaged ? 2 : 0), all = 15 + (damaged ? 3 : 0);
            if (policy == OnError::Raise)
              CHECK(rows <= all);
            else if (!drop_last)
              CHECK(rows == good);
          }
        }
  }
  // A transform without a fixed size cannot be batched in place.
  TarRecordDecodeOptions free;
  const TarDecodeStream loose(TarShards(same.shards), free);
  DataLoaderOptions lo;
  lo.batch_size = 4;
  DataLoader l(loose, lo);
  CHECK_THROWS_WITH(
      [&] {
        for (LabeledBatch& b : l) (void)b;
      }(),
      Catch::Contains("TarDecodeStream") && Catch::Contains("fixed size"));
}

TEST_CASE("TarImages with decode=gpu fills the same encoded rows as ImageFolder", "[unit][tar][decode]") {
  // The ragged batch the device stage decodes: each image's compressed bytes and its plan.
  SameImages same;
  TarImagesOptions to;
  to.transform = train_transform();
  to.decode = ImageFolderOptions::Decode::Gpu;
  ImageFolderOptions fo;
  fo.transform = train_transform();
  fo.decode = ImageFolderOptions::Decode::Gpu;
  TarImages tar(same.shards, to);
  ImageFolder folder(same.root, fo);
  REQUIRE(tar.decodes_on_device());
  LabeledBatch x = folder.make_batch(15, pageable_allocator());
  LabeledBatch y = tar.make_batch(15, pageable_allocator());
  REQUIRE(x.encoded.nbytes() == y.encoded.nbytes());  // the same largest file, so the same slots
  CHECK_FALSE(y.image.defined());
  for (std::size_t i = 0; i < 15; ++i) {
    SampleContext cx(3, 7, i, WorkerInfo{}), cy(3, 7, i, WorkerInfo{});
    folder.get_into(i, x, 14 - i, cx);
    tar.get_into(i, y, 14 - i, cy);
  }
  CHECK(std::memcmp(x.encoded_index.raw(), y.encoded_index.raw(), x.encoded_index.nbytes()) == 0);
  CHECK(std::memcmp(x.label.raw(), y.label.raw(), x.label.nbytes()) == 0);
  const auto* idx = y.encoded_index.data<std::int64_t>();
  for (std::int64_t r = 0; r < 15; ++r) {
    const std::int64_t at = idx[r * detail::kEncodedIndexWords], n = idx[r * detail::kEncodedIndexWords + 1];
    CHECK(std::memcmp(x.encoded.data<std::uint8_t>() + at, y.encoded.data<std::uint8_t>() + at, static_cast<std::size_t>(n)) ==
          0);
  }
  // A PNG record is refused with its name, as in ImageFolder; the registry takes the typed path.
  TempDir dir;
  write_file(dir / "p.tar", TarBuilder().file("k.png", encode_png(gradient(8, 8, 3), 8, 8, 3)).file("k.cls", "1").finish());
  TarImages png({dir / "p.tar"}, to);
  LabeledBatch z = png.make_batch(1, pageable_allocator());
  SampleContext ctx(0, 1, 0, WorkerInfo{});
  CHECK_THROWS_WITH(png.get_into(0, z, 0, ctx), Catch::Contains("p.tar: k.png") && Catch::Contains("JPEG files only"));
  TarImagesOptions gray = to;
  gray.channels = 1;
  CHECK_THROWS_WITH(TarImages(same.shards, gray), Catch::Contains("TarImages: decode=gpu produces RGB"));
}

TEST_CASE("TarImages: a damaged shard fails at construction, a bad record at its sample", "[errors][tar]") {
  TempDir dir;
  const Bytes jpg = encode_jpeg(textured(16, 12, 3), 16, 12, 3);
  const Bytes good = TarBuilder()
                         .file("a.jpg", jpg)
                         .file("a.cls", "1")
                         .file("b.jpg", jpg)  // no label
                         .file("c.png", jpg)
                         .file("c.cls", "x2")  // not a class index
                         .file("d.txt", "no image")
                         .file("d.cls", "3")
                         .file("e.jpg", jpg)
                         .file("e.cls", "4")
                         .finish();
  write_file(dir / "good.tar", good);
  TarImagesOptions o;
  o.transform = ImageTransform().resize(8, 8);
  TarImages ds({dir / "good.tar"}, o);
  REQUIRE(ds.size() == 5);
  SampleContext ctx(0, 1, 0, WorkerInfo{});
  CHECK(ds.get(0, ctx).label == 1);
  CHECK(ds.get(4, ctx).label == 4);
  CHECK_THROWS_WITH(ds.get(1, ctx), Catch::Contains("good.tar") && Catch::Contains("record 'b' has no 'cls' field"));
  CHECK_THROWS_WITH(ds.get(2, ctx), Catch::Contains("record 'c'") && Catch::Contains("not a non-negative integer"));
  CHECK_THROWS_WITH(ds.get(3, ctx), Catch::Contains("record 'd' has no image field (looked for: jpg, jpeg, png)"));
  // Through the loader: the bad records are errors at their batches; skip keeps the rest.
  DataLoaderOptions lo;
  lo.batch_size = 5;
  lo.on_error = OnError::Skip;
  lo.max_error_fraction = 1.0;
  std::vector<std::int64_t> labels;
  DataLoader loader(ds, lo);
  for (LabeledBatch& b : loader)
    for (std::int64_t r = 0; r < b.label.numel(); ++r) labels.push_back(b.label.data<std::int64_t>()[r]);
  CHECK(labels == std::vector<std::int64_t>{1, 4});
  // Damage that hides the records after it: an error at construction, naming the shard and offset.
  std::size_t b_header = 0;  // b.jpg's header: records b.. cannot be found past it
  while (std::memcmp(good.data() + b_header, "b.jpg", 6) != 0) b_header += 512;
  Bytes bad = good;
  bad[b_header + 3] ^= std::byte{1};
  write_file(dir / "bad.tar", bad);
  try {
    TarImages({dir / "good.tar", dir / "bad.tar"}, o);
    FAIL("no error");
  } catch (const DataError& e) {
    CHECK_THAT(e.what(), Catch::Contains("bad.tar") && Catch::Contains("bad tar header checksum"));
    CHECK(e.offset() == b_header);
  }
  CHECK_THROWS_WITH(TarImages({}, o), Catch::Contains("the shard list is empty"));
  CHECK_THROWS_WITH(TarImages({dir / "missing.tar"}, o), Catch::Contains("missing.tar") && Catch::Contains("cannot open"));
  write_file(dir / "empty.tar", TarBuilder().dir("d/").finish());
  CHECK_THROWS_WITH(TarImages({dir / "empty.tar"}, o), Catch::Contains("the shards hold no records"));
  // A shard cut after it was indexed: the sample's read says so.
  TarImages later({dir / "good.tar"}, o);
  write_file(dir / "good.tar", Bytes(good.begin(), good.begin() + 1024 + 100));
  CHECK_THROWS_WITH(later.get(0, ctx), Catch::Contains("good.tar") && Catch::Contains("changed after it was indexed"));
}

TEST_CASE("tar_index in the registry and make_tar_index", "[unit][registry][tar]") {
  SameImages same;
  const std::string shards = "shards=" + same.shards[0] + ":" + same.shards[1];
  auto& reg = DatasetRegistry::global();
  DynamicDataset ds = reg.create("tar_index", shards + ",size=8,random_crop=1,float=1");
  CHECK(ds.size() == 15);
  SampleContext ctx(0, 1, 0, WorkerInfo{});
  const std::vector<Tensor> s = ds.get(9, ctx);
  CHECK(s[0].shape() == Shape{3, 8, 8});
  CHECK(s[1].item<std::int64_t>() == 1);
  CHECK_THROWS_WITH(reg.create("tar_index", shards + ",decode=gpu"), Catch::Contains("make_tar_index"));
  CHECK_THROWS_WITH(reg.create("tar_index", "dir=/nonexistent"),
                    Catch::Contains("dataset 'tar_index': dir '/nonexistent' is not a directory"));
  CHECK(make_tar_index(DatasetConfig("tar_index", shards + ",decode=gpu,random_crop=1")).decodes_on_device());
}

TEST_CASE("encode_labeled_image and the collate of EncodedImages give TarImages' encoded rows, packed end to end",
          "[unit][tar][decode]") {
  // A stream's GPU decode: each record's JPEG and plan as a sample; the default collate packs a
  // batch of them into the block and index the device stage decodes.
  SameImages same;
  TarImagesOptions to;
  to.transform = train_transform();
  to.decode = ImageFolderOptions::Decode::Gpu;
  TarImages tar(same.shards, to);
  TarRecordDecodeOptions ro;
  ro.transform = train_transform();
  TarShardsOptions so;
  so.shuffle = false;
  TarShards shards(same.shards, so);
  TarShards::Stream stream = shards.open(WorkerInfo{});
  std::vector<EncodedImage> samples;
  while (std::optional<TarRecord> r = stream.next()) {
    SampleContext ctx(samples.size(), 7, 2, WorkerInfo{});
    samples.push_back(encode_labeled_image(std::move(*r), ro, ctx.rng()));
  }
  REQUIRE(samples.size() == tar.size());
  LabeledBatch x = collate<EncodedImage>(std::span<const EncodedImage>(samples), std::vector<std::size_t>(samples.size()));
  LabeledBatch y = tar.make_batch(samples.size(), pageable_allocator());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    SampleContext ctx(i, 7, 2, WorkerInfo{});
    tar.get_into(i, y, i, ctx);
  }
  CHECK_FALSE(x.image.defined());
  REQUIRE(x.encoded_index.shape() == y.encoded_index.shape());
  CHECK(std::memcmp(x.label.raw(), y.label.raw(), x.label.nbytes()) == 0);
  const auto* xi = x.encoded_index.data<std::int64_t>();
  const auto* yi = y.encoded_index.data<std::int64_t>();
  constexpr std::int64_t W = detail::kEncodedIndexWords;
  std::int64_t next = 0;
  for (std::int64_t r = 0; r < static_cast<std::int64_t>(samples.size()); ++r) {
    INFO("row " << r);
    const std::int64_t at = xi[r * W + detail::EncodedRow::kOffset], n = xi[r * W + detail::EncodedRow::kBytes];
    CHECK(at == next);  // end to end, each at a 64-byte boundary
    CHECK(at % 64 == 0);
    next = at + (n + 63) / 64 * 64;
    CHECK(n == yi[r * W + detail::EncodedRow::kBytes]);
    CHECK(std::memcmp(x.encoded.data<std::uint8_t>() + at, y.encoded.data<std::uint8_t>() + yi[r * W],
                      static_cast<std::size_t>(n)) == 0);
    // Every other word (the size, the crop, the flip, the scale and shift) as TarImages writes it.
    CHECK(std::memcmp(xi + r * W + 1, yi + r * W + 1, (W - 1) * sizeof(std::int64_t)) == 0);
  }
  CHECK(static_cast<std::int64_t>(x.encoded.nbytes()) == next);

  // Errors name the record; settings the device cannot run are refused.
  TempDir dir;
  write_file(dir / "p.tar", TarBuilder()
                                .file("k.png", encode_png(gradient(8, 8, 3), 8, 8, 3))
                                .file("k.cls", "1")
                                .file("j.jpg", encode_jpeg(gradient(8, 8, 3), 8, 8, 3, 90, TJSAMP_444))
                                .file("j.cls", "x")
                                .finish());
  TarShards bad({dir / "p.tar"}, so);
  TarShards::Stream bs = bad.open(WorkerInfo{});
  Generator rng(1);
  CHECK_THROWS_WITH(encode_labeled_image(*bs.next(), ro, rng),
                    Catch::Contains("p.tar: k.png") && Catch::Contains("JPEG files only"));
  CHECK_THROWS_AS(encode_labeled_image(*bs.next(), ro, rng), DataError);  // label "x"
  TarRecordDecodeOptions gray = ro;
  gray.channels = 1;
  TarShards::Stream again = shards.open(WorkerInfo{});
  CHECK_THROWS_WITH(encode_labeled_image(*again.next(), gray, rng), Catch::Contains("decode=gpu produces RGB"));
  TarRecordDecodeOptions no_image = ro;
  no_image.image_fields = {"webp"};
  CHECK_THROWS_WITH(encode_labeled_image(*again.next(), no_image, rng), Catch::Contains("webp"));
}

TEST_CASE("a stream of EncodedImages needs a device and the default collate; the registry's tar opens it with decode=gpu",
          "[unit][tar][decode][registry]") {
  SameImages same;
  TarRecordDecodeOptions ro;
  ro.transform = train_transform();
  auto gpu = TarShards(same.shards).map([ro](TarRecord r, SampleContext& ctx) {
    return encode_labeled_image(std::move(r), ro, ctx.rng());
  });
  DataLoaderOptions o;
  o.batch_size = 4;
  CHECK_THROWS_WITH(DataLoader(gpu, o), Catch::Contains("decodes its images on the GPU") && Catch::Contains("device"));
  o.device = 0;
  auto keep = [](std::vector<EncodedImage> s) { return s; };
  CHECK_THROWS_WITH(DataLoader(gpu, o, keep), Catch::Contains("GPU decode needs the default collate"));

  auto& reg = DatasetRegistry::global();
  const std::string shards = "shards=" + same.shards[0] + ":" + same.shards[1];
  CHECK(std::holds_alternative<TarGpuStream>(reg.open("tar", shards + ",decode=gpu,random_crop=1")));
  CHECK(std::holds_alternative<TarImageStream>(reg.open("tar", shards + ",decode=cpu")));
  CHECK_THROWS_WITH(reg.open("tar", shards + ",decode=gpu,channels=1"), Catch::Contains("channels must be 3"));
  CHECK_THROWS_WITH(reg.open("tar", shards + ",decode=tpu"), Catch::Contains("'decode' must be one of cpu, gpu, got 'tpu'"));
}
