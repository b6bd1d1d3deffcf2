// Tests that Generator is Philox4x32-10 (a published known answer), deterministic per key, and
// that its derived draws stay in range.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "ferry/core/random.h"

using ferry::Generator;

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vector for a zero key and counter", "[unit][random]") {
  Generator g(0, 0, 0);
  CHECK(g() == 0x6627e8d5u);
  CHECK(g() == 0xe169c58du);
  CHECK(g() == 0xbc57ac4cu);
  CHECK(g() == 0x9b00dbd8u);
}

TEST_CASE("same key, same stream; different keys, different streams", "[unit][random]") {
  Generator a(42, 3, 17), b(42, 3, 17), c(42, 3, 18), d(42, 4, 17), e(43, 3, 17);
  std::vector<std::uint32_t> va, vb, vc, vd, ve;
  for (int i = 0; i < 64; ++i) {
    va.push_back(a());
    vb.push_back(b());
    vc.push_back(c());
    vd.push_back(d());
    ve.push_back(e());
  }
  CHECK(va == vb);
  CHECK(va != vc);
  CHECK(va != vd);
  CHECK(va != ve);
  // Sample indices above 2^32 stay distinct from their low halves.
  Generator hi(1, 0, (std::uint64_t{1} << 32) + 5), lo(1, 0, 5);
  CHECK(hi() != lo());
}

TEST_CASE("randint, uniform and bernoulli stay in range and cover it", "[unit][random]") {
  Generator g(7);
  std::set<std::uint64_t> seen;
  for (int i = 0; i < 2000; ++i) {
    auto k = g.randint(10);
    REQUIRE(k < 10);
    seen.insert(k);
    double u = g.uniform();
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
    float f = g.uniform(2.0f, 3.0f);
    REQUIRE(f >= 2.0f);
    REQUIRE(f <= 3.0f);
  }
  CHECK(seen.size() == 10);
  int heads = 0;
  for (int i = 0; i < 10000; ++i) heads += g.bernoulli(0.25);
  CHECK(heads > 2200);
  CHECK(heads < 2800);
  double sum = 0, sq = 0;
  for (int i = 0; i < 20000; ++i) {
    double x = g.normal();
    sum += x;
    sq += x * x;
  }
  CHECK(std::abs(sum / 20000) < 0.05);
  CHECK(std::abs(sq / 20000 - 1.0) < 0.05);
}

TEST_CASE("Generator works with std::shuffle", "[unit][random]") {
  std::vector<int> v{1, 2, 3, 4, 5, 6, 7, 8};
  Generator g(3);
  std::shuffle(v.begin(), v.end(), g);
  std::sort(v.begin(), v.end());
  CHECK(v == std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(ferry::mix_seed(1, 2) != ferry::mix_seed(2, 1));
}
