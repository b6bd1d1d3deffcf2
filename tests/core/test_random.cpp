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

TEST_CASE("fill gives the words operator() gives, on every vector path; bulk draws are randint's", "[unit][random]") {
  using ferry::detail::Simd;
  // fill after 0 to 3 words already taken from a block, for lengths around the 16 blocks it
  // computes at a time; the words after it continue the same stream.
  for (int taken = 0; taken < 4; ++taken)
    for (std::size_t n : {0, 1, 3, 4, 5, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000}) {
      Generator a(99, 5, 12345), b(99, 5, 12345);
      for (int k = 0; k < taken; ++k) REQUIRE(a() == b());
      std::vector<std::uint32_t> bulk(n);
      a.fill(bulk);
      for (std::size_t k = 0; k < n; ++k) REQUIRE(bulk[k] == b());
      for (int k = 0; k < 9; ++k) REQUIRE(a() == b());
    }
  // Every path of the lanes this CPU has, also where the block counter wraps inside them, and
  // against the generator's own blocks where the counter starts where a Generator's does (0).
  const Simd cpu = ferry::detail::cpu_simd();
  std::vector<Simd> paths{Simd::None};
  if (cpu == Simd::Avx2 || cpu == Simd::Avx512) paths.push_back(Simd::Avx2);
  if (cpu == Simd::Avx512) paths.push_back(Simd::Avx512);
  INFO("vector paths checked: " << paths.size());
  for (std::uint64_t seed : {0ull, 7ull, 0xFFFFFFFFFFFFFFFFull}) {
    const std::array<std::uint32_t, 2> key{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
    for (std::uint32_t first : {0u, 1000u, 0xFFFFFFFCu, 0xFFFFFFF6u}) {
      const std::array<std::uint32_t, 4> counter{first, 17, 3, 4};
      std::uint32_t base[4 * ferry::detail::kPhiloxLanes], vec[4 * ferry::detail::kPhiloxLanes];
      ferry::detail::philox_lanes(Simd::None, key, counter, base);
      for (Simd p : paths) {
        ferry::detail::philox_lanes(p, key, counter, vec);
        for (int k = 0; k < 4 * ferry::detail::kPhiloxLanes; ++k) REQUIRE(vec[k] == base[k]);
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

TEST_CASE("draws made side by side are randint's, in order, with the generator's words after them", "[unit][random]") {
  // Bounds fixed and descending (Fisher-Yates'), below and above 2^32, runs across the 512 draws
  // a buffer of words holds, after an odd number of words taken (draws then straddle buffers).
  for (bool descending : {false, true})
    for (std::uint64_t n : {1ull, 2ull, 7ull, 60000ull, 0xFFFFFFFFull, 0x100000000ull, 0x100000001ull, (1ull << 63) + 5})
      for (std::size_t len : {0, 1, 3, 4, 5, 511, 512, 513, 1500})
        for (int odd : {0, 1}) {
          if (descending && n < len) continue;
          Generator a(11, 2, 3), b(11, 2, 3);
          ferry::detail::BulkDraws d(a), e(b);
          if (odd) REQUIRE(d.randint(0x100000000ull) == e.randint(0x100000000ull));  // 2 words: even
          for (int k = 0; k < odd * 3; ++k) REQUIRE(d.randint(5) == e.randint(5));
          std::vector<std::size_t> bulk(len);
          d.randints(n, descending, bulk);
          for (std::size_t k = 0; k < len; ++k) REQUIRE(bulk[k] == e.randint(descending ? n - k : n));
          for (int k = 0; k < 5; ++k) REQUIRE(d.randint(1000) == e.randint(1000));
        }
  // A draw that may need lemire's second look stops the side-by-side run before its group; the
  // words (0, 0) give such a draw (x = 0: the low product 0 is below any n). Words 2k, 2k + 1
  // make draw k.
  using ferry::detail::Simd;
  std::vector<std::uint32_t> words(64);
  Generator g(5, 6, 7);
  g.fill(words);
  for (Simd p : {Simd::None, ferry::detail::cpu_simd()})
    for (std::size_t at : {0, 3, 4, 9, 31}) {
      std::vector<std::uint32_t> w = words;
      w[2 * at] = w[2 * at + 1] = 0;
      std::size_t out[32];
      const std::size_t done = ferry::detail::lemire_run(p, w.data(), 32, 1000, false, out);
      REQUIRE(done <= at);
      REQUIRE(done >= (p == Simd::None ? at : at / 4 * 4));
      for (std::size_t k = 0; k < done; ++k) {
        std::size_t i = 2 * k;
        const std::uint64_t x = (std::uint64_t{w[i]} << 32) | w[i + 1];
        REQUIRE(out[k] == static_cast<std::size_t>((static_cast<__uint128_t>(x) * 1000) >> 64));
      }
    }
}
