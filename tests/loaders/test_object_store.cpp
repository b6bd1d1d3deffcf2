// Data in S3-compatible object storage, read from a real server (SeaweedFS on loopback,
// object_store.h): every format gives over s3:// what it gives over the same local files, for 0, 1
// and 4 workers (a tar stream's batches for 0 to 16 workers over 1, 3 and 11 shards); resume mid-epoch; listings of several pages; hedged reads; retries; and errors
// that name the URL and never a credential.
#include <catch2/catch.hpp>

#include <set>
#include <thread>

#include "ferry/ferry.h"
#include "loaders/fault_proxy.h"
#include "loaders/files.h"
#include "loaders/object_store.h"

using namespace ferry;
using namespace ferry::test;

namespace {

constexpr const char* kBucket = "ferry-data";

// The same files on disk and in the bucket, written once per test program.
struct Data {
  TempDir dir;
  std::string local(const std::string& rel) const { return dir / rel; }
  static std::string url(const std::string& rel) { return std::string("s3://") + kBucket + "/" + rel; }
};

const Data& data() {
  static Data files;  // removed at exit, after the tests
  static const Data* d = [] {
    Data* out = &files;
    ObjectStore& store = ObjectStore::get();
    store.use();
    store.bucket(kBucket);
    const auto add = [&](const std::string& rel, const Bytes& b) {
      write_file(out->local(rel), b);
      store.put(std::string(kBucket) + "/" + rel, b);
    };
    // .npy: float32 [10, 3]
    std::vector<float> values(30);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * static_cast<float>(i);
    Bytes raw(values.size() * 4);
    std::memcpy(raw.data(), values.data(), raw.size());
    add("arrays/x.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (10, 3), }", raw));
    // IDX: 20 images of 4x4, labels 0..9 (gzip for the images, as Fashion-MNIST ships)
    Bytes pixels(20 * 16), labels(20);
    for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = std::byte(i * 7 % 251);
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = std::byte(i % 10);
    add("idx/images.gz", gzip(idx_bytes(0x08, {20, 4, 4}, pixels)));
    add("idx/labels", idx_bytes(0x08, {20}, labels));
    // An image folder: 3 classes, one with a nested folder; a text file that is not an image.
    for (int c = 0; c < 3; ++c)
      for (int i = 0; i < 5; ++i) {
        std::vector<std::uint8_t> p = textured(12, 10, 3, static_cast<std::uint32_t>(c * 10 + i + 1));
        const std::string cls = std::string("class-") + char('a' + c);
        const std::string name = (i == 4 && c == 1 ? "nested/" : "") + std::to_string(i) + (i % 2 ? ".png" : ".jpg");
        add("images/train/" + cls + "/" + name, i % 2 ? encode_png(p, 12, 10, 3) : encode_jpeg(p, 12, 10, 3));
      }
    add("images/train/class-a/notes.txt", bytes_of("not an image"));
    // Tar shards: 3 of 7 records each (a jpg and a cls); one record has a field larger than one read.
    for (int s = 0; s < 3; ++s) {
      TarBuilder t;
      for (int r = 0; r < 7; ++r) {
        const std::string key = "s" + std::to_string(s) + "/" + std::to_string(r);
        std::vector<std::uint8_t> p = textured(16, 16, 3, static_cast<std::uint32_t>(s * 100 + r + 1));
        t.file(key + ".jpg", encode_jpeg(p, 16, 16, 3));
        t.file(key + ".cls", std::to_string((s * 7 + r) % 4));
        if (s == 2 && r == 3) t.file(key + ".bin", Bytes(9 << 20, std::byte{7}));  // a field past one 8 MiB read
      }
      char name[32];
      std::snprintf(name, sizeof name, "shards/train-%03d.tar", s);
      add(name, t.finish());
    }
    // 11 small shards of unequal sizes (3 + 7s mod 11 records of a text field).
    for (int s = 0; s < 11; ++s) {
      TarBuilder t;
      for (int r = 0; r < 3 + (7 * s) % 11; ++r) t.file("u" + std::to_string(s) + "/" + std::to_string(r) + ".txt", "x");
      char name[32];
      std::snprintf(name, sizeof name, "uneven/u-%03d.tar", s);
      add(name, t.finish());
    }
    return out;
  }();
  ObjectStore::get().use();
  return *d;
}

std::vector<std::byte> bytes(const Tensor& t) {
  const auto* p = static_cast<const std::byte*>(t.raw());
  return {p, p + t.nbytes()};
}

// Every batch of `epochs` epochs: each tensor's shape and bytes, in order.
template <class Dataset>
std::vector<std::vector<std::byte>> batches(const Dataset& ds, DataLoaderOptions o, int epochs = 1) {
  std::vector<std::vector<std::byte>> out;
  DataLoader loader(ds, o);
  while (loader.next_epoch() < static_cast<std::uint64_t>(epochs))
    for (auto& b : loader) {
      std::vector<std::byte> row = bytes(b.image);
      const std::vector<std::byte> l = bytes(b.label);
      row.insert(row.end(), l.begin(), l.end());
      out.push_back(std::move(row));
    }
  return out;
}

// Shuffled batches of `batch` on `workers` workers.
DataLoaderOptions shuffled(std::size_t batch, int workers, std::uint64_t seed) {
  DataLoaderOptions o;
  o.batch_size = batch;
  o.shuffle = true;
  o.seed = seed;
  o.num_workers = workers;
  return o;
}

TarImagesOptions tar_images() {
  TarImagesOptions o;
  o.transform = ImageTransform().resize(8, 8).to_float();
  return o;
}

}  // namespace

TEST_CASE("npy, IDX and single images read over s3:// equal the local files", "[s3]") {
  const Data& d = data();
  CHECK(read_npy(d.url("arrays/x.npy")).equal(read_npy(d.local("arrays/x.npy"))));
  CHECK(read_idx(d.url("idx/images.gz")).equal(read_idx(d.local("idx/images.gz"))));
  const NpyDataset npy(d.url("arrays/x.npy"));
  REQUIRE(npy.size() == 10);
  CHECK(npy.get(7).equal(NpyDataset(d.local("arrays/x.npy")).get(7)));
  const IdxDataset remote(d.url("idx/images.gz"), d.url("idx/labels"));
  const IdxDataset local(d.local("idx/images.gz"), d.local("idx/labels"));
  for (int workers : {0, 1, 4}) {
    INFO(workers << " workers");
    const DataLoaderOptions o = shuffled(6, workers, 3);
    const auto a = batches(remote, o), b = batches(local, o);
    CHECK(a.size() == 4);
    CHECK(a == b);
  }
  CHECK(read_image(d.url("images/train/class-b/1.png")).equal(read_image(d.local("images/train/class-b/1.png"))));
}

