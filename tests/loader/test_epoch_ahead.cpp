// Tests DataLoaderOptions::prefetch_next_epoch: with persistent workers the next epoch's first
// batches are made while the current epoch's last ones are consumed, and the batches are exactly
// those made without it; another epoch (set_epoch, restore) drops them; a sample error made ahead
// counts toward its own epoch.
#include <catch2/catch.hpp>

#include <mutex>
#include <pthread.h>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;
using test::eventually;

namespace {
// Sample i of epoch e: i * 1000 + a draw of its generator (keyed by seed, epoch and index), so an
// epoch's batches differ from another's. Records (epoch, index) of every fetch.
struct Recorded {
  struct Log {
    std::mutex mu;
    std::set<std::pair<std::uint64_t, std::size_t>> fetched;
    std::size_t count(std::uint64_t epoch) {
      std::lock_guard lock(mu);
      std::size_t n = 0;
      for (const auto& f : fetched) n += f.first == epoch;
      return n;
    }
  };
  std::size_t n = 64;
  std::shared_ptr<Log> log = std::make_shared<Log>();
  std::set<std::pair<std::uint64_t, std::size_t>> bad;  // (epoch, index) that throw
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i, SampleContext& ctx) const {
    {
      std::lock_guard lock(log->mu);
      log->fetched.emplace(ctx.worker().epoch, i);
    }
    if (bad.count({ctx.worker().epoch, i})) throw DataError("recorded", i, "bad sample");
    return static_cast<std::int64_t>(i * 1000 + ctx.rng().randint(1000));
  }
};

DataLoaderOptions ahead_options(bool ahead) {
  DataLoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 5;
  o.num_workers = 3;
  o.persistent_workers = true;
  o.prefetch_next_epoch = ahead;
  return o;
}

std::vector<std::int64_t> epoch_values(DataLoader<Recorded>& loader) {
  std::vector<std::int64_t> out;
  for (Tensor& b : loader)
    for (std::int64_t r = 0; r < b.numel(); ++r) out.push_back(b.data<std::int64_t>()[r]);
  return out;
}
}  // namespace

TEST_CASE("persistent workers make the next epoch's first batches ahead; the batches are the same", "[loader][ahead]") {
  Recorded ds;
  DataLoader ahead(ds, ahead_options(true));
  DataLoader plain(Recorded{}, ahead_options(false));
  for (std::uint64_t e = 0; e < 3; ++e) {
    INFO("epoch " << e);
    const std::vector<std::int64_t> a = epoch_values(ahead), b = epoch_values(plain);
    CHECK(a.size() == 64);
    CHECK(a == b);
    // Between epochs, the next epoch's first batches are being made (or are made): at most the
    // prefetch window's (prefetch_factor x num_workers batches).
    CHECK(eventually([&] { return ds.log->count(e + 1) > 0; }));
    CHECK(ds.log->count(e + 1) <= 2 * 3 * 4);
  }
  // The comparison can fail: epochs differ from each other.
  DataLoader again(Recorded{}, ahead_options(false));
  const std::vector<std::int64_t> first = epoch_values(again), second = epoch_values(again);
  CHECK(first != second);
}

namespace {
// A stream of n records, epoch * 1000 + i, that logs each record read (epoch, i).
struct RecordedStream : DatasetBase<RecordedStream> {
  std::int64_t n = 30;
  std::shared_ptr<Recorded::Log> log = std::make_shared<Recorded::Log>();
  struct Stream {
    std::uint64_t epoch;
    std::int64_t i, n;
    std::shared_ptr<Recorded::Log> log;
    std::optional<std::int64_t> next() {
      if (i >= n) return std::nullopt;
      {
        std::lock_guard lock(log->mu);
        log->fetched.emplace(epoch, static_cast<std::size_t>(i));
      }
      return static_cast<std::int64_t>(epoch) * 1000 + i++;
    }
  };
  Stream open(const WorkerInfo& w) const { return Stream{w.epoch, 0, n, log}; }
};

DataLoaderOptions stream_options(bool ahead) {
  DataLoaderOptions o = ahead_options(ahead);
  o.shuffle = false;  // a stream decides its own order
  return o;
}
}  // namespace

