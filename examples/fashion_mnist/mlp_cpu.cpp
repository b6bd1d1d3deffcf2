// The demo's model on the CPU: row-major matrices, loops whose inner dimension is contiguous (so
// the compiler vectorizes them), batch rows and weight rows split over a ferry::ParallelFor.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "mlp.h"

namespace demo {

Weights initial_weights(const MlpConfig& c) {
  std::mt19937_64 rng(c.seed);
  auto uniform = [&](std::vector<float>& w, std::size_t n, int fan_in) {
    const float bound = std::sqrt(6.0f / static_cast<float>(fan_in));
    std::uniform_real_distribution<float> d(-bound, bound);
    w.resize(n);
    for (float& v : w) v = d(rng);
  };
  Weights w;
  uniform(w.w1, static_cast<std::size_t>(c.in) * c.hidden, c.in);
  uniform(w.w2, static_cast<std::size_t>(c.hidden) * c.classes, c.hidden);
  w.b1.assign(static_cast<std::size_t>(c.hidden), 0.0f);
  w.b2.assign(static_cast<std::size_t>(c.classes), 0.0f);
  return w;
}

namespace {

constexpr char kMagic[] = "ferry-demo-mlp 1\n";

void put(std::ofstream& out, const std::vector<float>& v) {
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
}

}  // namespace

void write_checkpoint(const std::string& path, const Checkpoint& c, const MlpConfig& m) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << kMagic << m.in << " " << m.hidden << " " << m.classes << "\n";
    for (const Weights* w : {&c.w, &c.v}) put(out, w->w1), put(out, w->b1), put(out, w->w2), put(out, w->b2);
    if (!out) throw ferry::Error("cannot write the checkpoint " + tmp);
  }
  std::filesystem::rename(tmp, path);  // a crash mid-write leaves the previous checkpoint whole
}

Checkpoint read_checkpoint(const std::string& path, const MlpConfig& m) {
  std::ifstream in(path, std::ios::binary);
  std::string magic(sizeof kMagic - 1, '\0');
  int dims[3] = {};
  if (!in.read(magic.data(), static_cast<std::streamsize>(magic.size())) || magic != kMagic ||
      !(in >> dims[0] >> dims[1] >> dims[2]) || in.get() != '\n')
    throw ferry::Error(path + ": not a checkpoint of the demo's MLP");
  if (dims[0] != m.in || dims[1] != m.hidden || dims[2] != m.classes)
    throw ferry::Error(path + ": a checkpoint of a " + std::to_string(dims[0]) + "-" + std::to_string(dims[1]) + "-" +
                       std::to_string(dims[2]) + " MLP, not " + std::to_string(m.in) + "-" + std::to_string(m.hidden) + "-" +
                       std::to_string(m.classes));
  const Weights shape = initial_weights(m);
  Checkpoint c{shape, shape};
  for (Weights* w : {&c.w, &c.v})
    for (std::vector<float>* v : {&w->w1, &w->b1, &w->w2, &w->b2})
      if (!in.read(reinterpret_cast<char*>(v->data()), static_cast<std::streamsize>(v->size() * sizeof(float))))
        throw ferry::Error(path + ": the checkpoint is cut short");
  return c;
}

namespace {

class CpuMlp final : public Mlp {
 public:
  CpuMlp(const MlpConfig& c, int threads) : c_(c), w_(initial_weights(c)), pool_(std::max(threads, 1)) {
    v_.w1.assign(w_.w1.size(), 0.0f);
    v_.b1.assign(w_.b1.size(), 0.0f);
    v_.w2.assign(w_.w2.size(), 0.0f);
    v_.b2.assign(w_.b2.size(), 0.0f);
  }

  void train_step(const ferry::Tensor& x, const ferry::Tensor& y) override { step(x, y, true); }
  void evaluate(const ferry::Tensor& x, const ferry::Tensor& y) override { step(x, y, false); }
  Metrics take() override { return std::exchange(m_, Metrics{}); }
  const char* where() const override { return "CPU"; }
  Checkpoint save() override { return {w_, v_}; }
  void load(const Checkpoint& c) override {
    w_ = c.w;
    v_ = c.v;
  }