TEST_CASE("token files and Megatron indexed datasets over s3:// equal the local files", "[s3][tokens]") {
  const Data& d = data();
  ObjectStore& store = ObjectStore::get();
  // 997 uint16 tokens; a Megatron index of 3 documents (500, 400, 97 tokens) over the same bytes.
  std::vector<std::uint16_t> tokens(997);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint16_t>(i * 13 % 50000);
  Bytes bin(tokens.size() * 2);
  std::memcpy(bin.data(), tokens.data(), bin.size());
  const Bytes idx = megatron_idx_bytes(8, {500, 400, 97}, {0, 1000, 1800}, {0, 1, 2, 3});
  for (const auto& [rel, bytes] :
       std::vector<std::pair<std::string, Bytes>>{{"tok/t.bin", bin}, {"tok/m.bin", bin}, {"tok/m.idx", idx}}) {
    write_file(d.local(rel), bytes);
    store.put(std::string(kBucket) + "/" + rel, bytes);
  }
  TokenFileOptions u16;
  u16.type = TokenType::UInt16;
  TokenSequenceOptions windows;
  windows.seq_len = 32;
  const TokenSequences remote(open_token_file(d.url("tok/t.bin"), u16), windows);
  const TokenSequences local(open_token_file(d.local("tok/t.bin"), u16), windows);
  TokenSequenceOptions packed;
  packed.seq_len = 32;
  packed.packed = true;
  const TokenSequences mremote(open_megatron(d.url("tok/m")), packed), mlocal(open_megatron(d.local("tok/m")), packed);
  const auto fields = [](const TokenSequences& ds, const DataLoaderOptions& o) {  // each batch's fields' bytes
    std::vector<std::vector<std::byte>> out;
    DataLoader loader(ds, o);
    for (auto& b : loader) {
      std::vector<std::byte> row;
      for (const Tensor& t : b) {
        const auto x = bytes(t);
        row.insert(row.end(), x.begin(), x.end());
      }
      out.push_back(std::move(row));
    }
    return out;
  };
  for (int workers : {0, 3}) {
    INFO(workers << " workers");
    const DataLoaderOptions o = shuffled(8, workers, 5);
    const ObjectStoreStats before = object_store_stats();
    const auto a = fields(remote, o);
    // One request a window: a batch's windows are sent together (prefetch) and taken, not sent again.
    CHECK(object_store_stats().since(before).requests <= remote.size() + 2);
    const auto b = fields(local, o);
    CHECK(a.size() == 4);
    CHECK(a == b);
    const auto ma = fields(mremote, o), mb = fields(mlocal, o);
    CHECK(ma.size() == 4);
    CHECK(ma == mb);
  }
  CHECK_THROWS_WITH(open_megatron(d.url("tok/none")), Catch::Contains("s3://") && Catch::Contains("tok/none.idx"));
}

TEST_CASE("an image folder under an s3:// prefix: the local folder's classes, files and batches", "[s3][image]") {
  const Data& d = data();
  ImageFolderOptions io;
  io.transform = ImageTransform().random_resized_crop(8, 8).horizontal_flip().to_float();
  const ImageFolder remote(d.url("images/train/"), io);
  const ImageFolder local(d.local("images/train"), io);
  CHECK(remote.classes() == local.classes());
  REQUIRE(remote.size() == 15);
  REQUIRE(remote.size() == local.size());
  for (std::size_t i = 0; i < remote.size(); ++i) {
    CHECK(remote.path(i) == d.url(local.path(i).substr(d.local("").size())));
    CHECK(remote.label(i) == local.label(i));
  }
  CHECK(ImageFolder(d.url("images/train"), io).size() == 15);  // with or without the trailing '/'
  for (int workers : {0, 1, 4}) {
    INFO(workers << " workers");
    const DataLoaderOptions o = shuffled(4, workers, 11);
    ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
    const ObjectStoreStats before = object_store_stats();
    const auto a = batches(remote, o, 2);
    // Each batch's images were requested together (prefetch) and none was read twice.
    CHECK(object_store_stats().requests - before.requests == 2 * remote.size());
    ::unsetenv("FERRY_S3_HEDGE_AFTER");
    CHECK(a.size() == 8);
    CHECK(a == batches(local, o, 2));
  }
  // A loader's statistics count what its own workers read, not other loaders'.
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  DataLoader loader(remote, shuffled(5, 2, 1));
  const auto other = batches(remote, shuffled(5, 1, 2), 1);  // another loader, meanwhile
  for (auto& batch : loader) (void)batch;
  ::unsetenv("FERRY_S3_HEDGE_AFTER");
  const LoaderStats s = loader.stats();
  CHECK(s.store_requests == remote.size());
  CHECK(s.store_bytes > 0);
  CHECK(s.cache_hits == 0);
  CHECK_THAT(s.report(), Catch::Contains("object store: 15 requests"));
}

TEST_CASE("tar shards streamed from s3:// give every record the local shards give, for 0, 1 and 4 workers", "[s3][tar]") {
  const Data& d = data();
  const std::vector<std::string> remote = expand_braces(d.url("shards/train-{000..002}.tar"));
  REQUIRE(remote.size() == 3);
  CHECK(remote[2] == d.url("shards/train-002.tar"));
  std::vector<std::string> local;
  for (int s = 0; s < 3; ++s) local.push_back(d.local("shards/train-00" + std::to_string(s) + ".tar"));
  const auto records = [](const std::vector<std::string>& paths, int workers) {
    TarShardsOptions so;
    so.shuffle = false;
    auto ds = TarShards(paths, so).map([](TarRecord r) {
      std::string v =
          r.key + "=" + std::string(reinterpret_cast<const char*>(r.field("cls").data()), r.field("cls").size()) + ":";
      v += std::to_string(r.field("jpg").size());
      return v;
    });
    DataLoaderOptions o;
    o.batch_size = 5;
    o.num_workers = workers;
    DataLoader loader(ds, o, [](std::vector<std::string> v) { return v; });
    std::multiset<std::string> all;
    for (auto& batch : loader) all.insert(batch.begin(), batch.end());
    return all;
  };
  const auto expected = records(local, 0);
  CHECK(expected.size() == 21);
  for (int workers : {0, 1, 4}) {
    INFO(workers << " workers");
    CHECK(records(remote, workers) == expected);
  }
  // The registry's "tar" dataset takes a prefix or a brace pattern.
  auto& reg = DatasetRegistry::global();
  CHECK(tar_shard_paths(DatasetConfig("tar", "dir=" + d.url("shards"))) == remote);
  CHECK(tar_shard_paths(
            DatasetConfig("tar", "shards=" + d.url("shards/train-{000..001}.tar") + ":" + d.local("shards/train-002.tar"))) ==
        std::vector<std::string>{remote[0], remote[1], local[2]});
  (void)reg;
}