TEST_CASE("persistent workers make a shared stream's next epoch's first batches ahead; the batches are the same",
          "[loader][ahead][stream]") {
  RecordedStream plain;
  const auto ds = plain.across_workers();
  std::vector<std::int64_t> reference;
  {
    DataLoaderOptions o = stream_options(false);
    o.persistent_workers = false;
    DataLoader loader(RecordedStream{}.across_workers(), o);
    for (int e = 0; e < 3; ++e)
      for (Tensor& b : loader)
        for (std::int64_t r = 0; r < b.numel(); ++r) reference.push_back(b.data<std::int64_t>()[r]);
    CHECK(reference.size() == 3 * 30);
  }
  DataLoader loader(ds, stream_options(true));
  std::vector<std::int64_t> values;
  for (std::uint64_t e = 0; e < 3; ++e) {
    INFO("epoch " << e);
    for (Tensor& b : loader)
      for (std::int64_t r = 0; r < b.numel(); ++r) values.push_back(b.data<std::int64_t>()[r]);
    // Between epochs the next epoch's records are being read: its stream was opened by the
    // batches made ahead, before begin() asked for it.
    CHECK(eventually([&] { return plain.log->count(e + 1) > 0; }));
  }
  CHECK(values == reference);
  // Without persistent workers nothing of the next epoch is read before it begins.
  RecordedStream other;
  DataLoaderOptions o = stream_options(true);
  o.persistent_workers = false;
  DataLoader fresh(other.across_workers(), o);
  for (Tensor& b : fresh) (void)b;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(other.log->count(1) == 0);
}

TEST_CASE("work made ahead for an epoch that does not follow is dropped", "[loader][ahead]") {
  Recorded ds;
  DataLoader loader(ds, ahead_options(true));
  (void)epoch_values(loader);
  CHECK(eventually([&] { return ds.log->count(1) > 0; }));
  loader.set_epoch(7);
  const std::vector<std::int64_t> seventh = epoch_values(loader);
  DataLoader fresh(Recorded{}, ahead_options(false));
  fresh.set_epoch(7);
  CHECK(seventh == epoch_values(fresh));
  // Restoring a checkpoint taken mid-epoch 7 drops what was made ahead for epoch 8.
  CHECK(eventually([&] { return ds.log->count(8) > 0; }));
  DataLoader reference(Recorded{}, ahead_options(false));
  reference.set_epoch(7);
  LoaderState mid;
  std::vector<std::int64_t> rest;
  {
    auto it = reference.begin();
    for (int k = 0; k < 5; ++k, ++it) (void)*it;
    mid = reference.state();
    for (; it != reference.end(); ++it)
      for (std::int64_t r = 0; r < it->numel(); ++r) rest.push_back(it->data<std::int64_t>()[r]);
  }
  loader.restore(mid);
  CHECK(epoch_values(loader) == rest);
}

TEST_CASE("a sample error met ahead counts toward its own epoch", "[loader][ahead][errors]") {
  // One bad sample in epoch 0 (its last batch) and one in epoch 1 (its first batch, met while
  // epoch 0 is consumed), max_errors = 1 an epoch: neither epoch is over its limit.
  Recorded ds;
  ds.bad = {{0, 62}, {1, 2}};
  DataLoaderOptions o = ahead_options(true);
  o.shuffle = false;
  o.on_error = OnError::Skip;
  o.max_errors = 1;
  std::vector<SampleError> seen;
  std::mutex mu;
  o.on_sample_error = [&](const SampleError& e) {
    std::lock_guard lock(mu);
    seen.push_back(e);
  };
  DataLoader loader(ds, o);
  std::size_t rows = 0;
  for (int e = 0; e < 2; ++e)
    for (Tensor& b : loader) rows += static_cast<std::size_t>(b.numel());
  CHECK(rows == 2 * 64 - 2);
  std::lock_guard lock(mu);
  REQUIRE(seen.size() == 2);
  for (const SampleError& e : seen) CHECK(ds.bad.count({e.epoch, e.index}) == 1);
  CHECK(seen[0].epoch != seen[1].epoch);
}

TEST_CASE("the next epoch made ahead through the pin thread and direct-mode batches", "[loader][ahead][pin]") {
  // Direct mode (a dataset writing rows into pinned blocks) with the pin stage: the same batches
  // with and without the next epoch made ahead, over three epochs.
  Recorded ds;
  auto run = [&](bool ahead) {
    DataLoaderOptions o = ahead_options(ahead);
    o.pin_memory = true;
    PinnedPoolOptions po;
    po.backend = pageable_backend_for_tests();
    o.pinned_pool = std::make_shared<PinnedPool>(po);
    DataLoader loader(Recorded{}, o);
    std::vector<std::vector<std::int64_t>> epochs;
    for (int e = 0; e < 3; ++e) {
      epochs.emplace_back();
      for (Tensor& b : loader) {
        CHECK(b.is_pinned());
        for (std::int64_t r = 0; r < b.numel(); ++r) epochs.back().push_back(b.data<std::int64_t>()[r]);
      }
    }
    return epochs;
  };
  const auto with = run(true), without = run(false);
  CHECK(with == without);
  CHECK(with[0] != with[1]);
}

