// Tests that every failure inside the pipeline reaches the consumer at its batch's position as a
// WorkerError naming worker, batch, stage and samples with the original nested; that bad options
// are refused with the option named; and that a stalled stage raises TimeoutError.
#include <catch2/catch.hpp>

#include <cerrno>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;

namespace {

struct BadSample : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct FailsAt {
  std::size_t n, bad;
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i) const {
    if (i == bad) throw BadSample("cannot read record " + std::to_string(i));
    return static_cast<std::int64_t>(i);
  }
};

// Iterates manually, skipping failed batches; returns the batches' first values and the error
// messages, each tagged with the type of its nested exception.
template <class Loader>
std::pair<std::vector<std::int64_t>, std::vector<std::string>> drain(Loader& loader) {
  std::vector<std::int64_t> firsts;
  auto errors = test::iterate_skipping_errors(
      loader, [&](auto& batch) { firsts.push_back(batch.template item<std::int64_t>(0)); },
      [](const WorkerError& e) -> std::string {
        try {
          std::rethrow_if_nested(e);
        } catch (const BadSample&) {
          return " [nested BadSample]";
        } catch (...) {
          return " [nested other]";
        }
        return " [nothing nested]";
      });
  return {firsts, errors};
}

}  // namespace

TEST_CASE("a dataset exception surfaces at its batch, names everything and the epoch goes on", "[errors]") {
  for (int workers : {0, 1, 3}) {
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    DataLoader loader(FailsAt{20, 13}, o);
    auto [firsts, errors] = drain(loader);
    CHECK(firsts == std::vector<std::int64_t>{0, 4, 8, 16});
    REQUIRE(errors.size() == 1);
    const std::string& m = errors[0];
    INFO(m);
    CHECK_THAT(m, Catch::Contains(workers ? "worker " : "the consumer thread (num_workers=0)"));
    CHECK_THAT(m, Catch::Contains("stage 'fetch' of batch 3 at sample 13 (samples 12, 13, 14, 15)"));
    CHECK_THAT(m, Catch::Contains("cannot read record 13"));
    CHECK_THAT(m, Catch::Contains("[nested BadSample]"));
  }
}

TEST_CASE("with intra-batch threads a failing sample is still named", "[errors]") {
  DataLoaderOptions o;
  o.batch_size = 8;
  o.num_workers = 1;
  o.intra_batch_threads = 4;
  DataLoader loader(FailsAt{32, 21}, o);
  auto [firsts, errors] = drain(loader);
  CHECK(firsts == std::vector<std::int64_t>{0, 8, 24});
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("of batch 2 at sample 21") && Catch::Contains("[nested BadSample]"));
}

TEST_CASE("WorkerError carries the worker, the batch and the original exception", "[errors]") {
  DataLoaderOptions o;
  o.batch_size = 5;
  o.num_workers = 2;
  DataLoader loader(FailsAt{10, 0}, o);
  try {
    for (auto& b : loader) (void)b;
    FAIL("no exception");
  } catch (const WorkerError& e) {
    CHECK(e.batch() == 0);
    CHECK(e.worker() >= 0);
    CHECK(e.worker() < 2);
    CHECK_THROWS_AS(std::rethrow_exception(e.original()), BadSample);
  }
}

TEST_CASE("transform, collate and collate_fn failures name their stage", "[errors]") {
  DataLoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 2;
  auto transform_fails = map(FailsAt{6, 99}, [](std::int64_t v) -> std::int64_t {
    if (v == 3) throw std::invalid_argument("transform refused 3");
    return v;
  });
  DataLoader a(transform_fails, o);
  auto [fa, ea] = drain(a);
  REQUIRE(ea.size() == 1);
  CHECK_THAT(ea[0], Catch::Contains("stage 'transform' of batch 1 at sample 3"));
  CHECK_THAT(ea[0], Catch::Contains("transform refused 3"));

  struct Ragged {
    std::size_t size() const { return 4; }
    Tensor get(std::size_t i) const { return Tensor::zeros(DType::Int64, {i == 3 ? 2 : 3}); }
  };
  DataLoader b(Ragged{}, o);
  auto [fb, eb] = drain(b);
  REQUIRE(eb.size() == 1);
  CHECK_THAT(eb[0], Catch::Contains("stage 'collate' of batch 1 (samples 2, 3)"));
  CHECK_THAT(eb[0], Catch::Contains("cannot stack sample 3 (int64 [2]) with sample 2 (int64 [3])"));

  DataLoader c(FailsAt{4, 99}, o, [](std::vector<std::int64_t>&& s) -> Tensor {
    if (s[0] == 2) throw std::runtime_error("custom collate failed");
    return collate(s);
  });
  auto [fc, ec] = drain(c);
  REQUIRE(ec.size() == 1);
  CHECK_THAT(ec[0], Catch::Contains("stage 'collate' of batch 1"));
}

TEST_CASE("worker_init_fn failures reach the consumer at each batch that worker takes", "[errors]") {
  DataLoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 2;
  o.worker_init_fn = [](const WorkerInfo& w) {
    if (w.id == 1) throw std::runtime_error("no GPU for worker 1");
  };
  DataLoader loader(FailsAt{40, 99}, o);
  auto [firsts, errors] = drain(loader);
  CHECK(firsts.size() + errors.size() == 20);  // nothing lost, nothing hung
  for (const auto& m : errors) {
    CHECK_THAT(m, Catch::Contains("worker 1 failed in stage 'worker_init_fn'"));
    CHECK_THAT(m, Catch::Contains("no GPU for worker 1"));
  }
}