TEST_CASE("a stream over s3:// fills batches across workers: the local batches for 0 to 16 workers over 1, 3 and 11 shards",
          "[s3][tar]") {
  const Data& d = data();
  for (int shards : {1, 3, 11}) {
    std::vector<std::string> local, remote;
    for (int s = 0; s < shards; ++s) {
      char name[32];
      std::snprintf(name, sizeof name, "uneven/u-%03d.tar", s);
      local.push_back(d.local(name));
      remote.push_back(Data::url(name));
    }
    // Epochs 2 and 3 (persistent workers make epoch 3's first batches as epoch 2 ends).
    const auto batches = [](const std::vector<std::string>& paths, int workers, bool persistent = false) {
      auto ds = TarShards(paths).map([](TarRecord r, SampleContext& ctx) {
        return r.key + "#" + std::to_string(ctx.rng().randint(1000));  // the record and its generator's draw
      });
      DataLoaderOptions o;
      o.batch_size = 4;
      o.num_workers = workers;
      o.persistent_workers = persistent;
      o.seed = 11;
      DataLoader loader(ds, o, [](std::vector<std::string> v) { return v; });
      loader.set_epoch(2);
      std::vector<std::vector<std::string>> out;
      for (int e = 0; e < 2; ++e)
        for (auto& batch : loader) out.push_back(batch);
      return out;
    };
    const auto expected = batches(local, 0);
    std::size_t n = 0;
    for (int s = 0; s < shards; ++s) n += static_cast<std::size_t>(3 + (7 * s) % 11);
    REQUIRE(expected.size() == 2 * ((n + 3) / 4));
    std::set<std::string> keys;
    for (std::size_t b = 0; b < expected.size() / 2; ++b)
      for (const auto& v : expected[b]) CHECK(keys.insert(v.substr(0, v.find('#'))).second);
    CHECK(keys.size() == n);
    for (int workers : {0, 1, 2, 4, 16}) {
      INFO(shards << " shards, " << workers << " workers");
      CHECK(batches(remote, workers) == expected);
    }
    INFO(shards << " shards, 4 persistent workers");
    CHECK(batches(remote, 4, true) == expected);
  }
}