namespace {
// A batch sampler that logs each plan(): its epoch, whether it ran on the thread that made the
// sampler (the consumer's), and its thread's name; epoch `fail` throws.
struct LoggedPlans final : BatchSampler {
  struct Entry {
    std::uint64_t epoch;
    bool on_consumer;
    std::string thread;
  };
  explicit LoggedPlans(bool ahead) : BatchSampler(std::make_shared<SequentialSampler>(16), 4, false), ahead_(ahead) {}
  bool plans_ahead() const noexcept override { return ahead_; }
  BatchPlan plan(std::uint64_t epoch) const override {
    {
      std::lock_guard lock(mu);
      char name[16] = {};
      pthread_getname_np(pthread_self(), name, sizeof name);
      log.push_back({epoch, std::this_thread::get_id() == consumer, name});
    }
    if (epoch == fail) throw std::runtime_error("no plan for epoch " + std::to_string(epoch));
    return BatchSampler::plan(epoch);
  }
  std::vector<Entry> entries() const {
    std::lock_guard lock(mu);
    return log;
  }
  bool ahead_;
  std::thread::id consumer = std::this_thread::get_id();
  std::uint64_t fail = ~std::uint64_t{0};
  mutable std::mutex mu;
  mutable std::vector<Entry> log;
};

std::size_t batches_of(DataLoader<Recorded>& loader) {
  std::size_t n = 0;
  for (Tensor& b : loader) n += static_cast<std::size_t>(b.numel() > 0);
  return n;
}
}  // namespace

TEST_CASE("without workers to make it, the next epoch's plan is made on a thread of its own while this epoch runs",
          "[loader][epoch_ahead]") {
  for (const bool ahead : {true, false}) {
    INFO((ahead ? "plans_ahead" : "a sampler asked in its turn"));
    auto sampler = std::make_shared<LoggedPlans>(ahead);
    DataLoaderOptions o;
    o.batch_sampler = sampler;
    o.num_workers = 0;
    {
      DataLoader loader(Recorded{}, o);
      CHECK(batches_of(loader) == 4);
      CHECK(batches_of(loader) == 4);
      loader.set_epoch(7);  // the plan made ahead for epoch 2 is dropped
      CHECK(batches_of(loader) == 4);
    }  // the loader joins the thread making epoch 8's plan
    std::vector<std::uint64_t> epochs;
    for (const auto& e : sampler->entries()) {
      epochs.push_back(e.epoch);
      // Epoch 0 (no epoch before it), epoch 7 (set_epoch: not the one planned) and every plan of
      // a sampler asked in its turn: the consumer's.
      INFO("epoch " << e.epoch);
      if (!ahead || e.epoch == 0 || e.epoch == 7) {
        CHECK(e.on_consumer);
      } else {
        CHECK_FALSE(e.on_consumer);
        CHECK(e.thread == "ferry-plan");  // named, not shown as the consumer that made it
      }
    }
    std::sort(epochs.begin(), epochs.end());
    // Once each epoch; ahead, also epoch 2 (dropped) and epoch 8 (after the last).
    if (ahead)
      CHECK(epochs == std::vector<std::uint64_t>{0, 1, 2, 7, 8});
    else
      CHECK(epochs == std::vector<std::uint64_t>{0, 1, 7});
  }
  // A plan made ahead that throws: the error arrives as its epoch begins, as it would unmade.
  auto failing = std::make_shared<LoggedPlans>(true);
  failing->fail = 1;
  DataLoaderOptions o;
  o.batch_sampler = failing;
  DataLoader loader(Recorded{}, o);
  CHECK(batches_of(loader) == 4);
  CHECK_THROWS_WITH(batches_of(loader), Catch::Contains("no plan for epoch 1"));
}

TEST_CASE("persistent workers make nothing ahead for a sampler asked in its epoch's turn", "[loader][ahead]") {
  // A sampler whose order depends on what the loop does between epochs (a user's Python sampler
  // after set_epoch): epoch e's plan is asked for as epoch e begins, and no sample of epoch e is
  // fetched before. The same loader with a sampler that plans ahead does both (the test can fail).
  for (const bool ahead : {false, true}) {
    INFO((ahead ? "plans_ahead" : "a sampler asked in its turn"));
    auto sampler = std::make_shared<LoggedPlans>(ahead);
    Recorded ds;
    ds.n = 16;
    DataLoaderOptions o = ahead_options(true);
    o.batch_sampler = sampler;
    o.batch_size = 1;
    o.shuffle = false;
    DataLoader loader(ds, o);
    for (std::uint64_t e = 0; e < 3; ++e) {
      INFO("epoch " << e);
      CHECK(batches_of(loader) == 4);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // time for anything made ahead to show
      std::set<std::uint64_t> planned;
      for (const auto& entry : sampler->entries()) planned.insert(entry.epoch);
      if (ahead) {
        CHECK(planned.count(e + 1) == 1);
        CHECK(eventually([&] { return ds.log->count(e + 1) > 0; }));
      } else {
        CHECK(*planned.rbegin() == e);  // epochs 0..e, each in its turn
        CHECK(ds.log->count(e + 1) == 0);
      }
    }
  }
}
