// Checkpoint and resume (ferry/core/state.h): a loader restored from a state saved k batches into
// an epoch delivers exactly what an uninterrupted run delivers from there on, for every sampler,
// with any number of workers; at another world size a DistributedSampler's epoch continues with
// every remaining sample delivered once; a state that is not the loader's is a clear error; a
// process killed mid-epoch resumes from its last checkpoint.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <map>

#include "ferry/ferry.h"
#include "helpers.h"
#include "resume_common.h"

using namespace ferry;
using test::Noisy;

namespace {

using Batches = std::vector<std::vector<std::int64_t>>;

std::vector<std::int64_t> values(const Tensor& t) { return {t.data<std::int64_t>(), t.data<std::int64_t>() + t.numel()}; }
std::vector<std::int64_t> values(const std::vector<Tensor>& b) { return values(b[0]); }

// The batches from the loader's current position to the end of epoch `last`.
template <class Loader>
Batches run_to(Loader& loader, std::uint64_t last) {
  Batches out;
  while (loader.next_epoch() <= last)
    for (auto& b : loader) out.push_back(values(b));
  return out;
}

// Receives k batches of the next epoch and returns the state then (the iterator still live).
template <class Loader>
LoaderState state_after(Loader& loader, std::size_t k) {
  auto it = loader.begin();
  for (std::size_t i = 0; i < k; ++i) {
    const bool more = it != loader.end();
    REQUIRE(more);
    (void)*it;
    if (i + 1 < k) ++it;  // the k-th batch stays received: the iterator has not moved past it
  }
  return loader.state();
}

// A batch sampler of uneven batches (1, 2, 3, 1, 2, 3, ...) over a seeded order.
class UnevenBatches final : public BatchSampler {
 public:
  explicit UnevenBatches(std::size_t n) : n_(n) {}
  std::size_t size() const override { return plan(0).size(); }
  BatchPlan plan(std::uint64_t epoch) const override {
    std::vector<std::size_t> order = RandomSampler(n_, 99).indices(epoch);
    BatchPlan p;
    for (std::size_t i = 0, len = 1; i < order.size(); i += len, len = len % 3 + 1)
      p.add(std::span<const std::size_t>(order).subspan(i, std::min(len, order.size() - i)));
    return p;
  }

 private:
  std::size_t n_;
};

struct Config {
  const char* name;
  std::function<void(DataLoaderOptions&)> set;
};

std::vector<Config> configs(std::size_t n) {
  return {
      {"sequential", [](DataLoaderOptions&) {}},
      {"shuffle", [](DataLoaderOptions& o) { o.shuffle = true; }},
      {"shuffle, drop_last",
       [](DataLoaderOptions& o) {
         o.shuffle = true;
         o.drop_last = true;
       }},
      {"random with replacement", [n](DataLoaderOptions& o) { o.sampler = std::make_shared<RandomSampler>(n, 3, true, n + 17); }},
      {"weighted",
       [n](DataLoaderOptions& o) {
         std::vector<double> w(n);
         for (std::size_t i = 0; i < n; ++i) w[i] = 1.0 + static_cast<double>(i % 5);
         o.sampler = std::make_shared<WeightedRandomSampler>(w, n / 2, 4);
       }},
      {"subset",
       [n](DataLoaderOptions& o) {
         std::vector<std::size_t> sub;
         for (std::size_t i = 0; i < n; i += 3) sub.push_back(i);
         o.sampler = std::make_shared<SubsetRandomSampler>(sub, 6);
       }},
      {"distributed, rank 1 of 3",
       [n](DataLoaderOptions& o) { o.sampler = std::make_shared<DistributedSampler>(n, 3, 1, true, 7); }},
      {"a user's batch sampler",
       [n](DataLoaderOptions& o) {
         o.batch_size = 1;  // the batch sampler sizes the batches
         o.batch_sampler = std::make_shared<UnevenBatches>(n);
       }},
  };
}

}  // namespace

