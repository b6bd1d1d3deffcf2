// Hands ferry batches to libtorch without a copy, through DLPack: the at::Tensor shares ferry's
// bytes and keeps them alive until libtorch lets go. Built only when libtorch is found
// (Debian: libtorch-dev; a GPU host: the one bundled with PyTorch).
//
//   build/default/examples/dlpack_libtorch
#include <ATen/DLConvertor.h>
#include <torch/torch.h>

#include <cstdio>

#include "ferry/ferry.h"

int main() {
  // 1,000 samples of 8 floats, sample i filled with i.
  ferry::Tensor x = ferry::Tensor::empty(ferry::DType::Float32, {1000, 8});
  for (std::int64_t i = 0; i < 8000; ++i) x.data<float>()[i] = static_cast<float>(i / 8);
  ferry::DataLoaderOptions o;
  o.batch_size = 100;
  o.shuffle = true;
  o.num_workers = 2;
  ferry::DataLoader loader(ferry::TensorDataset({x}), o);

  double total = 0;
  torch::Tensor kept;
  for (std::vector<ferry::Tensor>& batch : loader) {
    const void* ferry_bytes = batch[0].raw();
    torch::Tensor t = at::fromDLPack(ferry::to_dlpack(batch[0]));  // zero-copy
    if (t.data_ptr() != ferry_bytes || t.sizes() != torch::IntArrayRef{100, 8}) {
      std::fprintf(stderr, "not shared: %p vs %p\n", t.data_ptr(), ferry_bytes);
      return 1;
    }
    total += t.sum().item<double>();
    kept = t;  // outlives ferry's batch: the bytes stay alive through DLPack's deleter
  }
  const double expected = 8.0 * 999 * 1000 / 2;
  std::printf("libtorch summed %.0f over the epoch (expected %.0f); the last batch, kept after the loop: %s\n", total, expected,
              kept.sizes() == torch::IntArrayRef{100, 8} ? "intact" : "damaged");
  return total == expected ? 0 : 1;
}