 private:
  void step(const ferry::Tensor& images, const ferry::Tensor& labels, bool learn) {
    const int B = static_cast<int>(images.size(0)), I = c_.in, H = c_.hidden, K = c_.classes;
    if (images.numel() != static_cast<std::int64_t>(B) * I || images.dtype() != ferry::DType::Float32)
      throw ferry::Error("demo MLP: expected float32 images of " + std::to_string(I) + " values, got " + images.str());
    const float* x = images.data<float>();
    const std::int64_t* y = labels.data<std::int64_t>();
    h_.assign(static_cast<std::size_t>(B) * H, 0.0f);
    dlogits_.assign(static_cast<std::size_t>(B) * K, 0.0f);
    // Forward, and the softmax cross-entropy gradient (scaled by 1/B), row by row.
    std::vector<double> loss(static_cast<std::size_t>(B));
    std::vector<char> correct(static_cast<std::size_t>(B));
    pool_.run(
        static_cast<std::size_t>(B),
        [&](std::size_t begin, std::size_t end) {
          std::vector<float> logits(static_cast<std::size_t>(K));
          for (std::size_t b = begin; b < end; ++b) {
            float* h = &h_[b * H];
            std::copy(w_.b1.begin(), w_.b1.end(), h);
            for (int i = 0; i < I; ++i) {
              const float xi = x[b * I + i];
              const float* w = &w_.w1[static_cast<std::size_t>(i) * H];
              for (int j = 0; j < H; ++j) h[j] += xi * w[j];
            }
            for (int j = 0; j < H; ++j) h[j] = std::max(h[j], 0.0f);
            std::copy(w_.b2.begin(), w_.b2.end(), logits.begin());
            for (int j = 0; j < H; ++j) {
              const float* w = &w_.w2[static_cast<std::size_t>(j) * K];
              for (int k = 0; k < K; ++k) logits[k] += h[j] * w[k];
            }
            const float top = *std::max_element(logits.begin(), logits.end());
            double sum = 0;
            for (int k = 0; k < K; ++k) sum += std::exp(static_cast<double>(logits[k] - top));
            const auto label = static_cast<int>(y[b]);
            if (label < 0 || label >= K) throw ferry::Error("demo MLP: label " + std::to_string(label) + " out of range");
            loss[b] = std::log(sum) - (logits[label] - top);
            correct[b] = std::max_element(logits.begin(), logits.end()) - logits.begin() == label;
            for (int k = 0; k < K; ++k)
              dlogits_[b * K + k] = static_cast<float>((std::exp(static_cast<double>(logits[k] - top)) / sum - (k == label)) / B);
          }
        },
        8);
    for (int b = 0; b < B; ++b) {
      m_.loss += loss[b];
      m_.correct += correct[b];
    }
    m_.samples += B;
    if (!learn) return;
    // Backward: dW2 = h^T dlogits, db2, dh = dlogits W2^T masked by ReLU, dW1 = x^T dh, db1.
    gw2_.assign(w_.w2.size(), 0.0f);
    gb2_.assign(w_.b2.size(), 0.0f);
    dh_.assign(h_.size(), 0.0f);
    for (int b = 0; b < B; ++b) {
      for (int j = 0; j < H; ++j) {
        const float hj = h_[static_cast<std::size_t>(b) * H + j];
        float* g = &gw2_[static_cast<std::size_t>(j) * K];
        const float* w = &w_.w2[static_cast<std::size_t>(j) * K];
        float d = 0;
        for (int k = 0; k < K; ++k) {
          g[k] += hj * dlogits_[static_cast<std::size_t>(b) * K + k];
          d += dlogits_[static_cast<std::size_t>(b) * K + k] * w[k];
        }
        dh_[static_cast<std::size_t>(b) * H + j] = hj > 0 ? d : 0.0f;
      }
      for (int k = 0; k < K; ++k) gb2_[k] += dlogits_[static_cast<std::size_t>(b) * K + k];
    }
    gw1_.assign(w_.w1.size(), 0.0f);
    pool_.run(
        static_cast<std::size_t>(I),
        [&](std::size_t begin, std::size_t end) {
          for (int b = 0; b < B; ++b) {
            const float* dh = &dh_[static_cast<std::size_t>(b) * H];
            for (std::size_t i = begin; i < end; ++i) {
              const float xi = x[static_cast<std::size_t>(b) * I + i];
              float* g = &gw1_[i * H];
              for (int j = 0; j < H; ++j) g[j] += xi * dh[j];
            }
          }
        },
        16);
    gb1_.assign(w_.b1.size(), 0.0f);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < H; ++j) gb1_[j] += dh_[static_cast<std::size_t>(b) * H + j];
    update(w_.w1, v_.w1, gw1_);
    update(w_.b1, v_.b1, gb1_);
    update(w_.w2, v_.w2, gw2_);
    update(w_.b2, v_.b2, gb2_);
  }

  void update(std::vector<float>& w, std::vector<float>& v, const std::vector<float>& g) const {
    for (std::size_t i = 0; i < w.size(); ++i) {
      v[i] = c_.momentum * v[i] + g[i];
      w[i] -= c_.lr * v[i];
    }
  }

  MlpConfig c_;
  Weights w_, v_;
  ferry::ParallelFor pool_;
  Metrics m_;
  std::vector<float> h_, dh_, dlogits_, gw1_, gb1_, gw2_, gb2_;
};

}  // namespace

std::unique_ptr<Mlp> make_cpu_mlp(const MlpConfig& config, int threads) { return std::make_unique<CpuMlp>(config, threads); }

}  // namespace demo
