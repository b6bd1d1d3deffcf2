// Tests that Generator is Philox4x32-10 (a published known answer), deterministic per key, and
// that its derived draws stay in range.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <vector>
#include <set>

#include "ferry/core/random.h"
#include "random_bulk.h"

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

TEST_CASE("fill gives the words operator() gives, with AVX2 and without; bulk draws are randint's", "[unit][random]") {
  // fill after 0 to 3 words already taken from a block, for lengths around the 8 blocks it
  // computes at a time; the words after it continue the same stream.
  for (int taken = 0; taken < 4; ++taken)
    for (std::size_t n : {0, 1, 3, 4, 5, 31, 32, 33, 63, 64, 65, 1000}) {
      Generator a(99, 5, 12345), b(99, 5, 12345);
      for (int k = 0; k < taken; ++k) REQUIRE(a() == b());
      std::vector<std::uint32_t> bulk(n);
      a.fill(bulk);
      for (std::size_t k = 0; k < n; ++k) REQUIRE(bulk[k] == b());
      for (int k = 0; k < 9; ++k) REQUIRE(a() == b());
    }
  // Both paths of the lanes, also where the block counter wraps inside them, and against the
  // generator's own blocks where the counter starts where a Generator's does (0).
  for (std::uint64_t seed : {0ull, 7ull, 0xFFFFFFFFFFFFFFFFull}) {
    const std::array<std::uint32_t, 2> key{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
    for (std::uint32_t first : {0u, 1000u, 0xFFFFFFFCu}) {
      const std::array<std::uint32_t, 4> counter{first, 17, 3, 4};
      std::uint32_t base[4 * ferry::detail::kPhiloxLanes], avx2[4 * ferry::detail::kPhiloxLanes];
      ferry::detail::philox_lanes(false, key, counter, base);
      if (ferry::detail::philox_avx2()) {
        ferry::detail::philox_lanes(true, key, counter, avx2);
        for (int k = 0; k < 4 * ferry::detail::kPhiloxLanes; ++k) REQUIRE(avx2[k] == base[k]);
      }
      if (first == 0) {  // Generator(seed, stream 3 + 4 << 32, substream 17) starts at this counter
        Generator g(seed, 3 + (std::uint64_t{4} << 32), 17);
        for (int k = 0; k < 4 * ferry::detail::kPhiloxLanes; ++k) REQUIRE(base[k] == g());
      }
    }
  }
  // Draws from words computed ahead are randint's draws, rejections included (n near 2^64).
  for (std::uint64_t n : {1ull, 10ull, 60000ull, (1ull << 63) + 5, 0xFFFFFFFFFFFFFFF0ull}) {
    Generator a(3, 1, 2), b(3, 1, 2);
    ferry::detail::BulkDraws d(a);
    for (int k = 0; k < 3000; ++k) REQUIRE(d.randint(n) == b.randint(n));
  }
}
