// The demos' Fashion-MNIST: the training set augmented (horizontal flip) and both sets float32,
// normalized with the dataset's mean and standard deviation (0.2860, 0.3530).
#pragma once

#include <filesystem>
#include <string>

#include "ferry/ferry.h"

namespace demo {

struct FashionMnist {
  ferry::IdxDataset train, test;
};

/// The four IDX files under `dir` (gzip or raw); a missing one is a ferry::Error naming it, then
/// `hint` (what to do about it).
inline FashionMnist load_fashion_mnist(const std::string& dir, const std::string& hint) {
  namespace fs = std::filesystem;
  const auto file = [&](const char* name) {
    const fs::path p = fs::path(dir) / name;
    if (!fs::exists(p)) throw ferry::Error("missing " + p.string() + ": " + hint);
    return p.string();
  };
  ferry::IdxDatasetOptions train_opt, test_opt;
  train_opt.transform.horizontal_flip().to_float().normalize({0.2860f}, {0.3530f});
  test_opt.transform.to_float().normalize({0.2860f}, {0.3530f});
  return {ferry::IdxDataset(file("train-images-idx3-ubyte.gz"), file("train-labels-idx1-ubyte.gz"), train_opt),
          ferry::IdxDataset(file("t10k-images-idx3-ubyte.gz"), file("t10k-labels-idx1-ubyte.gz"), test_opt)};
}

}  // namespace demo
