// A downstream program built against an installed ferry with find_package(ferry).
#include <ferry/ferry.h>

#include <cstdio>

int main() {
  ferry::DataLoaderOptions o;
  o.batch_size = 4;
  o.num_workers = 2;
  ferry::DataLoader loader(ferry::TensorDataset({ferry::Tensor::zeros(ferry::DType::Float32, {10, 3})}), o);
  std::size_t rows = 0;
  for (auto& batch : loader) rows += static_cast<std::size_t>(batch[0].size(0));
  std::printf("consumer: %zu rows\n", rows);
  return rows == 10 ? 0 : 1;
}