TEST_CASE("a stream opens each shard with one request, the next one's sent while this one is parsed", "[s3][tar]") {
  const Data& d = data();
  const std::vector<std::string> remote = expand_braces(d.url("shards/train-{000..002}.tar"));
  std::vector<std::string> local;
  for (int s = 0; s < 3; ++s) local.push_back(d.local("shards/train-00" + std::to_string(s) + ".tar"));
  const auto records = [](const std::vector<std::string>& paths) {
    TarShardsOptions so;
    so.shuffle = false;
    TarShards::Stream s = TarShards(paths, so).open(WorkerInfo{});
    std::vector<std::string> all;
    while (auto r = s.next()) all.push_back(r->key + ":" + std::to_string(r->field("jpg").size()));
    return all;
  };
  const auto expected = records(local);
  REQUIRE(expected.size() == 21);
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  {
    // A shard's open reads its size and first 8 MiB piece in one ranged GET; the opens of the
    // second and third shards were sent ahead and taken, each asking for two pieces (16 MiB): the
    // third shard (9.5 MB, two pieces) needs no more.
    const ObjectStoreStats before = object_store_stats();
    CHECK(records(remote) == expected);
    CHECK(object_store_stats().requests - before.requests == 3);
  }
  {
    // The second shard's opening read, sent ahead, fails: its open reads it again (with retries,
    // its first piece alone).
    FaultProxy proxy(ObjectStore::get().port());
    ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
    using F = FaultProxy::Fault;
    proxy.inject({F::None, F::Status503});
    const ObjectStoreStats before = object_store_stats();
    CHECK(records(remote) == expected);
    CHECK(object_store_stats().requests - before.requests == 4);
    ObjectStore::get().use();
  }
  {
    // The opening read sent ahead for the second shard never answers: past the hedge deadline it
    // is dropped and the open reads the shard itself, instead of waiting out the 30 s stall limit.
    FaultProxy proxy(ObjectStore::get().port());
    ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
    ::setenv("FERRY_S3_HEDGE_AFTER", "0.3", 1);
    ::setenv("FERRY_S3_STALL_SECONDS", "30", 1);
    using F = FaultProxy::Fault;
    proxy.inject({F::None, F::Hang});
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(records(remote) == expected);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(seconds < 15);  // not a timing claim: the stall limit alone would take 30 s
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (proxy.hangs_ended_by_client() == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(proxy.hangs_ended_by_client() == 1);  // the dropped read's connection was closed
    ::unsetenv("FERRY_S3_STALL_SECONDS");
    ObjectStore::get().use();
  }
  ::unsetenv("FERRY_S3_HEDGE_AFTER");
}

TEST_CASE("a loader's reader lanes open each shard from the read their lane sent ahead, none wasted", "[s3][tar]") {
  // Nine small shards, more than the loader's reader lanes: each lane sends its next shard's
  // opening read as it opens one, and that lane's next open takes it. A read sent by one lane and
  // looked for by another would be dropped, and its shard read again: more than nine requests.
  const Data& d = data();
  (void)d;
  std::vector<std::string> shards;
  for (int s = 0; s < 9; ++s) {
    TarBuilder t;
    for (int r = 0; r < 3; ++r)
      t.file("s" + std::to_string(s) + "r" + std::to_string(r) + ".bin", "x")
          .file("s" + std::to_string(s) + "r" + std::to_string(r) + ".cls", "1");
    ObjectStore::get().put(std::string(kBucket) + "/lanes/" + std::to_string(s) + ".tar", t.finish());
    shards.push_back(Data::url("lanes/" + std::to_string(s) + ".tar"));
  }
  TarShardsOptions so;
  so.shuffle = false;
  auto keys = TarShards(shards, so).map([](TarRecord r) { return r.key; });
  for (int workers : {1, 3}) {
    INFO(workers << " workers");
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    o.prefetch_next_epoch = false;
    ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
    const ObjectStoreStats before = object_store_stats();
    std::vector<std::string> all;
    for (auto& batch : DataLoader(keys, o)) all.insert(all.end(), batch.begin(), batch.end());
    ::unsetenv("FERRY_S3_HEDGE_AFTER");
    CHECK(all.size() == 27);
    CHECK(all.front() == "s0r0");
    CHECK(all.back() == "s8r2");
    CHECK(object_store_stats().requests - before.requests == 9);
  }
}

TEST_CASE("a shard opened ahead reads on past the two pieces its opening read brought", "[s3][tar]") {
  // A small shard, then one of 20 records of 1 MiB (20 MiB): the second's opening read, sent as
  // the first opens, brings 16 MiB; its reads take their bytes from them, and only the last 4 MiB
  // are asked for.
  const Data& d = data();
  TarBuilder t;
  for (int r = 0; r < 20; ++r)
    t.file("k" + std::to_string(r) + ".bin", Bytes(1 << 20, std::byte(r))).file("k" + std::to_string(r) + ".cls", "1");
  ObjectStore::get().put(std::string(kBucket) + "/ahead/big.tar", t.finish());
  TarShardsOptions so;
  so.shuffle = false;
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  const ObjectStoreStats before = object_store_stats();
  TarShards::Stream s = TarShards({d.url("shards/train-000.tar"), Data::url("ahead/big.tar")}, so).open(WorkerInfo{});
  int small = 0, big = 0;
  while (auto r = s.next()) {
    if (r->fields.count("jpg")) {
      ++small;
      continue;
    }
    const std::vector<std::byte>& b = r->field("bin");
    REQUIRE(b.size() == std::size_t{1} << 20);
    CHECK(r->key == "k" + std::to_string(big));
    CHECK(std::all_of(b.begin(), b.end(), [&](std::byte x) { return x == std::byte(big); }));
    ++big;
  }
  CHECK(small == 7);
  CHECK(big == 20);
  CHECK(object_store_stats().requests - before.requests == 3);
  ::unsetenv("FERRY_S3_HEDGE_AFTER");
}

TEST_CASE("a stream's reads sent ahead arrive while its worker waits for its next job", "[s3][tar]") {
  // One shard of 20 records of 1 MiB (three pieces: 8, 8 and 4 MiB). The worker makes its first
  // two batches from the first piece, with the other two pieces sent ahead, then waits: the loader
  // holds no more than one batch ahead and the consumer holds the first. Those pieces must arrive
  // during the wait (the worker moves them along while it waits), not only once it reads again.
  const Data& d = data();
  (void)d;
  TarBuilder t;
  for (int r = 0; r < 20; ++r)
    t.file("k" + std::to_string(r) + ".bin", Bytes(1 << 20, std::byte(r))).file("k" + std::to_string(r) + ".cls", "1");
  const Bytes shard = t.finish();
  ObjectStore::get().put(std::string(kBucket) + "/idle/one.tar", shard);
  TarShardsOptions so;
  so.shuffle = false;
  auto sizes = TarShards({Data::url("idle/one.tar")}, so).map([](const TarRecord& r) {
    return Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(r.field("bin").size()));
  });
  DataLoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 1;
  o.prefetch_factor = 1;
  o.prefetch_next_epoch = false;  // no read for the next epoch beside the shard's three
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  const ObjectStoreStats before = object_store_stats();
  DataLoader loader(sizes, o);
  auto it = loader.begin();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (object_store_stats().bytes - before.bytes < shard.size() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(object_store_stats().bytes - before.bytes == shard.size());  // the whole shard, while the batch is held
  CHECK(object_store_stats().requests - before.requests == 3);
  std::int64_t records = 0;
  for (; it != loader.end(); ++it) {
    CHECK(it->data<std::int64_t>()[0] == 1 << 20);
    records += it->numel();
  }
  CHECK(records == 20);
  ::unsetenv("FERRY_S3_HEDGE_AFTER");
}

TEST_CASE("a stream's next epoch opens its first shard from the read sent as this epoch ended", "[s3][tar]") {
  // One shard of 9.5 MB: two requests an epoch (its open's 8 MiB and the rest). With
  // prefetch_next_epoch, the next epoch's first 16 MiB are asked for as the epoch's stream ends,
  // and kept for the next epoch's stream, on whatever thread it runs: that epoch then reads its
  // whole shard with no request, as the store, now unreachable, shows.
  const Data& d = data();
  const std::string shard = d.url("shards/train-002.tar");
  TarShardsOptions so;
  so.shuffle = false;
  auto keys = TarShards({shard}, so).map([](TarRecord r) { return r.key + ":" + std::to_string(r.field("jpg").size()); });
  const auto epoch = [](auto& loader) {
    std::multiset<std::string> all;
    for (auto& batch : loader) all.insert(batch.begin(), batch.end());
    return all;
  };
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  std::multiset<std::string> expected;
  for (const auto& [workers, persistent] : {std::pair{0, false}, std::pair{1, false}, std::pair{1, true}, std::pair{3, false}}) {
    INFO(workers << " workers" << (persistent ? ", persistent" : ""));
    DataLoaderOptions o;
    o.batch_size = 3;
    o.num_workers = workers;
    o.persistent_workers = persistent;
    o.io_retries = 0;
    DataLoader loader(keys, o, [](std::vector<std::string> v) { return v; });
    const ObjectStoreStats before = object_store_stats();
    const auto first = epoch(loader);
    CHECK(first.size() == 7);
    if (expected.empty()) expected = first;
    CHECK(first == expected);
    CHECK(object_store_stats().since(before).requests == 3);  // the shard's two, and the next epoch's
    ::setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1", 1);    // nothing listens there
    ::setenv("AWS_MAX_ATTEMPTS", "1", 1);
    CHECK(epoch(loader) == expected);
    ::unsetenv("AWS_MAX_ATTEMPTS");
    ObjectStore::get().use();
  }
  {
    // A read kept for an epoch that never comes ends with the dataset: its connection closes. A
    // shard of one piece: its open, then the next epoch's read, one after the other.
    FaultProxy proxy(ObjectStore::get().port());
    ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
    using F = FaultProxy::Fault;
    proxy.inject({F::None, F::Hang});  // the shard's open passes; the next epoch's read hangs
    {
      auto held = TarShards({d.url("shards/train-000.tar")}, so).map([](TarRecord r) { return r.key; });
      DataLoaderOptions o;
      o.batch_size = 3;
      o.num_workers = 1;
      DataLoader loader(held, o, [](std::vector<std::string> v) { return v; });
      std::size_t records = 0;
      for (auto& batch : loader) records += batch.size();
      CHECK(records == 7);
      CHECK(proxy.hangs_ended_by_client() == 0);  // kept while the dataset lives
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (proxy.hangs_ended_by_client() == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(proxy.hangs_ended_by_client() == 1);
    ObjectStore::get().use();
  }
  {
    // Without it, each epoch reads only its own: the second epoch asks the store again.
    DataLoaderOptions o;
    o.batch_size = 3;
    o.num_workers = 1;
    o.prefetch_next_epoch = false;
    DataLoader loader(keys, o, [](std::vector<std::string> v) { return v; });
    const ObjectStoreStats before = object_store_stats();
    CHECK(epoch(loader) == expected);
    CHECK(object_store_stats().since(before).requests == 2);
    const ObjectStoreStats mid = object_store_stats();
    CHECK(epoch(loader) == expected);
    CHECK(object_store_stats().since(mid).requests == 2);
  }
  ::unsetenv("FERRY_S3_HEDGE_AFTER");
}

TEST_CASE("indexed tar shards over s3://: the local batches, and resume mid-epoch", "[s3][tar][resume]") {
  const Data& d = data();
  const std::vector<std::string> remote = expand_braces(d.url("shards/train-{000..002}.tar"));
  std::vector<std::string> local;
  for (int s = 0; s < 3; ++s) local.push_back(d.local("shards/train-00" + std::to_string(s) + ".tar"));
  const TarImages r(remote, tar_images()), l(local, tar_images());
  REQUIRE(r.size() == 21);
  for (int workers : {0, 1, 4}) {
    INFO(workers << " workers");
    const DataLoaderOptions o = shuffled(4, workers, 5);
    const auto all = batches(r, o, 2);
    CHECK(all == batches(l, o, 2));
    // Saved after 3 batches, resumed by a new loader with another worker count.
    DataLoader first(r, o);
    LoaderState saved;
    {
      auto it = first.begin();
      (void)*it;
      ++it;
      (void)*it;
      ++it;
      (void)*it;
      saved = first.state();
    }
    DataLoaderOptions o2 = o;
    o2.num_workers = workers == 4 ? 1 : 4;
    DataLoader resumed(r, o2);
    resumed.restore(LoaderState::from_string(saved.to_string()));
    std::vector<std::vector<std::byte>> rest;
    while (resumed.next_epoch() < 2)
      for (auto& b : resumed) {
        std::vector<std::byte> row = bytes(b.image);
        const std::vector<std::byte> lb = bytes(b.label);
        row.insert(row.end(), lb.begin(), lb.end());
        rest.push_back(std::move(row));
      }
    REQUIRE(rest.size() == all.size() - 3);
    CHECK(std::equal(rest.begin(), rest.end(), all.begin() + 3));
  }
}

TEST_CASE("object-store errors name the URL and never a credential", "[s3][errors]") {
  const Data& d = data();
  const auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const DataError& e) {
      return e.what();
    }
    return "(no DataError)";
  };
  const std::string missing = message([&] { (void)read_npy(d.url("arrays/missing.npy")); });
  CHECK_THAT(missing, Catch::Contains(d.url("arrays/missing.npy")) && Catch::Contains("does not exist"));
  CHECK_THAT(message([] { (void)read_npy("s3://no-such-bucket-ferry/x.npy"); }),
             Catch::Contains("s3://no-such-bucket-ferry/x.npy") && Catch::Contains("bucket does not exist"));
  CHECK_THAT(message([&] { ImageFolder(d.url("images/nothing-here/")); }),
             Catch::Contains(d.url("images/nothing-here/")) && Catch::Contains("holds no objects"));
  CHECK_THAT(message([&] { (void)TarImages({d.url("shards/none.tar")}); }), Catch::Contains("does not exist"));
  // A wrong secret: refused, and neither the key id nor the secret appears.
  ::setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-xyz", 1);
  const std::string denied = message([&] { (void)read_npy(d.url("arrays/x.npy")); });
  CHECK_THAT(denied, Catch::Contains("access denied") && Catch::Contains(d.url("arrays/x.npy")));
  CHECK(denied.find("wrong-secret-value-xyz") == std::string::npos);
  CHECK(denied.find(kS3Key) == std::string::npos);
  // Anonymous: the server refuses, and the message says no credentials were found.
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
  CHECK_THAT(message([&] { (void)read_npy(d.url("arrays/x.npy")); }), Catch::Contains("anonymous"));
  // Credentials from a profile in a credentials file, as boto3 reads them.
  TempDir home;
  write_file(home / "credentials",
             bytes_of(std::string("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[ferry]\n"
                                  "aws_access_key_id = ") +
                      kS3Key + "\naws_secret_access_key = " + kS3Secret + "\n"));
  ::setenv("AWS_SHARED_CREDENTIALS_FILE", (home / "credentials").c_str(), 1);
  ::setenv("AWS_PROFILE", "ferry", 1);
  CHECK(read_npy(d.url("arrays/x.npy")).numel() == 30);
  ::setenv("AWS_PROFILE", "default", 1);
  CHECK_THAT(message([&] { (void)read_npy(d.url("arrays/x.npy")); }), Catch::Contains("access denied"));
  ObjectStore::get().use();
  CHECK(read_npy(d.url("arrays/x.npy")).numel() == 30);
}

TEST_CASE("a listing of several pages finds every object", "[s3]") {
  (void)data();
  ObjectStore& store = ObjectStore::get();
  store.bucket("ferry-many");
  const int n = 1030;  // S3 answers at most 1000 keys a page
  for (int i = 0; i < n; ++i) {
    char key[64];
    std::snprintf(key, sizeof key, "ferry-many/many/c%d/%04d.png", i % 2, i);
    store.put(key, bytes_of("x"));
  }
  const ImageFolder ds("s3://ferry-many/many/");
  CHECK(ds.size() == static_cast<std::size_t>(n));
  CHECK(ds.classes() == std::vector<std::string>{"c0", "c1"});
  CHECK(ds.path(0) == "s3://ferry-many/many/c0/0000.png");
}

TEST_CASE("hedged reads: a second request for the same bytes, the first answer wins, the bytes are right", "[s3]") {
  const Data& d = data();
  ::setenv("FERRY_S3_HEDGE_AFTER", "0", 1);  // hedge every request at once
  const ObjectStoreStats before = object_store_stats();
  const std::vector<std::string> remote = expand_braces(d.url("shards/train-{000..002}.tar"));
  std::vector<std::string> local;
  for (int s = 0; s < 3; ++s) local.push_back(d.local("shards/train-00" + std::to_string(s) + ".tar"));
  DataLoaderOptions o;
  o.batch_size = 7;
  o.num_workers = 2;
  CHECK(batches(TarImages(remote, tar_images()), o) == batches(TarImages(local, tar_images()), o));
  CHECK(read_idx(d.url("idx/images.gz")).equal(read_idx(d.local("idx/images.gz"))));
  const ObjectStoreStats after = object_store_stats();
  ::unsetenv("FERRY_S3_HEDGE_AFTER");
  CHECK(after.hedges > before.hedges);
  CHECK(after.requests >= before.requests + 2 * (after.hedges - before.hedges));
}

TEST_CASE("a store that does not answer: retried, then a transient IoError naming the URL", "[s3][errors]") {
  (void)data();
  // A loopback port nobody listens on: every connection is refused.
  int port = 0;
  {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = ntohs(a.sin_port);
    ::close(s);
  }
  ::setenv("AWS_ENDPOINT_URL", ("http://127.0.0.1:" + std::to_string(port)).c_str(), 1);
  ::setenv("AWS_MAX_ATTEMPTS", "3", 1);
  const ObjectStoreStats before = object_store_stats();
  bool caught = false;
  try {
    (void)read_npy("s3://ferry-data/arrays/x.npy");
  } catch (const IoError& e) {
    caught = true;
    CHECK(e.transient());
    CHECK_THAT(std::string(e.what()), Catch::Contains("s3://ferry-data/arrays/x.npy") && Catch::Contains("after 3 attempts"));
    CHECK(std::string(e.what()).find(kS3Secret) == std::string::npos);
  }
  CHECK(caught);
  CHECK(object_store_stats().retries - before.retries == 2);
  ObjectStore::get().use();
}

TEST_CASE("a server that accepts and never answers: a dataset built under a ReadDeadline ends with a TimeoutError",
          "[s3][errors]") {
  (void)data();
  // A loopback socket that listens but never accepts: connections complete (the kernel's
  // backlog), requests are sent, and nothing ever comes back.
  const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(s >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(s, 64) == 0);
  REQUIRE(::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::setenv("AWS_ENDPOINT_URL", ("http://127.0.0.1:" + std::to_string(ntohs(a.sin_port))).c_str(), 1);
  ::setenv("AWS_MAX_ATTEMPTS", "5", 1);
  ::setenv("FERRY_S3_STALL_SECONDS", "600", 1);  // without the deadline: 50 minutes
  bool caught = false;
  {
    ReadDeadline bound(std::chrono::milliseconds(300));
    try {
      (void)NpyDataset("s3://ferry-data/arrays/x.npy");
    } catch (const TimeoutError& e) {
      caught = true;
      CHECK_THAT(std::string(e.what()),
                 Catch::Contains("s3://ferry-data/arrays/x.npy") && Catch::Contains("read deadline of 300 ms"));
      CHECK(std::string(e.what()).find(kS3Secret) == std::string::npos);
    }
  }
  CHECK(caught);
  CHECK(detail::io_deadline_ms() == 0);  // the scope is gone
  CHECK_FALSE(detail::io_cancelled());
  {  // nested: the inner scope's deadline counts while it lives, then the outer one's again
    ReadDeadline outer(std::chrono::seconds(60));
    {
      ReadDeadline inner(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      CHECK(detail::io_deadline_passed());
    }
    CHECK(detail::io_deadline_ms() == 60000);
    CHECK_FALSE(detail::io_deadline_passed());
  }
  ::unsetenv("FERRY_S3_STALL_SECONDS");
  ::close(s);
  ObjectStore::get().use();
}

TEST_CASE("shard patterns expand as WebDataset writes them", "[unit][tar]") {
  CHECK(expand_braces("a.tar") == std::vector<std::string>{"a.tar"});
  CHECK(expand_braces("s-{08..11}.tar") == std::vector<std::string>{"s-08.tar", "s-09.tar", "s-10.tar", "s-11.tar"});
  CHECK(expand_braces("s-{3..1}") == std::vector<std::string>{"s-3", "s-2", "s-1"});
  CHECK(expand_braces("{a,b}-{0..1}") == std::vector<std::string>{"a-0", "a-1", "b-0", "b-1"});
  CHECK(expand_braces("s3://b/x-{000..127}.tar").size() == 128);
  CHECK(expand_braces("s3://b/x-{000..127}.tar")[127] == "s3://b/x-127.tar");
  CHECK_THROWS_WITH(expand_braces("x-{0..3"), Catch::Contains("'x-{0..3'") && Catch::Contains("without its '}'"));
  CHECK_THROWS_WITH(expand_braces("x-{a..3}"), Catch::Contains("decimal numbers"));
  CHECK_THROWS_WITH(expand_braces("x-}"), Catch::Contains("without its '{'"));
  CHECK_THROWS_WITH(expand_braces("{0..999}{0..9999}"), Catch::Contains("more than 1000000"));
}

// --- faults, through a proxy between ferry and the server (fault_proxy.h) --------------------------

namespace {

std::vector<std::string> remote_shards() { return expand_braces(Data::url("shards/train-{000..002}.tar")); }
std::vector<std::string> local_shards(const Data& d) {
  std::vector<std::string> local;
  for (int s = 0; s < 3; ++s) local.push_back(d.local("shards/train-00" + std::to_string(s) + ".tar"));
  return local;
}

}  // namespace

TEST_CASE("503s, reset connections and bodies cut short are retried: the local batches, nothing lost or twice", "[s3][faults]") {
  const Data& d = data();
  FaultProxy proxy(ObjectStore::get().port());
  ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  const ObjectStoreStats before = object_store_stats();
  using F = FaultProxy::Fault;
  proxy.inject({F::Status503, F::Reset, F::CutShort, F::Status503, F::Reset});
  DataLoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.num_workers = 2;
  const auto remote = batches(TarImages(remote_shards(), tar_images()), o);
  // The 503s and the cut body are retried by ferry; a reset of a reused connection before any
  // answer, curl itself sends again on a fresh one.
  CHECK(object_store_stats().retries - before.retries >= 3);
  proxy.inject({F::CutShort, F::Status503});
  CHECK(read_idx(d.url("idx/images.gz")).equal(read_idx(d.local("idx/images.gz"))));
  ObjectStore::get().use();
  CHECK(remote == batches(TarImages(local_shards(d), tar_images()), o));
}

TEST_CASE("a batch's grouped read answered with a 503 is sent again by its sample and counted as a retry", "[s3][faults]") {
  const Data& d = data();
  FaultProxy proxy(ObjectStore::get().port());
  ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  const TarImages remote(remote_shards(), tar_images());  // indexed before the fault
  const ObjectStoreStats before = object_store_stats();
  proxy.inject({FaultProxy::Fault::Status503});  // the first read of the first batch's group
  DataLoaderOptions o;
  o.batch_size = 4;
  const auto got = batches(remote, o);
  const ObjectStoreStats after = object_store_stats();
  ObjectStore::get().use();
  CHECK(after.retries - before.retries == 1);
  CHECK(got == batches(TarImages(local_shards(d), tar_images()), o));
}

TEST_CASE("a slow answer: the hedge answers first, with the same bytes", "[s3][faults]") {
  const Data& d = data();
  FaultProxy proxy(ObjectStore::get().port());
  ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
  ::setenv("FERRY_S3_HEDGE_AFTER", "0.2", 1);
  proxy.delay(std::chrono::milliseconds(20000), /*first_only=*/true);  // ended early by the proxy's end
  const ObjectStoreStats before = object_store_stats();
  const auto t0 = std::chrono::steady_clock::now();
  const Tensor remote = read_npy(d.url("arrays/x.npy"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const ObjectStoreStats after = object_store_stats();
  ObjectStore::get().use();
  CHECK(remote.equal(read_npy(d.local("arrays/x.npy"))));
  CHECK(after.hedges - before.hedges == 1);
  CHECK(after.hedges_won - before.hedges_won == 1);
  // An order, not a timing claim: the delayed answer alone takes 20 s, a bound no loaded machine
  // reaches with the hedge's answer (hedges_won above says which answered first).
  CHECK(seconds < 20.0);
}

TEST_CASE("the store stopped mid-epoch and started again: retries recover, nothing lost or twice", "[s3][faults]") {
  const Data& d = data();
  FaultProxy proxy(ObjectStore::get().port());
  ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
  ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
  ::setenv("AWS_MAX_ATTEMPTS", "20", 1);
  const TarImages remote(remote_shards(), tar_images());
  DataLoaderOptions o;
  o.batch_size = 3;
  o.shuffle = true;
  o.num_workers = 2;
  std::vector<std::vector<std::byte>> got;
  std::thread restart;
  {
    DataLoader loader(remote, o);
    for (auto& b : loader) {
      std::vector<std::byte> row = bytes(b.image);
      const std::vector<std::byte> l = bytes(b.label);
      row.insert(row.end(), l.begin(), l.end());
      got.push_back(std::move(row));
      if (got.size() == 2) {  // down for half a second, then back
        proxy.down(true);
        restart = std::thread([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));
          proxy.down(false);
        });
      }
    }
  }
  restart.join();
  ObjectStore::get().use();
  CHECK(got == batches(TarImages(local_shards(d), tar_images()), o));
}

TEST_CASE("a store that stops answering: the loader's timeout holds", "[s3][faults]") {
  const Data& d = data();
  ImageFolderOptions io;
  io.transform = ImageTransform().resize(8, 8);
  const ImageFolder remote(d.url("images/train/"), io);  // listed through the server itself
  {
    FaultProxy proxy(ObjectStore::get().port());
    ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
    ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
    ::setenv("AWS_MAX_ATTEMPTS", "1", 1);
    using F = FaultProxy::Fault;
    proxy.inject({F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang});
    DataLoaderOptions o;
    o.batch_size = 1;
    o.num_workers = 1;
    o.io_retries = 0;
    o.timeout = std::chrono::seconds(1);
    DataLoader loader(remote, o);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(*loader.begin(), TimeoutError);
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 20.0);
    // The abandoned worker's request ends now, not at its 30 s stall limit: the client closes it.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (proxy.hangs_ended_by_client() == 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(proxy.hangs_ended_by_client() >= 1);
  }                                                             // the proxy goes
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // before the settings change under it
  ObjectStore::get().use();
}

TEST_CASE("a tar stream's stalled reads end with the loader, and it sends no more", "[s3][faults][tar]") {
  // Every shard's GET stalls (no answer). The reads are the stream's reader lanes' (BatchFeed), not
  // the workers': the loader's end must still close them within storage.h's bound, not at the
  // client's stall limit (30 s), and no lane may start another shard.
  const Data& d = data();
  std::vector<std::string> shards;
  for (int s = 0; s < 3; ++s) shards.push_back(d.url("shards/train-00" + std::to_string(s) + ".tar"));
  {
    FaultProxy proxy(ObjectStore::get().port());
    ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
    ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
    ::setenv("AWS_MAX_ATTEMPTS", "1", 1);
    using F = FaultProxy::Fault;
    proxy.inject({F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang, F::Hang});
    TarShardsOptions so;
    so.shuffle = false;
    auto keys = TarShards(shards, so).map([](TarRecord r) { return r.key; });
    DataLoaderOptions o;
    o.batch_size = 2;
    o.num_workers = 2;
    o.io_retries = 0;
    o.timeout = std::chrono::seconds(1);
    {
      DataLoader loader(keys, o);
      CHECK_THROWS_AS(*loader.begin(), TimeoutError);
      CHECK(proxy.open_connections() >= 1);  // the lanes' stalled requests, open now
    }                                        // the loader goes
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (proxy.open_connections() > 0 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(proxy.open_connections() == 0);
    const int requests = proxy.requests();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    CHECK(proxy.requests() == requests);  // no lane started another shard
    ::unsetenv("FERRY_S3_HEDGE_AFTER");
    ::unsetenv("AWS_MAX_ATTEMPTS");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ObjectStore::get().use();
}

TEST_CASE("a batch's read that fails is read again while the rest of the batch is in flight", "[s3][faults]") {
  const Data& d = data();
  ImageFolderOptions io;
  io.transform = ImageTransform().resize(8, 8).to_float();
  const ImageFolder remote(d.url("images/train/"), io);  // listed through the server itself
  const ImageFolder local(d.local("images/train"), io);
  DataLoaderOptions o;
  o.batch_size = 5;
  std::vector<std::vector<std::byte>> got;
  {
    FaultProxy proxy(ObjectStore::get().port());
    ::setenv("AWS_ENDPOINT_URL", proxy.endpoint().c_str(), 1);
    ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);
    proxy.delay(std::chrono::milliseconds(300));   // every answer: the batch's reads are still in flight...
    proxy.inject({FaultProxy::Fault::Status503});  // ...when its first read fails and is read again
    got = batches(remote, o);
  }
  ObjectStore::get().use();
  CHECK(got.size() == 3);
  CHECK(got == batches(local, o));
}

namespace {

// FERRY_S3_CACHE_DIR (and _LIMIT) for one scope.
struct CacheDir {
  TempDir dir;
  explicit CacheDir(const char* limit = nullptr) {
    ::setenv("FERRY_S3_CACHE_DIR", dir.path().c_str(), 1);
    if (limit) ::setenv("FERRY_S3_CACHE_LIMIT", limit, 1);
    ::setenv("FERRY_S3_HEDGE_AFTER", "off", 1);  // request counts exact
  }
  ~CacheDir() {
    ::unsetenv("FERRY_S3_CACHE_DIR");
    ::unsetenv("FERRY_S3_CACHE_LIMIT");
    ::unsetenv("FERRY_S3_HEDGE_AFTER");
  }
  std::vector<std::filesystem::path> entries() const {
    std::vector<std::filesystem::path> out;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) out.push_back(e.path());
    return out;
  }
  std::uintmax_t bytes() const {
    std::uintmax_t n = 0;
    for (const auto& p : entries()) n += std::filesystem::file_size(p);
    return n;
  }
};

}  // namespace

TEST_CASE("the on-disk cache: the second epoch of an image folder and of indexed tar shards reads no object", "[s3][cache]") {
  const Data& d = data();
  CacheDir cache;
  ImageFolderOptions io;
  io.transform = ImageTransform().random_resized_crop(8, 8).horizontal_flip().to_float();
  const ImageFolder remote(d.url("images/train/"), io);
  const ImageFolder local(d.local("images/train"), io);
  for (int workers : {0, 2}) {
    INFO(workers << " workers");
    const DataLoaderOptions o = shuffled(4, workers, 5);
    const ObjectStoreStats first = object_store_stats();
    const auto a = batches(remote, o, 1);
    const ObjectStoreStats second = object_store_stats();
    const auto b = batches(remote, o, 2);  // epochs 0 and 1, both from the disk now
    const ObjectStoreStats end = object_store_stats();
    if (workers == 0) CHECK(second.since(first).requests == remote.size());  // each image once, then stored
    CHECK(end.since(second).requests == 0);
    CHECK(end.since(second).cache_hits >= 2 * remote.size());
    CHECK(a == batches(local, o, 1));
    CHECK(b == batches(local, o, 2));
  }
  {
    // The loader's own statistics count its reads: from the disk now, none from the store.
    DataLoader loader(remote, shuffled(4, 2, 5));
    for (auto& batch : loader) (void)batch;
    const LoaderStats s = loader.stats();
    CHECK(s.cache_hits == remote.size());
    CHECK(s.store_requests == 0);
    CHECK_THAT(s.report(), Catch::Contains("15 reads from the disk cache"));
  }
  const std::vector<std::string> shards = expand_braces(d.url("shards/train-{000..002}.tar"));
  std::vector<std::string> local_paths;
  for (int s = 0; s < 3; ++s) local_paths.push_back(d.local("shards/train-00" + std::to_string(s) + ".tar"));
  const TarImages remote_tar(shards, tar_images());  // headers through the cache
  const ObjectStoreStats before = object_store_stats();
  const auto t1 = batches(remote_tar, shuffled(4, 2, 9), 2);
  const ObjectStoreStats mid = object_store_stats();
  const TarImages again(shards, tar_images());  // indexed again: headers and sizes from the disk
  const auto t2 = batches(again, shuffled(4, 2, 9), 2);
  CHECK(object_store_stats().since(mid).requests == 0);
  CHECK(mid.since(before).requests > 0);
  CHECK(t1 == t2);
  CHECK(t1 == batches(TarImages(local_paths, tar_images()), shuffled(4, 2, 9), 2));
}

TEST_CASE("the on-disk cache: a stream's pieces, damaged entries read again, and the limit", "[s3][cache]") {
  const Data& d = data();
  const std::vector<std::string> shards = expand_braces(d.url("shards/train-{000..002}.tar"));
  const auto records = [&](const std::vector<std::string>& paths) {
    TarShardsOptions so;
    so.shuffle = false;
    auto ds = TarShards(paths, so).map([](TarRecord r) { return r.key + ":" + std::to_string(r.field("jpg").size()); });
    DataLoaderOptions o;
    o.batch_size = 5;
    o.num_workers = 2;
    DataLoader loader(ds, o, [](std::vector<std::string> v) { return v; });
    std::multiset<std::string> all;
    for (auto& batch : loader) all.insert(batch.begin(), batch.end());
    return all;
  };
  std::multiset<std::string> expected;
  {
    CacheDir cache;
    expected = records(shards);
    REQUIRE(expected.size() == 21);
    const ObjectStoreStats mid = object_store_stats();
    CHECK(records(shards) == expected);
    CHECK(object_store_stats().since(mid).requests == 0);
    // Damage every entry: cut one short, overwrite another's key; each is read from the store again.
    const auto entries = cache.entries();
    REQUIRE(entries.size() >= 4);
    std::filesystem::resize_file(entries[0], std::filesystem::file_size(entries[0]) / 2);
    {
      std::FILE* f = std::fopen(entries[1].c_str(), "r+b");
      REQUIRE(f);
      std::fseek(f, 12, SEEK_SET);
      std::fputs("s3://other", f);
      std::fclose(f);
    }
    const ObjectStoreStats before = object_store_stats();
    CHECK(records(shards) == expected);
    CHECK(object_store_stats().since(before).requests >= 1);
  }
  {
    // A limit of 4 KiB, under the image folder's 15 images: the least recently used go, and
    // every epoch's batches stay right. The 8 MiB pieces of the stream are larger than the limit
    // and never stored.
    CacheDir cache("4K");
    ImageFolderOptions io;
    io.transform = ImageTransform().resize(8, 8).to_float();
    const ImageFolder remote(d.url("images/train/"), io);
    const auto expected_images = batches(ImageFolder(d.local("images/train"), io), shuffled(4, 2, 1), 2);
    CHECK(batches(remote, shuffled(4, 2, 1), 2) == expected_images);
    CHECK(cache.bytes() <= 4096);
    CHECK(!cache.entries().empty());
    CHECK(records(shards) == expected);
    CHECK(cache.bytes() <= 4096);
  }
  {
    CacheDir cache("lots");  // not a size: one warning, the default limit, reads unaffected
    CHECK(records(shards) == expected);
  }
}
