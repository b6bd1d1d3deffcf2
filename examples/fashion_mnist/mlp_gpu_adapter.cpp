// demo::Mlp over the CUDA model of mlp_gpu.cu (built only with nvcc).
#include "mlp.h"
#include "mlp_gpu.h"

namespace demo {
namespace {

class GpuMlp final : public Mlp {
 public:
  GpuMlp(const MlpConfig& c, int device, void* stream, GradientReducer reduce) : c_(c) {
    const Weights w = initial_weights(c);
    try {
      m_ = gpu::create({c.in, c.hidden, c.classes, c.lr, c.momentum, device, stream, reduce.fn, reduce.ctx}, w.w1.data(),
                       w.b1.data(), w.w2.data(), w.b2.data());
    } catch (const std::exception& e) {
      throw ferry::CudaError(std::string("demo MLP: ") + e.what());
    }
  }
  ~GpuMlp() override { gpu::destroy(m_); }
  void train_step(const ferry::Tensor& x, const ferry::Tensor& y) override { step(x, y, true); }
  void evaluate(const ferry::Tensor& x, const ferry::Tensor& y) override { step(x, y, false); }
  Metrics take() override {
    Metrics m;
    long long correct = 0, samples = 0;
    gpu::take(m_, &m.loss, &correct, &samples);
    m.correct = correct;
    m.samples = samples;
    return m;
  }
  const char* where() const override { return "GPU (cuBLAS)"; }
  Checkpoint save() override {
    const Weights shape = initial_weights(c_);
    Checkpoint c{shape, shape};
    float* const arrays[8] = {c.w.w1.data(), c.w.b1.data(), c.w.w2.data(), c.w.b2.data(),
                              c.v.w1.data(), c.v.b1.data(), c.v.w2.data(), c.v.b2.data()};
    wrap([&] { gpu::save(m_, arrays); });
    return c;
  }
  void load(const Checkpoint& c) override {
    const float* const arrays[8] = {c.w.w1.data(), c.w.b1.data(), c.w.w2.data(), c.w.b2.data(),
                                    c.v.w1.data(), c.v.b1.data(), c.v.w2.data(), c.v.b2.data()};
    wrap([&] { gpu::load(m_, arrays); });
  }

 private:
  void step(const ferry::Tensor& images, const ferry::Tensor& labels, bool learn) {
    if (images.device().kind != ferry::MemoryKind::Device || labels.device().kind != ferry::MemoryKind::Device)
      throw ferry::Error("demo MLP (GPU): the batch is not on the device: " + images.str());
    if (images.dtype() != ferry::DType::Float32 || images.numel() != images.size(0) * c_.in)
      throw ferry::Error("demo MLP: expected float32 images of " + std::to_string(c_.in) + " values, got " + images.str());
    if (labels.dtype() != ferry::DType::Int64 || labels.numel() != images.size(0))
      throw ferry::Error("demo MLP: expected int64 labels, one per image, got " + labels.str());
    gpu::step(m_, static_cast<const float*>(images.raw()), static_cast<const long long*>(labels.raw()),
              static_cast<int>(images.size(0)), learn);
  }
  template <class Fn>
  static void wrap(Fn&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      throw ferry::CudaError(std::string("demo MLP: ") + e.what());
    }
  }
  MlpConfig c_;
  gpu::Model* m_ = nullptr;
};

}  // namespace

std::unique_ptr<Mlp> make_gpu_mlp(const MlpConfig& config, int device, void* stream, GradientReducer reduce) {
  return std::make_unique<GpuMlp>(config, device, stream, reduce);
}

}  // namespace demo
