// A custom batch type that takes part in pinning by implementing its own pin_memory(), as a
// PyTorch batch class with a pin_memory() method does. The loader's pin thread calls it twice
// (once to measure, once to copy: every ctx.pin() lands in one pinned block per batch); with
// `device = 0` the device stage calls it again to move each tensor to the GPU in one copy.
// Fields that are not tensors (the note below) simply ride along.
//
//   build/default/examples/custom_batch          # pinned + on the GPU when there is one
#include <cstdio>
#include <string>

#include "ferry/ferry.h"

namespace {

// Token sequences of varying length, padded per batch: the kind of batch default collate cannot
// build, with a mask tensor and a note.
struct Padded {
  ferry::Tensor tokens;   // [B, longest] int32, 0-padded
  ferry::Tensor lengths;  // [B] int64
  std::string note;       // not a tensor: untouched by pinning

  void pin_memory(ferry::PinContext& ctx) {
    tokens = ctx.pin(tokens);
    lengths = ctx.pin(lengths);
  }
};

// Sequence i has length 1 + i % 17, and token k of it is i * 100 + k.
struct Sequences {
  std::size_t size() const { return 4096; }
  std::vector<std::int32_t> get(std::size_t i) const {
    std::vector<std::int32_t> s(1 + i % 17);
    for (std::size_t k = 0; k < s.size(); ++k) s[k] = static_cast<std::int32_t>(i * 100 + k);
    return s;
  }
};

Padded pad(std::vector<std::vector<std::int32_t>>&& rows) {
  std::size_t longest = 0;
  for (const auto& r : rows) longest = std::max(longest, r.size());
  const auto B = static_cast<std::int64_t>(rows.size()), L = static_cast<std::int64_t>(longest);
  Padded b{ferry::Tensor::zeros(ferry::DType::Int32, {B, L}), ferry::Tensor::empty(ferry::DType::Int64, {B}),
           "padded to " + std::to_string(longest)};
  for (std::int64_t r = 0; r < B; ++r) {
    std::copy(rows[r].begin(), rows[r].end(), b.tokens.data<std::int32_t>() + r * L);
    b.lengths.data<std::int64_t>()[r] = static_cast<std::int64_t>(rows[r].size());
  }
  return b;
}

}  // namespace

int main() {
  ferry::DataLoaderOptions o;
  o.batch_size = 64;
  o.shuffle = true;
  o.num_workers = 2;
  o.pin_memory = true;  // pageable, with one warning, without CUDA
  const bool gpu = ferry::cuda::available();
  if (gpu) o.device = 0;
  ferry::DataLoader loader(Sequences{}, o, pad);
  std::size_t batches = 0, checked = 0;
  for (Padded& b : loader) {
    ferry::Tensor tokens = b.tokens, lengths = b.lengths;
    if (gpu) {  // bring it back to check it: to_host's result synchronizes before it can be read
      tokens = ferry::to_host(b.tokens, *loader.stream()).get();
      lengths = ferry::to_host(b.lengths, *loader.stream()).get();
    }
    // Every row must be its own sequence: token k of the row for sample i is i * 100 + k.
    for (std::int64_t r = 0; r < tokens.size(0); ++r) {
      const std::int32_t first = tokens.data<std::int32_t>()[r * tokens.size(1)];
      const std::int64_t i = first / 100, n = lengths.data<std::int64_t>()[r];
      if (n != 1 + i % 17) {
        std::fprintf(stderr, "row %lld: length %lld, expected %lld\n", static_cast<long long>(r), static_cast<long long>(n),
                     static_cast<long long>(1 + i % 17));
        return 1;
      }
      for (std::int64_t k = 0; k < n; ++k)
        if (tokens.data<std::int32_t>()[r * tokens.size(1) + k] != i * 100 + k) return 1;
      ++checked;
    }
    if (batches++ == 0)
      std::printf("first batch: tokens %s on %s, lengths on %s, note '%s'\n", b.tokens.str().c_str(),
                  b.tokens.device().str().c_str(), b.lengths.device().str().c_str(), b.note.c_str());
  }
  std::printf("%zu batches, %zu sequences checked%s\n", batches, checked,
              gpu ? " after their trip to the GPU" : (loader.pinned() ? " (pinned)" : " (no CUDA: pageable)"));
  return checked == 4096 ? 0 : 1;
}