TEST_CASE("contradictory options are refused, naming the option", "[errors]") {
  auto make = [](DataLoaderOptions o) { DataLoader l(FailsAt{10, 99}, o); };
  DataLoaderOptions o;
  o.batch_size = 0;
  CHECK_THROWS_WITH(make(o), Catch::Contains("batch_size must be >= 1"));
  o = {};
  o.num_workers = -1;
  CHECK_THROWS_WITH(make(o), Catch::Contains("num_workers must be >= 0"));
  o = {};
  o.sampler = std::make_shared<SequentialSampler>(10);
  o.shuffle = true;
  CHECK_THROWS_WITH(make(o), Catch::Contains("sampler and shuffle=true are mutually exclusive"));
  o = {};
  o.batch_sampler = std::make_shared<BatchSampler>(std::make_shared<SequentialSampler>(10), 3, false);
  o.batch_size = 3;
  CHECK_THROWS_WITH(make(o), Catch::Contains("batch_sampler is mutually exclusive"));
  o = {};
  o.persistent_workers = true;
  CHECK_THROWS_WITH(make(o), Catch::Contains("persistent_workers=true needs num_workers > 0"));
  o = {};
  o.prefetch_factor = 0;
  CHECK_THROWS_WITH(make(o), Catch::Contains("prefetch_factor must be >= 1"));
  o = {};
  o.num_workers = -1;
  CHECK_THROWS_AS(make(o), OptionError);  // a ferry::Error of its own (Python: also a ValueError)
}

TEST_CASE("a stalled fetch raises TimeoutError naming the stage and batch", "[errors][timeout]") {
  struct Stalls {
    std::shared_ptr<test::Gate> gate = std::make_shared<test::Gate>();
    std::size_t size() const { return 8; }
    std::int64_t get(std::size_t i) const {
      if (i == 0) gate->wait();
      return static_cast<std::int64_t>(i);
    }
  };
  Stalls ds;
  DataLoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 2;
  o.timeout = std::chrono::milliseconds(50);
  DataLoader loader(ds, o);
  {
    auto it = loader.begin();
    try {
      (void)(it == loader.end());
      FAIL("no timeout");
    } catch (const TimeoutError& e) {
      INFO(e.what());
      CHECK_THAT(e.what(), Catch::Contains("timed out after 50 ms on batch 0"));
      CHECK_THAT(e.what(), Catch::Contains("worker ") && Catch::Contains("in stage 'fetch' of batch 0 at sample 0 for"));
      CHECK_THAT(e.what(), Catch::Contains("abandoned and replaced"));
    }
    ds.gate->open();  // let the stuck worker return so the iterator can be destroyed
  }
  // The loader is usable again.
  std::size_t n = 0;
  for (auto& b : loader) n += static_cast<std::size_t>(b.numel());
  CHECK(n == 8);
}

namespace {
struct BadFile {
  std::size_t size() const { return 12; }
  std::int64_t get(std::size_t i) const {
    if (i == 5) throw DataError("shard-3.bin", 4096, "bad record");
    return static_cast<std::int64_t>(i);
  }
};
}  // namespace

struct UnreadableFile {
  std::size_t size() const { return 12; }
  std::int64_t get(std::size_t i) const {
    if (i == 6) throw IoError("shard-4.bin", 512, "read: permission denied", EACCES);
    return static_cast<std::int64_t>(i);
  }
};

TEST_CASE("an IoError keeps its type and errno on the consumer, as where a dataset is built", "[errors]") {
  for (int workers : {0, 2}) {
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    DataLoader loader(UnreadableFile{}, o);
    auto errors = test::iterate_skipping_errors<IoError>(
        loader, [](Tensor&) {},
        [](const IoError& e) {
          CHECK(e.error_number() == EACCES);
          CHECK(e.file() == "shard-4.bin");
          CHECK(e.offset() == 512);
          return std::string();
        });
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::StartsWith("shard-4.bin: at byte 512: read: permission denied [") &&
                              Catch::Contains("batch 1") && Catch::Contains("at sample 6"));
  }
}

TEST_CASE("a DataError keeps its type, file and offset on the consumer, and the epoch goes on", "[errors]") {
  for (int workers : {0, 2}) {
    DataLoaderOptions o;
    o.batch_size = 4;
    o.num_workers = workers;
    DataLoader loader(BadFile{}, o);
    std::vector<std::int64_t> firsts;
    auto errors = test::iterate_skipping_errors<DataError>(
        loader, [&](Tensor& b) { firsts.push_back(b.item<std::int64_t>(0)); },
        [](const DataError& e) {
          CHECK(e.file() == "shard-3.bin");
          CHECK(e.offset() == 4096);
          return std::string();
        });
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Catch::StartsWith("shard-3.bin: at byte 4096: bad record [") && Catch::Contains("batch 1") &&
                              Catch::Contains("at sample 5"));
    CHECK(firsts == std::vector<std::int64_t>{0, 8});
  }
}
