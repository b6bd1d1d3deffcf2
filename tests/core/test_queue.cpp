// Tests that the stage queue delivers everything pushed before close, that close() is sticky and
// wakes every blocked consumer, and that pop_for times out.
#include <catch2/catch.hpp>

#include <latch>
#include <set>
#include <thread>
#include <vector>

#include "queue.h"

using ferry::detail::StageQueue;

TEMPLATE_TEST_CASE("StageQueue delivers each item once across producers and consumers", "[unit][queue]", int,
                   std::unique_ptr<int>) {
  StageQueue<TestType> q;
  constexpr int kProducers = 3, kPerProducer = 2000, kConsumers = 3;
  std::vector<std::thread> threads;
  std::vector<std::vector<int>> got(kConsumers);
  std::latch produced(kProducers);
  for (int p = 0; p < kProducers; ++p)
    threads.emplace_back([&, p] {
      for (int i = 0; i < kPerProducer; ++i) {
        if constexpr (std::is_same_v<TestType, int>)
          q.push(p * kPerProducer + i);
        else
          q.push(std::make_unique<int>(p * kPerProducer + i));
      }
      produced.count_down();
    });
  std::atomic<int> received{0};
  for (int c = 0; c < kConsumers; ++c)
    threads.emplace_back([&, c] {
      while (auto item = q.pop()) {
        if constexpr (std::is_same_v<TestType, int>)
          got[c].push_back(*item);
        else
          got[c].push_back(**item);
        if (received.fetch_add(1) + 1 == kProducers * kPerProducer) q.close();
      }
    });
  for (auto& t : threads) t.join();
  std::set<int> all;
  for (auto& g : got)
    for (int v : g) CHECK(all.insert(v).second);
  CHECK(all.size() == static_cast<std::size_t>(kProducers * kPerProducer));
}

TEST_CASE("close() wakes every blocked consumer and stays closed", "[unit][queue][shutdown]") {
  StageQueue<int> q;
  constexpr int kWaiters = 4;
  std::latch started(kWaiters);
  std::atomic<int> woke{0}, got_item{0};  // Catch2 assertions are not thread-safe: count instead
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i)
    waiters.emplace_back([&] {
      started.count_down();
      if (q.pop().has_value()) got_item.fetch_add(1);
      woke.fetch_add(1);
    });
  started.wait();
  q.close();
  for (auto& t : waiters) t.join();
  CHECK(woke == kWaiters);
  CHECK(got_item == 0);
  CHECK(q.closed());
  CHECK_FALSE(q.push(5));
  CHECK_FALSE(q.pop().has_value());  // sticky: later pops return at once too
  auto [item, timed_out] = q.pop_for(std::chrono::milliseconds(1));
  CHECK_FALSE(item.has_value());
  CHECK_FALSE(timed_out);
}

TEST_CASE("pop_for reports a timeout on an empty open queue", "[unit][queue]") {
  StageQueue<int> q;
  auto [item, timed_out] = q.pop_for(std::chrono::milliseconds(5));
  CHECK_FALSE(item.has_value());
  CHECK(timed_out);
  q.push(3);
  auto [item2, timed_out2] = q.pop_for(std::chrono::milliseconds(5));
  REQUIRE(item2.has_value());
  CHECK(*item2 == 3);
  CHECK_FALSE(timed_out2);
}

TEST_CASE("try_pop takes what is queued and reports an empty or closed queue", "[unit][queue]") {
  StageQueue<int> q;
  auto [none, empty] = q.try_pop();
  CHECK_FALSE(none.has_value());
  CHECK(empty);
  q.push(4);
  q.push(5);
  auto [a, a_empty] = q.try_pop();
  REQUIRE(a.has_value());
  CHECK(*a == 4);
  CHECK_FALSE(a_empty);
  q.close();
  auto [b, b_empty] = q.try_pop();  // closed: what was queued is dropped, as pop() drops it
  CHECK_FALSE(b.has_value());
  CHECK_FALSE(b_empty);
  auto [c, c_empty] = q.try_pop();  // sticky
  CHECK_FALSE(c.has_value());
  CHECK_FALSE(c_empty);
}
