// Tests that the reorder window releases results strictly in key order whatever the arrival
// order, and refuses keys outside its window or delivered twice.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>

#include "ferry/core/random.h"
#include "reorder.h"

using ferry::detail::ReorderWindow;

TEST_CASE("results arriving in any order come out in key order", "[unit][ordering]") {
  constexpr std::size_t kWindow = 8, kTotal = 1000;
  ReorderWindow<int> w(kWindow);
  ferry::Generator g(5);
  std::vector<int> out;
  std::vector<std::uint64_t> pending;
  std::uint64_t next_dispatch = 0;
  while (out.size() < kTotal) {
    // Dispatch as the window allows, then deliver one pending key at random.
    while (next_dispatch < kTotal && next_dispatch < w.next() + kWindow) pending.push_back(next_dispatch++);
    if (!pending.empty()) {
      auto pick = g.randint(pending.size());
      w.put(pending[pick], static_cast<int>(pending[pick]));
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(pick));
    }
    while (w.ready()) out.push_back(w.take());
  }
  std::vector<int> expect(kTotal);
  std::iota(expect.begin(), expect.end(), 0);
  CHECK(out == expect);
  CHECK(w.held() == 0);
}

TEST_CASE("keys outside the window or repeated are logic errors", "[unit][ordering][errors]") {
  ReorderWindow<int> w(4);
  CHECK_THROWS_WITH(w.put(4, 0), Catch::Contains("key 4 outside [0, 4)"));
  w.put(1, 1);
  CHECK_THROWS_WITH(w.put(1, 1), Catch::Contains("delivered twice"));
  CHECK_FALSE(w.ready());
  w.skip();  // key 0 will never come
  CHECK(w.ready());
  CHECK(w.take() == 1);
  CHECK(w.next() == 2);
}
