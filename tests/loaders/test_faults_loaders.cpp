// The per-sample error policies on the real loaders: an image folder with truncated, empty,
// non-image and garbled files; tar shards with a damaged member (and one whose last header claims
// 8 GB); an IDX whose gzip stream is cut.
#include <catch2/catch.hpp>

#include <map>
#include <set>

#include "ferry/ferry.h"
#include "files.h"
#include "helpers.h"

using namespace ferry;
using namespace ferry::test;

namespace {

Bytes flat_image(int label, int w, int h) {
  std::vector<std::uint8_t> p(static_cast<std::size_t>(w * h * 3), static_cast<std::uint8_t>(40 * label + 20));
  return encode_jpeg(p, w, h, 3);
}

// A tar header's size field set to `octal` (11 digits), its checksum recomputed.
void set_member_size(Bytes& tar, std::size_t header_at, const char* octal) {
  std::memcpy(tar.data() + header_at + 124, octal, 11);
  tar[header_at + 135] = std::byte{0};
  std::memset(tar.data() + header_at + 148, ' ', 8);
  unsigned sum = 0;
  for (std::size_t i = 0; i < 512; ++i) sum += std::to_integer<unsigned>(tar[header_at + i]);
  char field[8];
  std::snprintf(field, sizeof field, "%06o", sum);
  std::memcpy(tar.data() + header_at + 148, field, 7);
}

}  // namespace

TEST_CASE("image folder: truncated, empty, non-image and garbled files under each policy", "[loaders][faults][image]") {
  TempDir dir;
  const int per_class = 10;
  for (int label = 0; label < 3; ++label)
    for (int k = 0; k < per_class; ++k)
      write_file(dir / ("root/c" + std::to_string(label) + "/" + std::to_string(k) + ".jpg"), flat_image(label, 24, 20));
  Bytes truncated = flat_image(1, 24, 20);
  truncated.resize(truncated.size() / 3);
  Bytes garbled = flat_image(2, 24, 20);
  for (std::size_t i = 2; i < 40 && i < garbled.size(); ++i) garbled[i] = std::byte{0x5A};  // the markers are gone
  write_file(dir / "root/c0/x-truncated.jpg", truncated);
  write_file(dir / "root/c1/x-empty.jpg", Bytes{});
  write_file(dir / "root/c1/x-text.jpg", bytes_of("not an image at all"));
  write_file(dir / "root/c2/x-garbled.jpg", garbled);
  ImageFolderOptions io;
  io.transform.random_resized_crop(8, 8).horizontal_flip().to_float();
  ImageFolder ds(dir / "root", io);
  REQUIRE(ds.size() == 3 * per_class + 4);

  for (OnError policy : {OnError::Raise, OnError::Skip, OnError::Replace}) {
    for (int workers : {0, 2}) {
      INFO("policy " << int(policy) << ", workers " << workers);
      DataLoaderOptions lo;
      lo.batch_size = 4;
      lo.num_workers = workers;
      lo.shuffle = true;
      lo.on_error = policy;
      lo.max_error_fraction = 0.2;
      std::set<std::string> reported;
      std::mutex mu;
      lo.on_sample_error = [&](const SampleError& e) {
        std::lock_guard l(mu);
        reported.insert(e.message.substr(0, e.message.find(':')));  // the file
      };
      DataLoader loader(ds, lo);
      std::size_t good = 0, rows = 0, batches = 0;
      auto errors = iterate_skipping_errors<DataError>(loader, [&](LabeledBatch& b) {
        ++batches;
        for (std::int64_t r = 0; r < b.label.size(0); ++r) {
          const float v = b.image.data<float>()[r * 192 + 100] * 255.f;
          CHECK(std::lround((v - 20.f) / 40.f) == b.label.data<std::int64_t>()[r]);  // still paired
          ++rows;
        }
        good += static_cast<std::size_t>(b.label.size(0));
      });
      const std::size_t n_batches = (ds.size() + 3) / 4;
      if (policy == OnError::Raise) {
        CHECK(errors.size() >= 1);  // each damaged file fails its batch (two may share one)
        CHECK(errors.size() <= 4);
        CHECK(batches + errors.size() == n_batches);
      } else {
        CHECK(errors.empty());
        CHECK(reported.size() == 4);
        for (const char* f : {"x-truncated.jpg", "x-empty.jpg", "x-text.jpg", "x-garbled.jpg"}) {
          bool named = false;
          for (const std::string& r : reported) named |= r.find(f) != std::string::npos;
          CHECK(named);
        }
        CHECK(batches == n_batches);
        CHECK(rows == (policy == OnError::Skip ? ds.size() - 4 : ds.size()));
        const LoaderStats s = loader.stats();
        CHECK(s.samples_skipped + s.samples_replaced == 4);
      }
    }
  }
}

