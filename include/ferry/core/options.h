// ferry/core/options.h — DataLoaderOptions: the loader's options, named and defaulted as
// torch.utils.data.DataLoader's (ferry/core/dataloader.h has the loader and what each stage does).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ferry/core/allocator.h"
#include "ferry/core/dataset.h"
#include "ferry/core/faults.h"
#include "ferry/core/rows.h"
#include "ferry/core/sampler.h"
#include "ferry/core/trace.h"

namespace ferry {

class PinnedPool;  // ferry/pinning/pool.h

/// Loader options, named and defaulted as torch.utils.data.DataLoader's.
struct DataLoaderOptions {
  /// Samples per batch (a stream's last batch may be smaller unless drop_last).
  std::size_t batch_size = 1;
  /// A seeded RandomSampler (seed, epoch); excludes `sampler`.
  bool shuffle = false;
  /// Custom index order; excludes shuffle and batch_sampler.
  std::shared_ptr<const Sampler> sampler;
  /// Custom batches; excludes batch_size != 1, shuffle, sampler and drop_last.
  std::shared_ptr<const BatchSampler> batch_sampler;
  /// Worker threads; 0 produces batches on the consumer thread (on the pin thread when pinning;
  /// on a helper thread while the consumer runs `wait_poll`, so an interruption ends its wait).
  /// The device gather starts none (`gather`): its pin thread writes each batch's indices.
  int num_workers = 0;
  /// Drop the epoch's last batch when it is smaller than batch_size.
  bool drop_last = false;
  /// Longest a batch may take in a worker while the consumer waits for data; 0: no limit. A worker
  /// stuck longer is abandoned and replaced (see "Timeouts" in ferry/core/dataloader.h). With
  /// num_workers = 0 there is no worker to abandon and it does not apply (as in PyTorch). The
  /// stages after the workers get twice as long: the pin thread (with GPU decode, the first batch's
  /// includes nvJPEG's start there, which can take most of a second) and a GPU decode's nvJPEG call.
  std::chrono::milliseconds timeout{0};
  /// What a damaged or stuck sample costs: its batch (Raise), itself (Skip: the batch comes one
  /// row short) or nothing (Replace: another sample of the epoch takes its row, by a rule of
  /// (seed, epoch, index)). A stream filled across workers spends each batch's records under both
  /// Skip and Replace: a bad record leaves its row out, and a batch whose records all fail is left
  /// out (Note [One batcher across workers]). See ferry/core/faults.h.
  OnError on_error = OnError::Raise;
  /// Skip/Replace: more than this many bad samples in one epoch fail the batch at hand and every
  /// later one that meets another; 0: no count limit.
  std::size_t max_errors = 0;
  /// Skip/Replace: the same as a fraction of the epoch's samples (map-style, or a stream with a
  /// size()); 0: no limit.
  double max_error_fraction = 0.1;
  /// Retries of a transient I/O error (IoError::transient()) before it counts, with a backoff of
  /// io_retry_backoff, doubling each time.
  int io_retries = 3;
  /// The first retry's wait (then 2x, 4x, ...).
  std::chrono::milliseconds io_retry_backoff{10};
  /// Called for every skipped or replaced sample, on the worker thread that met it, one call at a
  /// time. May throw: that fails the batch.
  std::function<void(const SampleError&)> on_sample_error;
  /// Called once on each worker thread as it starts (each epoch, unless persistent_workers).
  std::function<void(const WorkerInfo&)> worker_init_fn;
  /// Keys the shuffle order and every sample's Generator; the default 0 is reproducible, not random.
  std::uint64_t seed = 0;
  /// Batches in flight per worker.
  int prefetch_factor = 2;
  /// Keep the workers (and worker_init_fn's effects) across epochs. Needs num_workers > 0.
  bool persistent_workers = false;
  /// With persistent_workers (map-style or a stream that fills batches across workers, in order,
  /// num_workers > 0, no timeout): once all of an epoch's batches are handed to the workers (for
  /// a stream: once its end is known), they go on with the next epoch's first batches (those the
  /// prefetch window has room for), so the next epoch starts without waiting for its first batch
  /// and no worker idles through the epoch's last round. The next epoch is the one begin() would
  /// start next (set_epoch() before the current epoch ends picks another); its plan comes from the
  /// sampler's plan(epoch) ahead of time (only for a sampler whose plans_ahead() is true: one
  /// asked in its epoch's turn gets no work ahead), and work made for an epoch that does not follow
  /// (set_epoch, restore) is dropped. A sample error met ahead is reported then, and counts
  /// toward its own epoch. Where the workers cannot (none, or not persistent), the next epoch's
  /// plan alone is made ahead, on a thread of its own while this epoch runs, for a sampler whose
  /// plans_ahead() is true. A stream of tar shards over s3:// (TarShards) asks for each worker's
  /// first shard of the next epoch as the worker's last shard is read, with or without persistent
  /// workers (WorkerInfo::next_epoch_ahead).
  bool prefetch_next_epoch = true;
  /// Deliver in sampler order (true) or as batches complete (false).
  bool in_order = true;
  /// Map-style: batch b of an epoch is made by worker b mod num_workers, as PyTorch's DataLoader
  /// assigns them, so that what a worker keeps of its own (a random generator seeded once, a
  /// cache) meets the same batches on every run. Off (the default), any free worker takes the
  /// next batch, which balances slow samples. The Python package turns it on for Python datasets
  /// (their transforms draw from each worker's seeded global generators). On, each batch taken
  /// sends the next job at once, as PyTorch's index queue refills (off, jobs go out in bursts).
  bool round_robin = false;
  /// Deliver batches in pinned (page-locked) memory: a pin thread copies each batch, in order,
  /// into a block of a bounded, recycled pinned pool. Without a CUDA device this logs one warning
  /// and delivers pageable batches.
  bool pin_memory = false;
  /// How batches reach pinned memory: Direct (collate and get_into write straight into pinned
  /// blocks; the pin thread has nothing to copy) or Copy (workers collate into recycled pageable
  /// buffers and the pin thread copies each batch with pin_threads threads). A custom collate_fn
  /// that allocates its own tensors is copied in either mode.
  enum class PinMode { Copy, Direct };
  /// Direct by default (see PinMode).
  PinMode pin_mode = PinMode::Direct;
  /// Hard budget of the pinned pool, in bytes; producers wait when it is reached. Unset, the budget
  /// starts at kDefaultPinnedMemoryLimit and grows once, at the first batch, to hold every batch
  /// the pipeline may keep alive at once (prefetch_factor x num_workers, pin_depth,
  /// device_prefetch and the consumer's), within half the machine's memory; the growth is logged
  /// at info level. Set, it is never exceeded: a pipeline that cannot fit is an Error naming the
  /// numbers. A loader without pinning keeps its batches' host buffers for reuse up to this many
  /// bytes (a retention cap: past it buffers are freed, never waited for); unset, that cap grows
  /// the same way, from the first batch on, to every batch the workers and the consumer may hold.
  std::optional<std::size_t> pinned_memory_limit;
  static constexpr std::size_t kDefaultPinnedMemoryLimit = std::size_t{2} << 30;
  /// Threads that copy one large batch into pinned memory (one thread's memcpy is ~12 GB/s).
  int pin_threads = 4;
  /// Batches the pin thread may run ahead of the consumer. The device gather runs small batches
  /// deeper than pin_depth + device_prefetch: up to 24 batches, or 32 MiB of them, in flight.
  int pin_depth = 2;
  /// Use this pool instead of creating one (share it across loaders, or inject one in tests).
  std::shared_ptr<PinnedPool> pinned_pool;
  /// Deliver batches on CUDA device N: each pinned batch is copied with cudaMemcpyAsync on a side
  /// stream and the consumer's stream waits on the copy's event (implies pin_memory). Without a
  /// usable device, constructing the loader throws CudaError.
  std::optional<int> device;
  /// Device batches whose copies are issued ahead of the one being consumed (>= 1). With GPU
  /// decode the pin thread issues them, and runs pin_depth + device_prefetch batches ahead.
  int device_prefetch = 2;
  /// One cudaMemcpyAsync per batch when its tensors lie in one pinned slab.
  bool device_pack = true;
  /// With `device`: how batches of row datasets (TensorDataset, NpyDataset, IdxDataset without a transform, any RowGatherDataset)
  /// are made. Auto and Device: the GPU gathers each batch's rows straight from the registered host
  /// arrays, with no worker copy or pinned staging, the pin thread writing each batch's indices
  /// (no worker starts, whatever num_workers says; Note [Device gather] in
  /// ferry/pinning/gather.h); Auto falls back to the host path where that cannot apply and says
  /// why once (a warning), Device throws an Error saying why. Host: always the host path.
  Gather gather = Gather::Auto;
  /// Host memory the device gather may page-lock for a dataset's arrays; a dataset larger than
  /// this takes the host path (Auto) or is an Error (Device).
  std::size_t register_memory_limit = std::size_t{64} << 30;
  /// With `device`, on a host of more than one NUMA node: run the workers, pin thread and their
  /// helper threads on the device's node and allocate the pinned pool there (Note [NUMA
  /// placement] in ferry/detail/numa.h). Changes nothing on a one-node host. LoaderStats::numa_node
  /// says where the loader sits.
  bool numa_placement = true;
  /// The consumer's compute stream (a cudaStream_t, borrowed); null: the loader creates one,
  /// available as loader.stream().
  void* consumer_stream = nullptr;
  /// With `device`: run the device stage's stream (copies, GPU decode, the device gather) at the
  /// device's highest stream priority, so that when it shares the GPU with a training step its
  /// kernels are scheduled ahead of the step's waiting blocks rather than after the step's kernels
  /// end. Off by default: with GPU decode beside a step that fills the GPU it changed nothing
  /// measurable (bench/RESULTS.md, "GPU JPEG decode"; bench_gpu_decode --loop-only compares both):
  /// nvJPEG runs its kernels on streams of its own, which this priority does not reach (see
  /// gpu_decode_threads).
  bool high_priority_copies = false;
  /// With `device` and GPU decode (ImageFolderOptions::decode = Gpu, TarImages): threads that
  /// issue the batches' decodes, each with its own nvJPEG state, stream and decode scratch (GPU
  /// memory for one batch's decoded images), so that this many batches decode at once. nvJPEG's
  /// hardware backend holds the thread that calls it for the whole decode (Note [Decode threads]
  /// in pinning/gpu_decode.cu), and that thread is a busy CPU core meanwhile. 0 (the default):
  /// chosen from the hardware at the first decode: 2 where nvJPEG finds JPEG engines on the GPU
  /// (A100, H100, H200: its hardware backend) and the machine has 8 CPUs or more, else 1
  /// (LoaderStats::decode_threads says which). A second thread adds about half of what one
  /// decodes, for about a busy core more (bench/RESULTS.md, "GPU JPEG decode", has the figures by
  /// GPU). Beside a step, set CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before CUDA
  /// starts: at CUDA's default of 8, nvJPEG's kernels wait behind the step's (a warning says so).
  /// Known issue: two decode threads have stopped for good, both inside nvjpegDecodeBatched (nvJPEG
  /// 13.0), in 7 of 1,204 loaders of 30 batches while the process took profiling signals (SIGPROF);
  /// never with 1 thread, nor without signals (bench/RESULTS.md, "GPU JPEG decode"). A decode
  /// that stops does not stop the program: with `timeout` its batch fails with TimeoutError after
  /// twice the timeout, `wait_poll` (Ctrl-C in Python) interrupts the wait, and destroying the
  /// loader gives up on it after 10 s, leaving its memory unfreed. Where that matters, set 1.
  int gpu_decode_threads = 0;
  /// Called on the consumer thread about every `wait_poll_period` while it waits for a batch;
  /// returning true (or throwing) ends that wait with ferry::Interrupted (or the exception), and
  /// no batch is lost: the next call waits for the same batch again. For front-ends that must
  /// notice a signal while the loader waits (the Python module checks for Ctrl-C). After an
  /// interruption, ending the epoch abandons the batches still being made instead of waiting for
  /// them (Note [Abandoned workers]): a 30 s sample does not hold the interrupted program. With
  /// num_workers = 0 the batch is then made on a helper thread the consumer polls. Empty: the
  /// consumer sleeps until its batch is ready.
  std::function<bool()> wait_poll;
  /// How often wait_poll is called while the consumer waits (at least 1 ms).
  std::chrono::milliseconds wait_poll_period{50};
  /// Threads that work on one batch: its samples are fetched (get / get_into) in that many
  /// parallel parts and large collate copies (>= 4 MiB) are split, on one oneTBB arena of
  /// intra_batch_threads x num_workers threads (at most the hardware's). 1: each worker does its
  /// batch alone. For few, large batches (38 MB images) few workers with several threads each
  /// gather faster than many single-threaded ones. A loader whose batches the
  /// device gather makes fetches no samples and starts none of these threads.
  int intra_batch_threads = 1;
  /// Where batch buffers come from; null means pageable host memory.
  std::shared_ptr<BatchAllocator> allocator;
  /// Records per-batch timelines (which thread, which stage, which pinned block) for a Chrome
  /// trace; see ferry/core/trace.h. Null: no tracing.
  std::shared_ptr<TraceRecorder> trace;
};

/// The front-ends' spellings: "raise" / "skip" / "replace" and "auto" / "host" / "device".
/// ferry::Error "<what> must be ..., got '<text>'" for anything else.
OnError parse_on_error(const std::string& text, const std::string& what = "on_error");
Gather parse_gather(const std::string& text, const std::string& what = "gather");

namespace detail {
/// The one place the options' rules live (front-ends pass options through and check none of
/// them): throws ferry::Error naming the first option that is out of range or conflicts with
/// another, whether or not the option is in use (pin_threads = 0 without pinning is an error too).
void validate_options(const DataLoaderOptions& o, bool streaming);
/// validate_options, then the rules that derive one option from another: a `device` implies
/// pin_memory. The loader keeps what this returns.
DataLoaderOptions normalize_options(DataLoaderOptions o, bool streaming);
/// One line naming the options, for the debug log.
std::string describe_options(const DataLoaderOptions& o, bool streaming);
}  // namespace detail

}  // namespace ferry
