// What the resume tests and their child program share: a map-style dataset whose samples depend
// on the per-sample generator (a resumed run must draw the same), and the loader they build.
#pragma once

#include <cstdint>

#include "ferry/ferry.h"

namespace ferry::test {

// Sample i: 1000 * i + a draw from its generator (keyed by seed, epoch and i).
struct Noisy {
  std::size_t n;
  std::size_t size() const { return n; }
  std::int64_t get(std::size_t i, SampleContext& ctx) const {
    return static_cast<std::int64_t>(i) * 1000 + static_cast<std::int64_t>(ctx.rng().randint(1000));
  }
};

inline std::size_t id_of(std::int64_t v) { return static_cast<std::size_t>(v / 1000); }

}  // namespace ferry::test
