// Mixtures of datasets (ferry::Mixture, ferry/loaders/tokens.h), drawn from keyed permutations
// (IndexPermutation, ferry/core/sampler.h); Note [Token positions in O(1)] in sequences.cpp.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "ferry/loaders/tokens.h"

namespace ferry {

// --- mixtures -----------------------------------------------------------------------------------

// Note [Mixture draws]
// Within a phase (weights in force from `start`), position j of block b takes the slot
// IndexPermutation(block)(j); the slots [slot_begin[s], slot_begin[s + 1]) are source s's, so
// block b gives source s its k-th draws for k in [b * counts[s], (b + 1) * counts[s]), in the
// order of the permuted slots: O(1) a sample. Weights changed at an index inside a block leave
// some of that block's k unused; their draws wait in `pending` (sorted) and are the next phase's
// first, and the phase's draw k is pending[k], then next + (k - pending.size()): every draw of a
// source is taken once, in a block or two of where it would have been, whatever the changes.
struct Mixture::Phase {
  std::uint64_t start = 0;                          // the first global index drawn with these weights
  std::vector<std::size_t> counts;                  // a block's samples of each source
  std::vector<std::size_t> slot_begin;              // each source's first slot in a block (prefix sums), then the block size
  std::vector<std::vector<std::uint64_t>> pending;  // each source's draws left by the phase before, sorted
  std::vector<std::uint64_t> next;                  // each source's first draw after the pending ones
  std::vector<std::uint64_t> taken;                 // each source's samples before `start`
  std::uint64_t draw(std::size_t s, std::uint64_t k) const {
    return k < pending[s].size() ? pending[s][k] : next[s] + (k - pending[s].size());
  }
};

namespace {

std::vector<std::size_t> block_counts(const std::vector<double>& w, std::size_t block) {
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  std::vector<std::size_t> counts(w.size());
  std::vector<std::pair<double, std::size_t>> frac;
  std::size_t given = 0;
  for (std::size_t s = 0; s < w.size(); ++s) {
    const double exact = static_cast<double>(block) * (w[s] / sum);
    counts[s] = std::min(block, static_cast<std::size_t>(std::floor(exact)));
    given += counts[s];
    frac.emplace_back(-(exact - std::floor(exact)), s);  // largest remainder first; ties to the lower source
  }
  std::sort(frac.begin(), frac.end());
  for (std::size_t k = 0; given < block && k < frac.size(); ++k, ++given) ++counts[frac[k].second];
  for (std::size_t k = 0; given < block; ++k, ++given)
    ++counts[k % counts.size()];  // rounding left a slot over (never in practice)
  return counts;
}

void check_weights(const std::vector<double>& w, std::size_t sources) {
  if (w.size() != sources)
    throw Error("Mixture: " + std::to_string(w.size()) + " weights for " + std::to_string(sources) +
                " sources (one weight each)");
  double sum = 0;
  for (std::size_t s = 0; s < w.size(); ++s) {
    if (!std::isfinite(w[s]) || w[s] < 0)
      throw Error("Mixture: weight " + std::to_string(s) + " is " + std::to_string(w[s]) + " (finite and >= 0 needed)");
    sum += w[s];
  }
  if (!(sum > 0)) throw Error("Mixture: the weights sum to 0");
}

}  // namespace

Mixture::Phase Mixture::make_phase(const std::vector<double>& weights, std::uint64_t start) const {
  check_weights(weights, sources_.size());
  Phase p;
  p.start = start;
  p.counts = block_counts(weights, options_.block);
  p.slot_begin.assign(1, 0);
  for (std::size_t c : p.counts) p.slot_begin.push_back(p.slot_begin.back() + c);
  return p;
}

std::size_t Mixture::phase_of(std::uint64_t global) const noexcept {
  const auto& phases = *phases_;
  std::size_t k = phases.size() - 1;
  while (k > 0 && phases[k].start > global) --k;
  return k;
}

Mixture::Mixture(std::vector<AnyDataset<std::vector<Tensor>>> sources, std::vector<double> weights, MixtureOptions options)
    : sources_(std::move(sources)), options_(options) {
  if (sources_.empty()) throw Error("Mixture: no sources");
  if (options_.block < 1) throw Error("Mixture: block must be >= 1");
  std::size_t total = 0;
  for (std::size_t s = 0; s < sources_.size(); ++s) {
    source_sizes_.push_back(sources_[s].size());
    if (source_sizes_.back() == 0) throw Error("Mixture: source " + std::to_string(s) + " has no samples");
    total += source_sizes_.back();
  }
  size_ = options_.size.value_or(total);
  Phase p = make_phase(weights, 0);
  p.pending.assign(sources_.size(), {});
  p.next.assign(sources_.size(), 0);
  p.taken.assign(sources_.size(), 0);
  phases_ = std::make_shared<const std::vector<Phase>>(std::vector<Phase>{std::move(p)});
}

namespace {
// The slot that position j of block b (of phase `phase`) takes: a permutation of the block.
std::uint64_t block_slot(std::uint64_t seed, std::size_t phase, std::uint64_t b, std::size_t block, std::uint64_t j) {
  return IndexPermutation(block, mix_seed(seed ^ 0x6d69787475726531ull, phase, b)).at(j);
}
std::size_t slot_source(const std::vector<std::size_t>& slot_begin, std::uint64_t slot) {
  return static_cast<std::size_t>(std::upper_bound(slot_begin.begin(), slot_begin.end(), slot) - slot_begin.begin() - 1);
}
}  // namespace

std::vector<std::uint64_t> Mixture::counts_before(std::uint64_t global) const {
  const std::size_t k = phase_of(global);
  const Phase& p = (*phases_)[k];
  const std::uint64_t r = global - p.start, blocks = r / options_.block, rem = r % options_.block;
  std::vector<std::uint64_t> out(sources_.size());
  for (std::size_t s = 0; s < out.size(); ++s) out[s] = p.taken[s] + blocks * p.counts[s];
  for (std::uint64_t j = 0; j < rem; ++j)
    ++out[slot_source(p.slot_begin, block_slot(options_.seed, k, blocks, options_.block, j))];
  return out;
}

Mixture Mixture::reweighted(std::vector<double> weights, std::uint64_t from) const {
  const auto& phases = *phases_;
  if (from < phases.back().start)
    throw Error("Mixture::reweighted: index " + std::to_string(from) + " is before the last weights' start " +
                std::to_string(phases.back().start));
  // Where `from` falls in the last phase: its draws k below b * counts are taken, and of block b's
  // the slots of positions [0, rem) (Note [Mixture draws]).
  const std::size_t last = phases.size() - 1;
  const Phase& old = phases.back();
  const std::uint64_t r = from - old.start, b = r / options_.block, rem = r % options_.block;
  std::vector<std::vector<bool>> used(sources_.size());
  for (std::size_t s = 0; s < used.size(); ++s) used[s].assign(old.counts[s], false);
  for (std::uint64_t j = 0; j < rem; ++j) {
    const std::uint64_t slot = block_slot(options_.seed, last, b, options_.block, j);
    const std::size_t s = slot_source(old.slot_begin, slot);
    used[s][slot - old.slot_begin[s]] = true;
  }
  Phase p = make_phase(weights, from);
  p.taken = counts_before(from);
  for (std::size_t s = 0; s < sources_.size(); ++s) {
    const std::uint64_t first = b * old.counts[s], end = first + old.counts[s];  // block b's k
    std::vector<std::uint64_t> pending;
    for (std::uint64_t k = first; k < end; ++k)
      if (!used[s][k - first]) pending.push_back(old.draw(s, k));
    for (std::uint64_t k = end; k < old.pending[s].size(); ++k) pending.push_back(old.pending[s][k]);
    std::sort(pending.begin(), pending.end());
    p.pending.push_back(std::move(pending));
    p.next.push_back(old.next[s] + (end > old.pending[s].size() ? end - old.pending[s].size() : 0));
  }
  auto next = phases;
  if (next.back().start == from)
    next.back() = std::move(p);  // new weights at the same index replace the last
  else
    next.push_back(std::move(p));
  Mixture m = *this;
  m.phases_ = std::make_shared<const std::vector<Phase>>(std::move(next));
  return m;
}

Mixture::Pick Mixture::pick(std::uint64_t global) const {
  const std::size_t k = phase_of(global);
  const Phase& p = (*phases_)[k];
  const std::uint64_t r = global - p.start, b = r / options_.block, j = r % options_.block;
  const std::uint64_t slot = block_slot(options_.seed, k, b, options_.block, j);
  Pick out;
  out.source = slot_source(p.slot_begin, slot);
  out.draw = p.draw(out.source, b * p.counts[out.source] + (slot - p.slot_begin[out.source]));
  const std::uint64_t n = source_sizes_[out.source];
  out.sample =
      static_cast<std::size_t>(IndexPermutation(n, mix_seed(options_.seed, out.source + 1, out.draw / n)).at(out.draw % n));
  return out;
}

std::vector<Tensor> Mixture::get(std::size_t index, SampleContext& ctx) const {
  if (index >= size_) throw Error("Mixture: index " + std::to_string(index) + " out of range for " + std::to_string(size_));
  const Pick p = pick(ctx.epoch() * size_ + index);
  // The source's own randomness (random_offset windows, transforms) keyed by its epoch and sample.
  SampleContext sub(p.sample, mix_seed(options_.seed, p.source + 1), p.draw / source_sizes_[p.source], ctx.worker());
  return sources_[p.source].get(p.sample, sub);
}

}  // namespace ferry
