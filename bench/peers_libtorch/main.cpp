// libtorch's torch::data::make_data_loader on bench_pin's workloads: in-memory samples, Stack<>
// collate, RandomSampler, batch 256, best of several `workers`; each batch .to(cuda, non_blocking)
// (libtorch's loader has no pinning, so the copy is from pageable memory). Median of 3 timed
// passes after one warm-up pass, the device synchronized at the end of each pass.
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {
struct InMemory : torch::data::datasets::Dataset<InMemory> {
  explicit InMemory(torch::Tensor d) : data(std::move(d)) {}
  torch::data::Example<> get(size_t i) override { return {data[static_cast<int64_t>(i)], torch::zeros({}, torch::kInt64)}; }
  torch::optional<size_t> size() const override { return static_cast<size_t>(data.size(0)); }
  torch::Tensor data;
};

double run(torch::Tensor data, int workers, int batches) {
  auto ds = InMemory(data).map(torch::data::transforms::Stack<>());
  auto loader = torch::data::make_data_loader(std::move(ds), torch::data::samplers::RandomSampler(data.size(0)),
                                              torch::data::DataLoaderOptions().batch_size(256).workers(workers));
  // Whole epochs only: libtorch refuses a new iterator while one is unfinished (no early break).
  auto pass = [&] {
    int n = 0;
    while (n < batches)
      for (auto& b : *loader) {
        auto x = b.data.to(torch::kCUDA, /*non_blocking=*/true);
        ++n;
      }
    torch::cuda::synchronize();
    return n;
  };
  pass();
  std::vector<double> r;
  for (int k = 0; k < 3; ++k) {
    auto t0 = std::chrono::steady_clock::now();
    const int n = pass();
    r.push_back(n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(r.begin(), r.end());
  return r[1];
}
}  // namespace

int main() {
  std::printf("# peers_libtorch — libtorch %s, median of 3 passes\n", TORCH_VERSION);
  struct W {
    const char* name;
    torch::Tensor data;
    int batches;
  };
  std::vector<W> ws{{"(a) 3x224x224 uint8", torch::randint(0, 255, {2048, 3, 224, 224}, torch::kUInt8), 200},
                    {"(b) 784 float32", torch::rand({60000, 784}), 2000}};
  for (auto& w : ws) {
    const double mb = w.data[0].numel() * w.data.element_size() * 256 / 1e6;
    std::printf(
        "\n## %s: batch 256 = %.2f MB, %d batches per pass\n\n| pipeline | workers | batches/s | GB/s |\n|---|---:|---:|---:|\n",
        w.name, mb, w.batches);
    for (int workers : {6, 8, 12}) {
      const double r = run(w.data, workers, w.batches);
      std::printf("| libtorch make_data_loader (no pinning) | %d | %.0f | %.1f |\n", workers, r, r * mb / 1e3);
      std::fflush(stdout);
    }
  }
  return 0;
}