TEST_CASE("a restored loader goes on exactly as an uninterrupted one, with any number of workers", "[resume]") {
  const std::size_t n = 157;
  for (const Config& c : configs(n)) {
    DataLoaderOptions base;
    base.batch_size = 8;
    base.seed = 11;
    base.num_workers = 2;
    c.set(base);
    DataLoader reference(Noisy{n}, base);
    const Batches all = run_to(reference, 1);  // epochs 0 and 1
    const std::size_t per_epoch = DataLoader(Noisy{n}, base).size();
    REQUIRE(all.size() == 2 * per_epoch);
    for (std::size_t k : {std::size_t{0}, std::size_t{1}, per_epoch / 2, per_epoch - 1, per_epoch}) {
      DataLoader first(Noisy{n}, base);
      const LoaderState saved = state_after(first, k);
      const std::string text = saved.to_string();
      for (int workers : {0, 1, 3, 8}) {
        INFO(c.name << ": saved after " << k << " of " << per_epoch << " batches, resumed with " << workers << " workers");
        DataLoaderOptions o = base;
        o.num_workers = workers;
        o.prefetch_factor = workers == 3 ? 1 : 4;
        DataLoader resumed(Noisy{n}, o);
        resumed.restore(LoaderState::from_string(text));
        CHECK(resumed.state() == saved);  // a pending restore is where the loader stands
        const Batches rest = run_to(resumed, 1);
        REQUIRE(rest.size() == all.size() - k);
        CHECK(std::equal(rest.begin(), rest.end(), all.begin() + static_cast<std::ptrdiff_t>(k)));
      }
    }
  }
}

TEST_CASE("direct-mode datasets resume too, and a state between epochs starts the next one", "[resume]") {
  Tensor rows = Tensor::empty(DType::Int64, {50, 3});
  for (std::int64_t i = 0; i < rows.numel(); ++i) rows.data<std::int64_t>()[i] = i;
  DataLoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 2;
  o.num_workers = 2;
  DataLoader reference(TensorDataset({rows}), o);
  const Batches all = run_to(reference, 2);
  DataLoader first(TensorDataset({rows}), o);
  CHECK(first.state().epoch == 0);
  CHECK(first.state().batches == 0);
  (void)run_to(first, 0);  // a whole epoch: the state is the next epoch's start
  const LoaderState between = first.state();
  CHECK(between.epoch == 1);
  CHECK(between.batches == 0);
  const LoaderState mid = state_after(first, 5);
  CHECK(mid.epoch == 1);
  CHECK(mid.batches == 5);
  for (const LoaderState& s : {between, mid}) {
    o.num_workers = 3;
    DataLoader resumed(TensorDataset({rows}), o);
    resumed.restore(s);
    const Batches rest = run_to(resumed, 2);
    const std::size_t skip = 13 + s.batches;  // 13 batches an epoch
    REQUIRE(rest.size() == all.size() - skip);
    CHECK(std::equal(rest.begin(), rest.end(), all.begin() + static_cast<std::ptrdiff_t>(skip)));
  }
}

