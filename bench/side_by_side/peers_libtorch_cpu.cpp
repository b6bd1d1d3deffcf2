// libtorch's torch::data::make_data_loader on the CPU side-by-side workloads (see peers_cpu.py for
// their definition): the same per-sample work in a custom Dataset, Stack<> collate,
// RandomSampler, batch 256. One warm-up epoch, then the median samples/s of 3. JSON lines out.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>
#include <cstring>
#include <zlib.h>

namespace {

torch::Tensor read_idx(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path);
  std::vector<unsigned char> bytes;
  unsigned char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) bytes.insert(bytes.end(), buf, buf + n);
  gzclose(f);
  const int ndim = bytes[3];
  std::vector<int64_t> dims;
  for (int i = 0; i < ndim; ++i)
    dims.push_back((int64_t(bytes[4 + 4 * i]) << 24) | (bytes[5 + 4 * i] << 16) | (bytes[6 + 4 * i] << 8) | bytes[7 + 4 * i]);
  auto t = torch::empty(dims, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data() + 4 + 4 * ndim, t.numel());
  return t;
}

torch::Tensor read_npy_f32(const std::string& path, int64_t rows, int64_t cols) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  char magic[10];
  f.read(magic, 10);
  const int header = static_cast<unsigned char>(magic[8]) | (static_cast<unsigned char>(magic[9]) << 8);
  f.seekg(10 + header);
  auto t = torch::empty({rows, cols}, torch::kFloat32);
  f.read(static_cast<char*>(t.data_ptr()), t.numel() * 4);
  if (!f) throw std::runtime_error(path + ": short read");
  return t;
}

struct FashionAugmented : torch::data::datasets::Dataset<FashionAugmented> {
  FashionAugmented(torch::Tensor i, torch::Tensor l) : images(std::move(i)), labels(std::move(l)) {}
  torch::data::Example<> get(size_t i) override {
    auto x = images[static_cast<int64_t>(i)];
    if (torch::rand({}).item<float>() < 0.5f) x = torch::flip(x, {1});
    x = (x.to(torch::kFloat32) / 255.0 - 0.2860) / 0.3530;
    return {x.unsqueeze(0), labels[static_cast<int64_t>(i)].to(torch::kInt64)};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(images.size(0)); }
  torch::Tensor images, labels;
};

struct Rows : torch::data::datasets::Dataset<Rows> {
  explicit Rows(torch::Tensor d) : data(std::move(d)) {}
  torch::data::Example<> get(size_t i) override {
    return {data[static_cast<int64_t>(i)], torch::tensor(static_cast<int64_t>(i % 10))};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(data.size(0)); }
  torch::Tensor data;
};

template <class D>
double measure(D dataset, int workers) {
  const auto n = *dataset.size();
  auto loader =
      torch::data::make_data_loader(dataset.map(torch::data::transforms::Stack<>()), torch::data::samplers::RandomSampler(n),
                                    torch::data::DataLoaderOptions().batch_size(256).workers(workers));
  auto epoch = [&] {
    int64_t samples = 0;
    for (auto& b : *loader) samples += b.data.size(0);
    return samples;
  };
  epoch();
  std::vector<double> r;
  for (int k = 0; k < 3; ++k) {
    auto t0 = std::chrono::steady_clock::now();
    const auto s = epoch();
    r.push_back(s / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(r.begin(), r.end());
  return r[1];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string data = argc > 1 ? argv[1] : "/usr/share/datasets/fashion-mnist";
  torch::manual_seed(0);
  torch::set_num_threads(1);  // per-sample ops: intra-op threads would only compete with workers
  auto images = read_idx(data + "/train-images-idx3-ubyte.gz");
  auto labels = read_idx(data + "/train-labels-idx1-ubyte.gz");
  // (B)'s rows: the same .npy file (version 1.0, little-endian float32, C order, 60000 x 784).
  auto rows = read_npy_f32(argc > 2 ? argv[2] : "build/bench-data/rows784.npy", 60000, 784);
  for (int w : {0, 1, 2}) {
    std::printf(
        "{\"peer\": \"libtorch %s make_data_loader\", \"workload\": \"A\", \"workers\": %d, \"samples_per_second\": %.1f}\n",
        TORCH_VERSION, w, measure(FashionAugmented(images, labels), w));
    std::fflush(stdout);
    std::printf(
        "{\"peer\": \"libtorch %s make_data_loader\", \"workload\": \"B\", \"workers\": %d, \"samples_per_second\": %.1f}\n",
        TORCH_VERSION, w, measure(Rows(rows), w));
    std::fflush(stdout);
  }
}