TEST_CASE("tar shards: a damaged member costs its own record, not the complete one before it", "[loaders][faults][tar]") {
  TempDir dir;
  TarBuilder t;
  for (int k = 0; k < 5; ++k)
    t.file("r/" + std::to_string(k) + ".txt", "record " + std::to_string(k))
        .file("r/" + std::to_string(k) + ".cls", std::to_string(k));
  const std::size_t last_header = t.finish().size() - 1024;
  t.file("r/5.txt", "the member whose header lies");
  Bytes bytes = t.finish();
  set_member_size(bytes, last_header, "77777777777");  // ~8 GB, far past the end of the archive
  write_file(dir / "lying.tar", bytes);
  TarBuilder ok;
  for (int k = 0; k < 4; ++k)
    ok.file("q/" + std::to_string(k) + ".txt", "q" + std::to_string(k)).file("q/" + std::to_string(k) + ".cls", "1");
  write_file(dir / "ok.tar", ok.finish());
  TarShardsOptions so;
  so.shuffle = false;
  TarShards shards({dir / "lying.tar", dir / "ok.tar"}, so);
  auto keys = shards.map([](TarRecord r) { return r.key; });

  // Raw stream: all five complete records come first, then the error, then the next shard.
  {
    auto stream = shards.open(WorkerInfo{0, 1, 0, 0});
    for (int k = 0; k < 5; ++k) {
      auto rec = stream.next();
      REQUIRE(rec);
      CHECK(rec->key == "r/" + std::to_string(k));
    }
    CHECK_THROWS_WITH(stream.next(), Catch::Contains("lying.tar") && Catch::Contains("truncated member 'r/5.txt'"));
    auto rec = stream.next();
    REQUIRE(rec);
    CHECK(rec->key == "q/0");
  }
  for (OnError policy : {OnError::Raise, OnError::Skip, OnError::Replace}) {
    DataLoaderOptions o;
    o.batch_size = 1;
    o.num_workers = 1;
    o.on_error = policy;
    o.max_error_fraction = 0;
    std::size_t reported = 0;
    o.on_sample_error = [&](const SampleError& e) {
      ++reported;
      CHECK_THAT(e.message, Catch::Contains("truncated member 'r/5.txt'"));
    };
    DataLoader loader(keys, o, [](std::vector<std::string> v) { return v; });
    std::vector<std::string> got;
    auto errors = iterate_skipping_errors<DataError>(loader, [&](std::vector<std::string>& b) {
      for (auto& k : b) got.push_back(k);
    });
    INFO("policy " << int(policy));
    CHECK(got.size() == 9);  // 5 + 4: only the lying member's record is lost
    CHECK(errors.size() == (policy == OnError::Raise ? 1u : 0u));
    CHECK(reported == (policy == OnError::Raise ? 0u : 1u));
  }
}

TEST_CASE("an IDX whose gzip stream is cut is an error at construction under any policy", "[loaders][faults][idx]") {
  TempDir dir;
  Bytes images = gzip(idx_bytes(0x08, {4, 2, 2}, Bytes(16)));
  images.resize(images.size() / 2);
  write_file(dir / "images.gz", images);
  write_file(dir / "labels", idx_bytes(0x08, {4}, Bytes(4)));
  // The whole file is read when the dataset is made: there is no sample to skip, and the error
  // names the file before any loader exists.
  CHECK_THROWS_AS(IdxDataset(dir / "images.gz", dir / "labels"), DataError);
  CHECK_THROWS_WITH(IdxDataset(dir / "images.gz", dir / "labels"), Catch::Contains("images.gz"));
}