TEST_CASE("a DistributedSampler epoch resumed at another world size delivers every remaining sample once",
          "[resume][distributed]") {
  struct Case {
    std::size_t n, from, to, batch, k;
    bool drop_last;
  };
  for (const Case& c : std::vector<Case>{{1000, 4, 3, 16, 5, false},
                                         {1000, 2, 5, 16, 7, false},
                                         {997, 4, 3, 8, 3, false},
                                         {997, 3, 4, 8, 4, true},
                                         {64, 2, 7, 4, 0, false}}) {
    INFO("n " << c.n << ", world " << c.from << " -> " << c.to << ", " << c.k << " batches of " << c.batch
              << (c.drop_last ? ", drop_last" : ""));
    auto options = [&](std::size_t world, std::size_t rank) {
      DataLoaderOptions o;
      o.batch_size = c.batch;
      o.num_workers = 2;
      o.seed = 21;
      o.drop_last = c.drop_last;
      o.sampler = std::make_shared<DistributedSampler>(c.n, world, rank, true, 21, c.drop_last);
      return o;
    };
    std::map<std::size_t, int> seen;
    std::vector<LoaderState> states;
    for (std::size_t r = 0; r < c.from; ++r) {  // every rank receives k batches, then the job stops
      DataLoader rank(Noisy{c.n}, options(c.from, r));
      auto it = rank.begin();
      for (std::size_t b = 0; b < c.k; ++b, ++it)
        for (std::int64_t v : values(*it)) ++seen[test::id_of(v)];
      states.push_back(rank.state());
    }
    for (const LoaderState& s : states) CHECK(s.position == states[0].position);  // the group's, on every rank
    const std::size_t before = seen.size();
    std::size_t delivered_after = 0;
    for (std::size_t r = 0; r < c.to; ++r) {  // the new group, each rank from rank 0's state
      DataLoader rank(Noisy{c.n}, options(c.to, r));
      rank.restore(states[0]);
      const Batches rest = run_to(rank, 0);
      for (const auto& b : rest)
        for (std::int64_t v : b) {
          ++seen[test::id_of(v)];
          ++delivered_after;
        }
      CHECK(rank.next_epoch() == 1);
    }
    std::size_t once = 0, twice = 0, more = 0;
    for (auto& [id, count] : seen) (count == 1 ? once : count == 2 ? twice : more)++;
    CHECK(more == 0);
    // Every id not taken before is delivered now; the only repeats are padding: the old group's
    // (none here: it stopped before its padding) and the new group's, < its world size.
    const std::size_t remaining = c.n - std::min(c.n, before);
    if (c.drop_last) {
      CHECK(twice == 0);
      CHECK(delivered_after <= remaining);
      // only the remainder's tail that drop_last drops: the sampler's (< world size) and each
      // rank's last partial batch
      CHECK(remaining - delivered_after < c.to * c.batch);
    } else {
      CHECK(seen.size() == c.n);
      CHECK(twice == delivered_after - remaining);
      CHECK(twice < c.to);
    }
    // Saved again mid-way at the new world size and restored there, the rank goes on exactly.
    DataLoader a(Noisy{c.n}, options(c.to, 1));
    a.restore(states[0]);
    DataLoader ref(Noisy{c.n}, options(c.to, 1));
    ref.restore(states[0]);
    const Batches whole = run_to(ref, 0);
    if (whole.size() >= 2) {
      const LoaderState again = state_after(a, 1);
      CHECK(again.segment_start == states[0].position);
      DataLoader b(Noisy{c.n}, options(c.to, 1));
      b.restore(again);
      const Batches rest = run_to(b, 0);
      CHECK(std::equal(rest.begin(), rest.end(), whole.begin() + 1, whole.end()));
    }
  }
}

TEST_CASE("a state that is not the loader's is a clear error", "[resume][errors]") {
  DataLoaderOptions o;
  o.batch_size = 8;
  o.shuffle = true;
  o.seed = 3;
  DataLoader loader(Noisy{100}, o);
  const LoaderState s = state_after(loader, 4);
  {
    auto live = loader.begin();
    CHECK_THROWS_WITH(loader.restore(s), Catch::Contains("an iterator of this loader is live"));
  }
  auto restore_into = [&](DataLoaderOptions other, std::size_t n) {
    DataLoader l(Noisy{n}, other);
    l.restore(s);
  };
  DataLoaderOptions seed = o;
  seed.seed = 4;
  CHECK_THROWS_WITH(restore_into(seed, 100), Catch::Contains("its seed is 3, this loader's is 4"));
  CHECK_THROWS_WITH(restore_into(o, 101), Catch::Contains("its dataset size is 100, this loader's is 101"));
  DataLoaderOptions batch = o;
  batch.batch_size = 9;
  CHECK_THROWS_WITH(restore_into(batch, 100), Catch::Contains("epoch 0's batches differ") && Catch::Contains("batch_size"));
  DataLoaderOptions order = o;
  order.shuffle = false;
  CHECK_THROWS_WITH(restore_into(order, 100), Catch::Contains("batches differ"));
  DataLoaderOptions dist = o;
  dist.shuffle = false;  // the sampler shuffles
  dist.sampler = std::make_shared<DistributedSampler>(100, 2, 0, true, 3);
  CHECK_THROWS_WITH(restore_into(dist, 100), Catch::Contains("has a DistributedSampler"));
  DataLoader d0(Noisy{100}, dist);
  const LoaderState ds = state_after(d0, 2);
  DataLoaderOptions rank1 = dist;
  rank1.sampler = std::make_shared<DistributedSampler>(100, 2, 1, true, 3);
  DataLoader d1(Noisy{100}, rank1);
  // Another rank's state at the same world size: rank 1 goes on with its own share, as from its own.
  d1.restore(ds);
  DataLoader own(Noisy{100}, rank1);
  const LoaderState s1 = state_after(own, 2);
  DataLoader from_own(Noisy{100}, rank1);
  from_own.restore(s1);
  const Batches rest = run_to(d1, 0);
  CHECK(rest.size() == 5);
  CHECK(rest == run_to(from_own, 0));
  DataLoader plain(Noisy{100}, o);
  CHECK_THROWS_WITH(plain.restore(ds), Catch::Contains("saved by a loader with a DistributedSampler"));
  // Streams: a state at an epoch's start only.
  struct Stream {
    struct It {
      std::int64_t i = 0, end = 0;
      std::optional<std::int64_t> next() { return i < end ? std::optional<std::int64_t>(i++) : std::nullopt; }
    };
    It open(const WorkerInfo&) const { return {0, 40}; }
  };
  DataLoaderOptions so;
  so.batch_size = 4;
  so.on_error = OnError::Skip;
  DataLoader stream(Stream{}, so);
  CHECK(stream.state().epoch == 0);
  {
    auto it = stream.begin();
    (void)*it;
    CHECK_THROWS_WITH(stream.state(), Catch::Contains("under on_error = Raise only"));
  }
  DataLoaderOptions unordered;
  unordered.batch_size = 4;
  unordered.num_workers = 2;
  unordered.in_order = false;
  DataLoader loose(Stream{}, unordered);
  auto it = loose.begin();
  (void)*it;
  CHECK_THROWS_WITH(loose.state(), Catch::Contains("out of order"));
  DataLoader fresh_stream(Stream{}, so);
  CHECK_THROWS_WITH(fresh_stream.restore(s), Catch::Contains("the state is a map-style loader's"));
}

