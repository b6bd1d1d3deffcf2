// train_ddp: the demo's MLP trained data-parallel on Fashion-MNIST, one process per GPU.
//
//   torchrun --standalone --nproc-per-node 2 --no-python build/examples/ddp/train_ddp --data DIR
//   mpirun -np 2 build/examples/ddp/train_ddp --data DIR        (srun works the same way)
//
// Each rank reads its place from the launcher (ferry::DistributedEnv), loads its share of every
// epoch onto GPU local_rank (env.loader_options: a DistributedSampler and device = local_rank),
// and trains the model on the stream its batches arrive on. Between each batch's gradients and
// the update, NCCL averages the gradients across ranks on that same stream, so every rank takes
// the same step (the global batch is batch-size x world size). Test accuracy: each rank evaluates
// its share of the test set; the sums are all-reduced.
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "ferry/ferry.h"
#include "data.h"
#include "mlp.h"
#include "rendezvous.h"

namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct Reduce {
  ncclComm_t comm;
  cudaStream_t stream;
};

// The model's gradient hook: average the four gradient arrays over the ranks, in stream order.
void average_gradients(void* ctx, float* const grads[4], const long long sizes[4]) {
  auto* r = static_cast<Reduce*>(ctx);
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  for (int i = 0; i < 4; ++i)
    nccl_check(ncclAllReduce(grads[i], grads[i], static_cast<std::size_t>(sizes[i]), ncclFloat, ncclAvg, r->comm, r->stream),
               "ncclAllReduce");
  nccl_check(ncclGroupEnd(), "ncclGroupEnd");
}

// Sums three numbers over the ranks (host values; synchronizes).
void sum_over_ranks(double v[3], ncclComm_t comm, cudaStream_t stream, double* dev) {
  cuda_check(cudaMemcpyAsync(dev, v, 3 * sizeof(double), cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  nccl_check(ncclAllReduce(dev, dev, 3, ncclDouble, ncclSum, comm, stream), "ncclAllReduce");
  cuda_check(cudaMemcpyAsync(v, dev, 3 * sizeof(double), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Data-parallel training of an MLP on Fashion-MNIST: one process per GPU, fed by ferry, gradients averaged by NCCL"};
  std::string data = "/usr/share/datasets/fashion-mnist";
  int epochs = 3, workers = 4, hidden = 256;
  std::size_t batch_size = 128;
  float lr = 0.05f;
  std::uint64_t seed = 1;
  double min_accuracy = 0;
  app.add_option("--data", data, "folder with the four IDX files");
  app.add_option("--epochs", epochs)->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "samples per batch on each rank")->check(CLI::PositiveNumber);
  app.add_option("--workers", workers, "loader workers per rank")->check(CLI::NonNegativeNumber);
  app.add_option("--hidden", hidden)->check(CLI::PositiveNumber);
  app.add_option("--lr", lr)->check(CLI::PositiveNumber);
  app.add_option("--seed", seed);
  app.add_option("--min-accuracy", min_accuracy, "exit 1 unless the final test accuracy reaches this (0..1)");
  CLI11_PARSE(app, argc, argv);

  int rank = 0;
  try {
    const ferry::DistributedEnv env = ferry::DistributedEnv::from_environment();
    rank = static_cast<int>(env.rank);
    const int world = static_cast<int>(env.world_size);
    const int device = static_cast<int>(env.local_rank);
    if (!ferry::cuda::available() || device >= ferry::cuda::device_count())
      throw ferry::Error(env.str() + ": needs CUDA device " + std::to_string(device) + ", and this host has " +
                         std::to_string(ferry::cuda::device_count()));
    cuda_check(cudaSetDevice(device), "cudaSetDevice");

    ncclUniqueId id{};
    if (rank == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    ddp::exchange(&id, sizeof id, rank, world);
    ncclComm_t comm = nullptr;
    nccl_check(ncclCommInitRank(&comm, world, id, rank), "ncclCommInitRank");

    auto [train, test] = demo::load_fashion_mnist(data, "pass --data");

    ferry::DataLoaderOptions o;
    o.batch_size = batch_size;
    o.shuffle = true;
    o.seed = seed;
    o.num_workers = workers;
    o.persistent_workers = workers > 0;
    ferry::DataLoader loader(train, env.loader_options(train.size(), o));  // this rank's share, on GPU local_rank
    ferry::DataLoaderOptions eo = o;
    eo.shuffle = false;
    eo.batch_size = 1000;
    eo.consumer_stream = loader.stream()->native();
    ferry::DataLoader test_loader(test, env.loader_options(test.size(), eo));  // (padded to equal shares when uneven)

    cudaStream_t stream = static_cast<cudaStream_t>(loader.stream()->native());
    Reduce reduce{comm, stream};
    demo::MlpConfig mc;
    mc.hidden = hidden;
    mc.lr = lr;
    mc.seed = seed;  // every rank starts from the same weights
    auto model = demo::make_gpu_mlp(mc, device, stream, {world > 1 ? &average_gradients : nullptr, &reduce});
    double* sums = nullptr;
    cuda_check(cudaMalloc(&sums, 3 * sizeof(double)), "cudaMalloc");
    if (rank == 0)
      std::printf("train_ddp: %d ranks (%s), MLP %d-%d-10, batch %zu per rank (%zu global), %d workers per rank\n", world,
                  env.launcher_name(), mc.in, mc.hidden, batch_size, batch_size * static_cast<std::size_t>(world), workers);
    std::fflush(stdout);

    double accuracy = 0;
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      const auto t0 = std::chrono::steady_clock::now();
      for (ferry::LabeledBatch& b : loader) model->train_step(b.image, b.label);
      const demo::Metrics tm = model->take();  // synchronizes
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double t[3] = {tm.loss, static_cast<double>(tm.samples), seconds};
      sum_over_ranks(t, comm, stream, sums);
      for (ferry::LabeledBatch& b : test_loader) model->evaluate(b.image, b.label);
      const demo::Metrics em = model->take();
      double e[3] = {em.loss, static_cast<double>(em.correct), static_cast<double>(em.samples)};
      sum_over_ranks(e, comm, stream, sums);
      accuracy = e[1] / e[2];
      if (rank == 0)
        std::printf("epoch %d/%d  train loss %.4f  test loss %.4f  test acc %.1f%%  %.0f img/s over %d GPUs\n", epoch, epochs,
                    t[0] / t[1], e[0] / e[2], 100 * accuracy, t[1] / (t[2] / world), world);
      std::fflush(stdout);
    }
    const ferry::LoaderStats s = loader.stats();
    std::printf("rank %d: %s, cuda:%d, %.1f batches/s, waiting for batches %.1f%% of the loop (next()), NUMA node %d\n", rank,
                env.str().c_str(), device, s.batches_per_second(), 100.0 * s.wait_seconds / std::max(s.wall_seconds, 1e-9),
                s.numa_node);
    cudaFree(sums);
    model.reset();
    ncclCommDestroy(comm);
    if (min_accuracy > 0 && accuracy < min_accuracy) {
      if (rank == 0) std::fprintf(stderr, "test accuracy %.3f below --min-accuracy %.3f\n", accuracy, min_accuracy);
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_ddp (rank %d): %s\n", rank, e.what());
    return 1;
  }
}
