// The pin stage's groups (PinGroup: what the device gather uses to issue several small batches in
// one launch) and Engine::ready, on the CPU, so that the sanitizers see them: batches pinned in
// groups arrive in order and complete, each group is flushed before any of its batches is handed
// over, a flush that throws fails exactly its group's batches, and ready() tells whether next()
// would wait on a worker.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "ferry/core/sampler.h"
#include "ferry/detail/engine.h"
#include "ferry/detail/pin_stage.h"

using namespace ferry;
using namespace ferry::detail;
using namespace std::chrono_literals;

namespace {

// Each batch's payload is its batch number. Batch `gated` waits until `open` is set.
struct Numbered : Producer {
  std::int64_t gated = -1;
  std::atomic<bool> open{false};
  void init_worker(const WorkerInfo&) override {}
  Payload produce(const Job& job, JobContext& ctx) override {
    while (job.batch == gated && !open.load() && !ctx.cancelled()) std::this_thread::sleep_for(1ms);
    if (ctx.cancelled()) return {};
    return Payload::make(static_cast<std::int64_t>(job.batch));
  }
};

std::shared_ptr<const BatchPlan> plan(std::size_t batches) {
  auto p = std::make_shared<BatchPlan>();
  const std::vector<std::size_t> one{0};
  for (std::size_t b = 0; b < batches; ++b) p->add(one);
  return p;
}

}  // namespace

TEST_CASE("pin stage: batches pinned in groups arrive in order, each group flushed before it is handed over", "[pin_stage]") {
  for (int workers : {0, 3}) {
    INFO("num_workers " << workers);
    Numbered producer;
    EngineOptions eo;
    eo.num_workers = workers;
    eo.prefetch_factor = 4;
    Engine engine(eo, producer);
    // pin() marks its batch held (negated); the flush restores the group's batches and records
    // its size. Both run on the pin thread (no assertion there: Catch is not thread-safe); what
    // they saw is checked after stop() joins it.
    std::vector<std::int64_t*> held;
    std::vector<std::size_t> groups;
    std::size_t misnumbered = 0;
    PinStage stage(
        engine,
        [&](Payload& p, std::int64_t batch) {
          misnumbered += p.get<std::int64_t>() != batch;
          p.get<std::int64_t>() = -1 - batch;
          held.push_back(&p.get<std::int64_t>());
        },
        4, 0ms, nullptr, nullptr, PinGroup{4, [&] {
                                             for (std::int64_t* v : held) *v = -1 - *v;
                                             groups.push_back(held.size());
                                             held.clear();
                                           }});
    engine.begin_epoch(0, plan(500));
    stage.start();
    std::int64_t expect = 0;
    while (Payload p = stage.next()) {
      REQUIRE(p.get<std::int64_t>() == expect);  // never a held (negative) batch, never out of order
      ++expect;
    }
    stage.stop();
    engine.end_epoch();
    CHECK(expect == 500);
    CHECK(misnumbered == 0);
    std::size_t total = 0, grouped = 0;
    for (std::size_t g : groups) {
      CHECK(g <= 4);
      total += g;
      grouped += g > 1;
    }
    CHECK(total == 500);
    if (workers == 0) CHECK(grouped > 0);  // with no workers the next batches are always at hand
  }
}

TEST_CASE("pin stage: a flush that throws fails its group's batches, and the epoch goes on", "[pin_stage]") {
  Numbered producer;
  Engine engine(EngineOptions{}, producer);
  int flushes = 0;
  std::size_t in_group = 0, failed_group = 0;
  PinStage stage(
      engine, [&](Payload&, std::int64_t) { ++in_group; }, 4, 0ms, nullptr, nullptr,
      PinGroup{4, [&] {
                 const std::size_t n = std::exchange(in_group, 0);
                 if (++flushes == 3) {
                   failed_group = n;
                   throw std::runtime_error("the held launch failed");
                 }
               }});
  engine.begin_epoch(0, plan(40));
  stage.start();
  std::size_t delivered = 0, failed = 0;
  for (;;) {
    try {
      Payload p = stage.next();
      if (!p) break;
      ++delivered;
    } catch (const std::exception& e) {
      CHECK_THAT(e.what(), Catch::Contains("the held launch failed"));
      ++failed;
    }
  }
  stage.stop();
  engine.end_epoch();
  CHECK(failed == failed_group);
  CHECK(failed >= 1);
  CHECK(delivered + failed == 40);
}

TEST_CASE("engine: ready() says whether next() would wait on a worker", "[engine]") {
  {  // no workers: next() makes the batch itself
    Numbered producer;
    Engine engine(EngineOptions{}, producer);
    engine.begin_epoch(0, plan(2));
    CHECK(engine.ready());
    CHECK(engine.next());
    CHECK(engine.next());
    CHECK(engine.ready());
    CHECK_FALSE(engine.next());
    engine.end_epoch();
  }
  Numbered producer;
  producer.gated = 1;
  EngineOptions eo;
  eo.num_workers = 2;
  Engine engine(eo, producer);
  engine.begin_epoch(0, plan(2));
  Payload first = engine.next();
  REQUIRE(first);
  CHECK(first.get<std::int64_t>() == 0);
  CHECK_FALSE(engine.ready());  // batch 1 waits for the gate
  producer.open = true;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!engine.ready() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  CHECK(engine.ready());
  Payload second = engine.next();
  REQUIRE(second);
  CHECK(second.get<std::int64_t>() == 1);
  CHECK(engine.ready());  // the epoch has no batch left: next() returns at once
  CHECK_FALSE(engine.next());
  engine.end_epoch();
}