namespace {
// A stream of 0..n-1 split over workers (shard_range), each value mapped with its generator; the
// transform counts its calls, so a resume that ran it for skipped records would show.
std::atomic<long> transformed{0};
auto counted_stream(std::size_t n) {
  return test::CountingStream(n).map([](std::int64_t v, SampleContext& ctx) {
    transformed.fetch_add(1);
    return v * 1000 + static_cast<std::int64_t>(ctx.rng().randint(1000));
  });
}
}  // namespace

TEST_CASE("a stream resumes mid-epoch with the same workers: each skips what its batches used, untransformed",
          "[resume][stream]") {
  const std::size_t n = 203;
  for (int workers : {0, 1, 2, 3}) {
    DataLoaderOptions o;
    o.batch_size = 7;
    o.num_workers = workers;
    o.seed = 9;
    DataLoader reference(counted_stream(n), o);
    const Batches all = run_to(reference, 1);
    const std::size_t per_epoch = all.size() / 2;
    for (std::size_t k : {std::size_t{1}, per_epoch / 2, per_epoch - 1, per_epoch}) {
      INFO(workers << " workers, saved after " << k << " of " << per_epoch << " batches");
      DataLoader first(counted_stream(n), o);
      const LoaderState saved = LoaderState::from_string(state_after(first, k).to_string());
      CHECK(saved.stream_workers == static_cast<std::uint64_t>(std::max(workers, 1)));
      DataLoaderOptions again = o;
      again.prefetch_factor = 1;
      DataLoader resumed(counted_stream(n), again);
      resumed.restore(saved);
      transformed = 0;
      const Batches rest = run_to(resumed, 1);
      REQUIRE(rest.size() == all.size() - k);
      CHECK(std::equal(rest.begin(), rest.end(), all.begin() + static_cast<std::ptrdiff_t>(k)));
      std::size_t values = 0;
      for (const auto& b : rest) values += b.size();
      CHECK(static_cast<std::size_t>(transformed.load()) == values);  // skipped records were never transformed
    }
  }
  // The number of streams (workers) and the batch size must match: each worker's stream is its shard.
  DataLoaderOptions o;
  o.batch_size = 7;
  o.num_workers = 2;
  DataLoader first(counted_stream(n), o);
  const LoaderState s = state_after(first, 3);
  DataLoaderOptions three = o;
  three.num_workers = 3;
  DataLoader other(counted_stream(n), three);
  CHECK_THROWS_WITH(other.restore(s), Catch::Contains("number of stream workers") && Catch::Contains("is 2, this loader's is 3"));
  DataLoaderOptions bigger = o;
  bigger.batch_size = 8;
  DataLoader big(counted_stream(n), bigger);
  CHECK_THROWS_WITH(big.restore(s), Catch::Contains("batch size is 7, this loader's is 8"));
  DataLoader noisy(Noisy{n}, o);
  CHECK_THROWS_WITH(noisy.restore(s), Catch::Contains("the state is a stream's"));
}

