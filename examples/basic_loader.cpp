// The first demo: an in-memory dataset of (image, label) samples through ferry's loader with
// workers, a seeded shuffle and a per-sample random transform, printing what it delivered.
#include <cstdio>

#include "ferry/ferry.h"

int main() {
  constexpr std::int64_t kSamples = 1000, kFeatures = 28 * 28;
  // Sample i is filled with the value i % 251 and labelled i % 10, so every batch can be checked.
  ferry::Tensor images = ferry::Tensor::empty(ferry::DType::UInt8, {kSamples, kFeatures});
  ferry::Tensor labels = ferry::Tensor::empty(ferry::DType::Int64, {kSamples});
  for (std::int64_t i = 0; i < kSamples; ++i) {
    std::fill_n(images.data<std::uint8_t>() + i * kFeatures, kFeatures, static_cast<std::uint8_t>(i % 251));
    labels.data<std::int64_t>()[i] = i % 10;
  }

  struct Sample {
    ferry::Tensor image;
    std::int64_t label;
    bool flipped;
  };
  auto dataset = ferry::TensorDataset({images, labels}).map([](std::vector<ferry::Tensor> s, ferry::SampleContext& ctx) {
    return Sample{s[0], s[1].item<std::int64_t>(), ctx.rng().bernoulli(0.5)};
  });
  using Batch = std::tuple<ferry::Tensor, ferry::Tensor, ferry::Tensor>;
  ferry::DataLoaderOptions options;
  options.batch_size = 128;
  options.shuffle = true;
  options.num_workers = 2;
  options.seed = 42;
  ferry::DataLoader loader(std::move(dataset), options, [](std::vector<Sample>&& samples) {
    std::vector<std::tuple<ferry::Tensor, std::int64_t, bool>> rows;
    for (auto& s : samples) rows.emplace_back(s.image, s.label, s.flipped);
    auto b = ferry::collate(rows);
    return Batch{std::get<0>(b), std::get<1>(b), std::get<2>(b)};
  });

  std::printf("ferry demo: %lld samples, batch_size %zu, %d workers, %zu batches per epoch\n", static_cast<long long>(kSamples),
              options.batch_size, options.num_workers, loader.size());
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::size_t batches = 0, samples = 0, flipped = 0, mismatched = 0;
    for (Batch& batch : loader) {
      auto& [x, y, f] = batch;
      for (std::int64_t r = 0; r < x.size(0); ++r) {
        const std::uint8_t pixel = x.data<std::uint8_t>()[r * kFeatures];
        // pixel = i % 251 and label = i % 10 come from the same i: check they still agree.
        bool ok = false;
        for (std::int64_t i = pixel; i < kSamples; i += 251) ok |= (i % 10 == y.data<std::int64_t>()[r]);
        mismatched += !ok;
        flipped += f.data<bool>()[r];
      }
      if (batches == 0)
        std::printf("  epoch %d, first batch: images %s, labels %s, first labels %lld %lld %lld\n", epoch, x.str().c_str(),
                    y.str().c_str(), static_cast<long long>(y.item<std::int64_t>(0)),
                    static_cast<long long>(y.item<std::int64_t>(1)), static_cast<long long>(y.item<std::int64_t>(2)));
      ++batches;
      samples += static_cast<std::size_t>(x.size(0));
    }
    std::printf("  epoch %d: %zu batches, %zu samples, %zu flipped by the seeded transform, %zu image/label mismatches\n", epoch,
                batches, samples, flipped, mismatched);
    if (mismatched) return 1;
  }
  return 0;
}
