// python/src/hooks.cpp — what the tests and benchmarks ask of ferry._ferry beside the package's
// own use: a plain C++ loader's batches and timings over the same dataset, the pinned bytes held.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>

#include "module.h"
#include "python_datasets.h"

namespace ferry_py {
namespace {

using namespace nb::literals;

// The batches a plain C++ DataLoader makes for (dataset, options, epoch), each field's bytes: what
// the tests compare the Python loader's tensors with.
std::vector<std::vector<nb::bytes>> reference_batches(const PyDataset& dataset, const ferry::DataLoaderOptions& options,
                                                      std::uint64_t epoch) {
  const auto* dynamic = dataset.opened ? std::get_if<ferry::DynamicDataset>(&*dataset.opened) : nullptr;
  if (!dynamic) throw ferry::Error("_reference_batches: registry datasets only");
  std::vector<std::vector<ferry::Tensor>> batches;
  {
    NoGil nogil;
    ferry::DataLoader loader(*dynamic, options);
    loader.set_epoch(epoch);
    for (std::vector<ferry::Tensor>& b : loader) batches.push_back(std::move(b));
  }
  std::vector<std::vector<nb::bytes>> out;
  for (const auto& b : batches) {
    std::vector<nb::bytes> f;
    for (const ferry::Tensor& t : b) f.emplace_back(static_cast<const char*>(t.raw()), t.nbytes());
    out.push_back(std::move(f));
  }
  return out;
}

// Runs a plain C++ loop over the same loader: `warmup` batches, then `batches` timed ones (whole
// epochs, as many as needed); returns the timed seconds. The C++ side of the benchmark's
// Python-against-C++ ratio. Device batches are dropped as they come (their buffers are reused
// behind the consumer stream's events), so the caller synchronizes the device after.
double cpp_seconds(const PyDataset& dataset, const ferry::DataLoaderOptions& options, std::size_t warmup, std::size_t batches) {
  NoGil nogil;
  auto run = [&](auto&& loader) {
    auto t0 = std::chrono::steady_clock::now();
    std::size_t n = 0;
    const std::size_t total = warmup + batches;
    while (n < total) {
      const std::size_t before = n;
      for (auto& b : loader) {
        (void)b;
        if (++n == warmup) t0 = std::chrono::steady_clock::now();
        if (n == total) break;
      }
      if (n == before) throw ferry::Error("cpp_seconds: the loader delivers no batches");
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (!dataset.opened || dataset.stream()) throw ferry::Error("cpp_seconds: ferry's map-style datasets only");
  return std::visit(
      [&](const auto& d) -> double {
        if constexpr (ferry::IterableDataset<std::decay_t<decltype(d)>>)
          return 0;  // refused above
        else
          return run(ferry::DataLoader(d, options));
      },
      *dataset.opened);
}

}  // namespace

void register_hooks(nb::module_& m) {
  m.def("reference_batches", &reference_batches, "dataset"_a, "options"_a, "epoch"_a,
        "A plain C++ DataLoader's batches as bytes (tests).");
  m.def("cpp_seconds", &cpp_seconds, "dataset"_a, "options"_a, "warmup"_a, "batches"_a,
        "Seconds a C++ loop takes for `batches` batches of the same loader (benchmarks).");
  m.def("pinned_bytes", &ferry::PinnedPool::process_pinned_bytes,
        "Page-locked bytes ferry's pinned pools hold now, in this process (tests).");
}

}  // namespace ferry_py
