// ferry._ferry — the Python module's C++ half (python/ferry/__init__.py is the other half:
// PyTorch's keyword names, torch conversion, stubs). Its parts, each in a file of its own:
// errors.cpp (ferry.Error and its subclasses), datasets.cpp with python_datasets.h (the
// registry's datasets and Python datasets run on ferry's threads), loader.cpp (the loader and its
// options, Note [Python loader]), blocks.cpp (shared blocks for worker processes' batches), text.cpp (the tokenizers), digest.cpp (a fast digest, for a dataset's fingerprint),
// hooks.cpp (what tests and benchmarks call) and gil.h (the GIL from ferry's threads). Here: the
// module, and the process-wide calls (pinning, CUDA, storage).
#include <nanobind/stl/string.h>

#include "module.h"
#include "python_datasets.h"

using namespace ferry_py;
using namespace nb::literals;

NB_MODULE(_ferry, m) {
  m.doc() = "ferry's C++ half: datasets, the loader and DLPack hand-over (use the ferry package).";

  register_errors(m);
  register_datasets(m);
  register_loader(m);
  register_digest(m);
  register_blocks(m);
  register_text(m);
  register_hooks(m);
  m.def(
      "quiet_leak_warnings", [] { nb::set_leak_warnings(false); },
      "No leak report at exit: a worker ended inside the dataset while the program exited keeps its "
      "objects (Note [Threads Python ends at exit] in python/src/gil.h).");
  m.def(
      "sample_seed",
      [](std::uint64_t seed, std::uint64_t epoch, std::uint64_t index) {
        return ferry::Generator(seed, epoch, index).next_u64();
      },
      "seed"_a, "epoch"_a, "index"_a,
      "The first 64 bits of the sample's own generator, keyed by (seed, epoch, index), as C++'s ctx.rng().");
  m.attr("DEFAULT_PINNED_MEMORY_LIMIT") = ferry::DataLoaderOptions::kDefaultPinnedMemoryLimit;
  m.def("pinned_growth_cap", &ferry::detail::pinned_growth_cap,
        "How far an unset pinned budget may grow (half the machine's memory, at most 3/4 of what is free; 0: unknown).");
  m.def(
      "cuda_available", [] { return ferry::cuda::device_count() > 0; }, "Whether ferry sees a CUDA device.");
  m.def(
      "object_store_stats",
      [] {
        nb::dict d;
        ferry::object_store_stats().for_each([&](const char* name, std::uint64_t value) { d[name] = value; });
        return d;
      },
      "What this process has read from object storage (s3:// paths) since it started: requests (retries and hedges "
      "included), bytes, retries, hedges sent, hedges that answered first, and reads (and their bytes) served by the "
      "on-disk cache (FERRY_S3_CACHE_DIR).");
}