TEST_CASE("the state's text format: round trip, and damage named", "[resume][errors]") {
  LoaderState s;
  s.seed = 1ull << 63;
  s.epoch = 7;
  s.batches = 3;
  s.batches_per_epoch = 10;
  s.samples_per_epoch = 80;
  s.dataset_size = 80;
  s.plan_hash = 0xfedcba9876543210ull;
  s.world_size = 4;
  s.rank = 3;
  s.segment_start = 12;
  s.position = 40;
  const std::string text = s.to_string();
  CHECK(text.rfind("ferry.LoaderState 1\n", 0) == 0);
  CHECK(LoaderState::from_string(text) == s);
  CHECK(LoaderState::from_string(text + "a_later_field 5\n") == s);  // later versions of format 1 may add fields
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  CHECK_THROWS_WITH(LoaderState::from_string(""), Catch::Contains("empty"));
  CHECK_THROWS_WITH(LoaderState::from_string("{\"epoch\": 3}"), Catch::Contains("not a ferry loader state"));
  CHECK_THROWS_WITH(LoaderState::from_string(text + "garbage\n"), Catch::Contains("expected 'key value', got 'garbage'"));
  CHECK_THROWS_WITH(LoaderState::from_string("PK\x03\x04 zip"), Catch::Contains("not a ferry loader state"));
  CHECK_THROWS_WITH(LoaderState::from_string(replaced("LoaderState 1", "LoaderState 2")), Catch::Contains("format version '2'"));
  CHECK_THROWS_WITH(LoaderState::from_string(replaced("epoch 7\n", "")), Catch::Contains("'epoch' is missing"));
  CHECK_THROWS_WITH(LoaderState::from_string(replaced("epoch 7", "epoch -7")),
                    Catch::Contains("line 3: 'epoch' must be a non-negative integer"));
  CHECK_THROWS_WITH(LoaderState::from_string(replaced("epoch 7", "epoch 99999999999999999999")),
                    Catch::Contains("'epoch' must be"));
  CHECK_THROWS_WITH(LoaderState::from_string(replaced("plan_hash fedcba9876543210", "plan_hash xyz")),
                    Catch::Contains("hexadecimal"));
  CHECK_THROWS_WITH(LoaderState::from_string(text + "seed 5\n"), Catch::Contains("'seed' appears twice"));
  CHECK_THROWS_WITH(LoaderState::from_string(replaced("rank 3", "rank 4")), Catch::Contains("rank 4 is not in [0, 4)"));
  CHECK_THROWS_WITH(LoaderState::from_string(replaced("batches 3", "batches 11")),
                    Catch::Contains("11 batches received of an epoch of 10"));
  CHECK_THROWS_WITH(LoaderState::from_string(std::string(70000, 'x')), Catch::Contains("is not a loader state"));
}

#ifdef FERRY_TEST_RESUME_CHILD
TEST_CASE("a process killed mid-epoch resumes from its last checkpoint and logs what an uninterrupted run logs", "[resume]") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("ferry-resume-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto run = [&](const std::string& name, int kill_after, int workers) {
    const std::string cmd = "exec " + std::string(FERRY_TEST_RESUME_CHILD) + " " + (dir / (name + ".state")).string() + " " +
                            (dir / (name + ".log")).string() + " " + std::to_string(kill_after) + " " + std::to_string(workers);
    return std::system(cmd.c_str());
  };
  const int whole = run("whole", -1, 2);
  REQUIRE(WIFEXITED(whole));
  REQUIRE(WEXITSTATUS(whole) == 0);
  int st = run("killed", 7, 2);  // killed after 7 batches, 6 of them checkpointed
  REQUIRE(WIFSIGNALED(st));
  CHECK(WTERMSIG(st) == SIGKILL);
  st = run("killed", 17, 3);  // resumed with other workers, killed again in the second epoch
  REQUIRE(WIFSIGNALED(st));
  st = run("killed", -1, 0);  // and finished inline
  REQUIRE(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string expected = slurp(dir / "whole.log"), got = slurp(dir / "killed.log");
  CHECK(std::count(expected.begin(), expected.end(), '\n') == 2 * 26);  // two epochs of 26 batches
  CHECK(got == expected);
  std::filesystem::remove_all(dir);
}
#endif

