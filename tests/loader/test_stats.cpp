// Tests loader.stats() and the trace recorder: stage time is charged where it was spent (lower
// bounds only: a sleep lasts at least its length, whatever the machine's load), the bottleneck is
// named, and a trace holds the traced batches' boxes on the right threads and nothing else.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "ferry/ferry.h"
#include "helpers.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {
struct Ints {
  std::size_t n;
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i) const { return static_cast<std::int64_t>(i); }
};

std::shared_ptr<PinnedPool> test_pool() {
  PinnedPoolOptions o;
  o.backend = pageable_backend_for_tests();
  o.limit_bytes = 1 << 20;
  return std::make_shared<PinnedPool>(o);
}
}  // namespace

TEST_CASE("stats charge a slow transform to the transform stage and name the workers as the bottleneck", "[stats]") {
  auto ds = map(Ints{40}, [](std::int64_t v) {
    std::this_thread::sleep_for(2ms);
    return v;
  });
  DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  DataLoader loader(ds, o);
  std::int64_t sum = 0;
  for (Tensor& b : loader) sum += b.item<std::int64_t>(0);
  CHECK(sum == 0 + 4 + 8 + 12 + 16 + 20 + 24 + 28 + 32 + 36);
  const LoaderStats s = loader.stats();
  CHECK(s.batches == 10);
  CHECK(s.workers == 2);
  CHECK(s.transform_seconds >= 40 * 0.002);  // every sample slept 2 ms in its transform
  CHECK(s.wait_seconds <= s.wall_seconds);
  CHECK(s.wait_seconds > 0);
  CHECK_FALSE(s.pinning);
  CHECK(s.bottleneck() == "workers");  // the consumer did nothing but wait
  CHECK_THAT(s.report(), Catch::Contains("transform") && Catch::Contains("bottleneck: workers"));

  loader.reset_stats();
  CHECK(loader.stats().batches == 0);
  CHECK(loader.stats().transform_seconds == 0);
  for (Tensor& b : loader) (void)b;  // a second epoch counts from the reset
  CHECK(loader.stats().batches == 10);
  CHECK(loader.stats().transform_seconds >= 40 * 0.002);
}

TEST_CASE("stats name the consumer when it is slower than the loader", "[stats]") {
  DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  DataLoader loader(Ints{40}, o);
  for (Tensor& b : loader) {
    (void)b;
    std::this_thread::sleep_for(20ms);  // a training step; the batches are ready long before
  }
  const LoaderStats s = loader.stats();
  CHECK(s.batches == 10);
  INFO(s.report());
  CHECK(s.consumer_busy() > 0.5);
}

TEST_CASE("stats count the pin thread's time when pinning", "[stats][pin]") {
  DataLoaderOptions o;
  o.batch_size = 64;
  o.num_workers = 2;
  o.pin_memory = true;
  o.pin_mode = DataLoaderOptions::PinMode::Copy;
  o.pinned_pool = test_pool();
  DataLoader loader(TensorDataset({Tensor::zeros(DType::Float32, {640, 256})}), o);
  for (auto& b : loader) REQUIRE(b[0].is_pinned());
  const LoaderStats s = loader.stats();
  CHECK(s.pinning);
  CHECK(s.batches == 10);
  CHECK(s.pin_seconds > 0);
  CHECK(s.pin_seconds <= s.wall_seconds);
}

TEST_CASE("a trace holds the first N batches' stages on their threads, as Chrome trace JSON", "[trace]") {
  auto trace = std::make_shared<TraceRecorder>(3);
  auto ds = map(Ints{64}, [](std::int64_t v) { return static_cast<double>(v); });
  DataLoaderOptions o;
  o.batch_size = 8;
  o.num_workers = 2;
  o.pin_memory = true;
  o.pin_mode = DataLoaderOptions::PinMode::Copy;
  o.pinned_pool = test_pool();
  o.trace = trace;
  DataLoader loader(ds, o);
  for (Tensor& b : loader) (void)b;
  std::ostringstream out;
  trace->write_chrome_json(out);
  const nlohmann::json j = nlohmann::json::parse(out.str());
  std::set<std::string> names, threads;
  std::set<std::int64_t> batches;
  std::set<std::pair<int, std::string>> where;  // (track, event name)
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") == "M") {
      if (e.at("name") == "thread_name") threads.insert(e.at("args").at("name").get<std::string>());
      continue;
    }
    CHECK(e.at("ph") == "X");
    CHECK(e.at("dur").get<double>() >= 0);
    batches.insert(e.at("args").at("batch").get<std::int64_t>());
    where.emplace(e.at("tid").get<int>(), e.at("name").get<std::string>());
    if (e.at("name") == "pin (copy)") CHECK(e.at("args").at("block").get<std::string>().size() > 2);
  }
  CHECK(batches == std::set<std::int64_t>{0, 1, 2});
  CHECK(threads.count("worker 0") == 1);
  CHECK(threads.count("pin thread") == 1);
  CHECK(threads.count("consumer") == 1);
  CHECK(threads.count("batches made inline (num_workers = 0)") == 0);  // no empty track: workers made them
  auto on_a_worker = [&](const std::string& name) { return where.count({0, name}) + where.count({1, name}) > 0; };
  CHECK(on_a_worker("fetch"));
  CHECK(on_a_worker("transform"));
  CHECK(on_a_worker("collate"));
  CHECK(where.count({TraceRecorder::kPinTrack, "pin (copy)"}) == 1);
  CHECK(where.count({TraceRecorder::kConsumerTrack, "wait for batch"}) == 1);
  CHECK(where.count({TraceRecorder::kConsumerTrack, "consumer holds batch"}) == 1);
  CHECK(trace->dropped() == 0);
}

TEST_CASE("a trace stops at its event cap and counts what it dropped", "[trace]") {
  TraceRecorder trace(10, 5);
  for (int i = 0; i < 8; ++i) trace.span(0, "x", 0, i, i + 1);
  CHECK(trace.events() == 5);
  CHECK(trace.dropped() == 3);
  CHECK_FALSE(trace.wants(10));
  CHECK(trace.wants(9));
}

TEST_CASE("in direct mode a trace names the pinned block each batch was built in", "[trace][pin]") {
  auto trace = std::make_shared<TraceRecorder>(4);
  DataLoaderOptions o;
  o.batch_size = 16;
  o.num_workers = 2;
  o.pin_memory = true;
  o.pin_mode = DataLoaderOptions::PinMode::Direct;
  o.pinned_pool = test_pool();
  o.trace = trace;
  DataLoader loader(TensorDataset({Tensor::zeros(DType::Float32, {64, 32})}), o);
  std::set<std::string> built_in;
  for (auto& b : loader) {
    char addr[32];
    std::snprintf(addr, sizeof addr, "%p", static_cast<const void*>(b[0].storage().data()));
    built_in.insert(addr);
  }
  std::ostringstream out;
  trace->write_chrome_json(out);
  std::size_t pins = 0;
  const nlohmann::json j = nlohmann::json::parse(out.str());  // named: a range-for over a member of a temporary dangles
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X" || e.at("name") != "pin (already pinned: direct)") continue;
    ++pins;
    CHECK(built_in.count(e.at("args").at("block").get<std::string>()) == 1);
    CHECK(e.at("args").at("bytes") == 0);
  }
  CHECK(pins == 4);
}
