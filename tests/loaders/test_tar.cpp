// Tests that tar archives (ustar, GNU long names, pax) read member by member, that shards split
// across ranks and workers with every record read once, and that a damaged shard is a DataError
// with the shard and offset after which the stream goes on with its next shard.
#include <catch2/catch.hpp>

#include <atomic>
#include <set>

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
  cut.resize(512 + 512 + 512 + 2);  // b.txt's data cut short
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
    auto messages = iterate_skipping_errors<DataError>(loader, [&](std::vector<std::pair<std::string, std::int64_t>>& batch) {
      for (auto& [key, label] : batch) {
        CHECK(keys.insert(key).second);
        CHECK(label == std::stoi(key.substr(key.find('/') + 1)) % 10);
      }
    }, [&](const DataError& e) {
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
  CHECK_THROWS_WITH(decode_labeled_image(r, {}, g), Catch::Contains("not a non-negative integer") && Catch::Contains("shard.tar"));
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
      return static_cast<std::int64_t>(std::stoi(r.key.substr(1, r.key.find('/') - 1)) * 100 + std::stoi(r.key.substr(r.key.find('/') + 1))) * 10 +
             static_cast<std::int64_t>(ctx.rng().randint(10));
    });
  };
  auto values = [](const Tensor& t) { return std::vector<std::int64_t>(t.data<std::int64_t>(), t.data<std::int64_t>() + t.numel()); };
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