namespace {
// A training loop that takes k batches and breaks: the state just before the break (the iterator
// still live); the loop's end then destroys the iterator.
template <class Loader>
LoaderState state_at_break(Loader& loader, std::size_t k) {
  LoaderState live;
  std::size_t taken = 0;
  for (auto& b : loader) {
    (void)b;
    if (++taken == k) {
      live = loader.state();
      break;
    }
  }
  return live;
}
}  // namespace

TEST_CASE("after a break, state() is where the epoch stopped until the next begin()", "[resume]") {
  // A training loop that breaks at batch 5 and checkpoints: the state used to say "epoch 1, batch
  // 0" once the iterator was gone, so a resume skipped the rest of epoch 0.
  const std::size_t n = 157;
  for (int workers : {0, 2}) {
    INFO(workers << " workers");
    DataLoaderOptions o;
    o.batch_size = 8;
    o.shuffle = true;
    o.seed = 5;
    o.num_workers = workers;
    DataLoader reference(Noisy{n}, o);
    const Batches all = run_to(reference, 0);
    DataLoader loader(Noisy{n}, o);
    const LoaderState live = state_at_break(loader, 5);
    const LoaderState after = loader.state();
    CHECK(after == live);
    CHECK(after.epoch == 0);
    CHECK(after.batches == 5);
    DataLoader resumed(Noisy{n}, o);
    resumed.restore(after);
    const Batches rest = run_to(resumed, 0);
    REQUIRE(rest.size() == all.size() - 5);
    CHECK(std::equal(rest.begin(), rest.end(), all.begin() + 5));
    // The next begin() starts the next epoch, as before; set_epoch() moves the state too.
    { auto it = loader.begin(); }
    CHECK(loader.state().epoch == 1);  // epoch 1 was begun and left before its first batch was taken
    CHECK(loader.state().batches == 0);
    loader.set_epoch(4);
    CHECK(loader.state().epoch == 4);
    CHECK(loader.state().batches == 0);
  }
  // A stream keeps its position the same way.
  DataLoaderOptions o;
  o.batch_size = 7;
  o.num_workers = 2;
  DataLoader stream(counted_stream(n), o);
  const LoaderState live = state_at_break(stream, 3);
  CHECK(stream.state() == live);
  CHECK(stream.state().batches == 3);
}

// Note [Lazy plans]: an epoch of 2^40 samples (a pretraining corpus' windows) starts, resumes and
// replaces a bad sample without a plan of every index (8 TiB here: an eager plan cannot be made).
TEST_CASE("an epoch of 2^40 samples starts, resumes mid-epoch and replaces a sample, planned lazily", "[resume]") {
  struct Huge {  // sample i is i; sample 3 of any batch that holds an index ending in 7 fails
    std::size_t size() const { return std::size_t{1} << 40; }
    std::vector<Tensor> get(std::size_t i) const {
      if (i % 1000 == 7) throw DataError("huge", DataError::kNoOffset, "sample " + std::to_string(i) + " is bad");
      return {Tensor::scalar<std::int64_t>(static_cast<std::int64_t>(i))};
    }
  };
  for (bool shuffle : {false, true}) {
    INFO((shuffle ? "shuffled" : "in order"));
    DataLoaderOptions o;
    o.batch_size = 64;
    o.shuffle = shuffle;
    o.seed = 5;
    o.num_workers = 2;
    o.on_error = OnError::Replace;
    o.max_error_fraction = 0;
    DataLoader reference(DynamicDataset(Huge{}), o);
    CHECK(reference.size() == (std::size_t{1} << 40) / 64);
    Batches first;
    LoaderState saved;
    {
      auto it = reference.begin();
      for (int k = 0; k < 40; ++k, ++it) {
        first.push_back(values(*it));
        if (k == 19) saved = reference.state();
      }
    }
    for (const auto& b : first)
      for (std::int64_t v : b) CHECK(v % 1000 != 7);  // replaced, by another sample of the epoch
    if (!shuffle) CHECK(first[0][1] == 1);
    for (int workers : {0, 3}) {
      DataLoaderOptions r = o;
      r.num_workers = workers;
      DataLoader resumed(DynamicDataset(Huge{}), r);
      resumed.restore(LoaderState::from_string(saved.to_string()));
      auto it = resumed.begin();
      for (int k = 20; k < 40; ++k, ++it) CHECK(values(*it) == first[static_cast<std::size_t>(k)]);
    }
  }
}
