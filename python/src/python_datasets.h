// python/src/python_datasets.h — the Python module's datasets: ferry's own (the registry's) and
// Python datasets run on ferry's threads, as the loader takes them.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "ferry/ferry.h"
#include "gil.h"

namespace ferry_py {

// Note [Python datasets]
// A Python dataset (map-style or iterable, PyTorch's protocols) runs on ferry's worker threads:
// each call into it takes the GIL, so the workers overlap where the dataset's work releases the
// GIL (file reads, numpy, PIL decode, torch ops) and the engine gives it everything it gives C++
// datasets (the reorder window, timeouts that abandon a stuck worker, on_error, resume, Ctrl-C).
// The Python half (ferry/_python.py) supplies the callables: fetch(indices) -> samples (and
// fetch_one(index)), finish(samples) -> batch (collate_fn, then pin_memory), open(worker,
// workers, seed, epoch) -> iterator for a stream, and plan(epoch) -> the epoch's batches of
// indices for a user's sampler. With worker processes (ferry/_procs.py, the default) fetch sends
// the indices to the worker thread's own process and reads the collated batch back, the thread
// waiting on the pipe without the GIL; the engine above is the same.
// Objects cross threads as PyRef, which takes the GIL to let go of its reference, so a batch or
// sample may be dropped on any thread. Every loader call that may wait for a worker (begin, end,
// destruction, restore) runs with the GIL released: a worker waiting for the GIL would otherwise
// wait for the very call that waits for it.

// A map-style Python dataset: samples are fetched a batch at a time (one GIL hold a batch).
// Both are told the loader's seed and the epoch (what ferry.sample_seed() answers from).
struct PyMap {
  Callable fetch;      // fetch(list of indices, seed, epoch) -> a sequence of as many samples
  Callable fetch_one;  // fetch_one(index, seed, epoch) -> one sample (on_error's sample-by-sample path)
  std::size_t n = 0;

  std::size_t size() const { return n; }
  std::vector<PyRef> get_batch(std::span<const std::size_t> idx, const ferry::WorkerInfo& w) const {
    return with_gil([&] {
      nb::list indices;
      for (std::size_t i : idx) indices.append(i);
      nb::object got = call(fetch, indices, w.seed, w.epoch);
      std::vector<PyRef> out;
      out.reserve(idx.size());
      try {
        for (nb::handle sample : got) out.emplace_back(nb::borrow(sample));
      } catch (nb::python_error& e) {
        throw PyException(e);
      }
      if (out.size() != idx.size())
        throw ferry::Error("dataset: __getitems__ returned " + std::to_string(out.size()) + " samples for " +
                           std::to_string(idx.size()) + " indices");
      return out;
    });
  }
  PyRef get(std::size_t i, ferry::SampleContext& ctx) const {
    return with_gil([&] { return PyRef(call(fetch_one, i, ctx.worker().seed, ctx.epoch())); });
  }
};

// An iterable Python dataset: each worker iterates its own iter(dataset).
struct PyIter {
  Callable open_fn;  // open(worker, num_workers, seed, epoch) -> iterator

  struct Stream {
    PyRef it;
    std::optional<PyRef> next() {
      return with_gil([&]() -> std::optional<PyRef> {
        PyObject* item = PyIter_Next(it.get().ptr());
        if (item) return PyRef(nb::steal(item));
        if (PyErr_Occurred()) {
          nb::python_error e;
          throw PyException(e);
        }
        return std::nullopt;
      });
    }
  };
  Stream open(const ferry::WorkerInfo& w) const {
    return with_gil([&] { return Stream{PyRef(call(open_fn, w.id, w.num_workers, w.seed, w.epoch))}; });
  }
};

// Note [Python batches through the pipeline]
// A Python dataset's batch crosses ferry's pipeline as a PyBatch: the Python object, and, where a
// worker process wrote the batch's tensors into a shared block (Note [Slabs] in ferry/_slabs.py),
// those tensors as ferry tensors viewing the block, the object then being the batch's structure
// (its pickle, each tensor a persistent id: its place in `tensors`). A batch a worker thread
// collated comes the same way with its tensors still torch's host memory, its structure the batch
// with a Place for each tensor (Note [Thread batches through the pipeline] in ferry/_python.py).
// The pin thread and the device stage treat them as any C++ batch's tensors: a registered block
// passes through and a thread's tensors are copied into one pinned block, and with a device the
// device stage copies them, its event fencing the block in its pool (the block is reused only
// behind the copy) and ordering the consumer's stream. The Python half rebuilds the batch from
// the structure and the delivered tensors (ferry/__init__.py, _PythonBatches). Any other batch
// travels as the object alone, as the dataset's collate made it.
struct PyBatch {
  PyRef object;
  std::vector<ferry::Tensor> tensors;  // non-empty: `object` is the structure they fill
  // A worker thread's tensors as they were before pinning (views of torch's memory, held by a
  // PyRef): kept until delivery, so that their PyRef is dropped on the consumer's thread, which
  // holds the GIL then, not on the pin thread (Note [Thread batches through the pipeline]).
  std::vector<ferry::Tensor> sources;

  void pin_memory(ferry::PinContext& ctx) {
    if (!ctx.measuring() && sources.empty()) {
      for (const ferry::Tensor& t : tensors)
        if (t.device().kind == ferry::MemoryKind::Host) sources.push_back(t);
    }
    for (ferry::Tensor& t : tensors) t = ctx.pin(t);
  }
};

// What a Python finish() returns for a batch whose tensors are in a shared block: made by
// ferry._ferry.TensorBatch (blocks.cpp), taken apart by PyCollate.
struct TensorBatch {
  PyRef structure;
  std::vector<ferry::Tensor> tensors;
};

// collate_fn, then pin_memory, on the worker that fetched the samples.
struct PyCollate {
  Callable finish;  // finish(list of samples) -> batch, or a TensorBatch
  PyBatch operator()(std::vector<PyRef>&& samples) const {
    return with_gil([&] {
      nb::list list;
      for (PyRef& s : samples) list.append(s.take());
      nb::object made = call(finish, list);
      if (nb::isinstance<TensorBatch>(made)) {
        auto& parts = nb::cast<TensorBatch&>(made);
        if (!parts.structure) throw ferry::Error("a TensorBatch was handed to the loader twice");
        return PyBatch{std::move(parts.structure), std::move(parts.tensors), {}};
      }
      return PyBatch{PyRef(std::move(made)), {}, {}};
    });
  }
};

// A user's sampler or batch_sampler: the epoch's batches come from Python, once an epoch.
class PyBatchSampler final : public ferry::BatchSampler {
 public:
  PyBatchSampler(Callable plan, std::size_t batches, std::size_t dataset_size)
      : plan_(std::move(plan)), batches_(batches), dataset_size_(dataset_size) {}
  std::size_t size() const override { return batches_; }
  bool plans_ahead() const noexcept override { return false; }  // Python's sampler, in its epoch's turn
  ferry::BatchPlan plan(std::uint64_t epoch) const override {
    Gil gil;
    nb::object batches = call(plan_, epoch);
    ferry::BatchPlan out =
        nb::isinstance<nb::tuple>(batches) ? of_order(nb::borrow<nb::tuple>(batches), epoch) : of_lists(batches, epoch);
    if (out.size() != batches_)
      throw ferry::Error("sampler: epoch " + std::to_string(epoch) + " gave " + std::to_string(out.size()) +
                         " batches, but len() said " + std::to_string(batches_) +
                         ": ferry plans each epoch by its length (resume counts on it)");
    return out;
  }

 private:
  // The epoch as a sampler gives it: an iterable of batches, each an iterable of indices.
  ferry::BatchPlan of_lists(const nb::object& batches, std::uint64_t epoch) const {
    ferry::BatchPlan out;
    std::vector<std::size_t> one;
    try {
      for (nb::handle batch : batches) {
        one.clear();
        for (nb::handle i : batch) {
          const long long v = nb::cast<long long>(i);
          if (v < 0 || static_cast<std::size_t>(v) >= dataset_size_)
            throw ferry::Error("sampler: batch " + std::to_string(out.size()) + " of epoch " + std::to_string(epoch) +
                               " has index " + std::to_string(v) + ", outside the dataset's " + std::to_string(dataset_size_) +
                               " samples");
          one.push_back(static_cast<std::size_t>(v));
        }
        out.add(one);
      }
    } catch (nb::python_error& e) {
      throw PyException(e);
    } catch (const nb::cast_error&) {
      throw ferry::Error("sampler: epoch " + std::to_string(epoch) + ", batch " + std::to_string(out.size()) +
                         ": an index is not an int");
    }
    return out;
  }

  // The package's own form of a sampler's epoch (ferry/_bridge.py, random_order()): (order, batch
  // size, drop_last), the order an int64 buffer, grouped here as BatchSampler groups it, where a
  // list of lists of Python ints took 0.1 s a million indices to read.
  ferry::BatchPlan of_order(const nb::tuple& t, std::uint64_t epoch) const {
    if (t.size() != 3) throw ferry::Error("sampler: epoch " + std::to_string(epoch) + ": a plan tuple holds 3 items");
    struct View {  // released on every way out
      Py_buffer b{};
      ~View() { PyBuffer_Release(&b); }
    } view;
    if (PyObject_GetBuffer(t[0].ptr(), &view.b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      nb::python_error e;
      throw PyException(e);
    }
    const char* format = view.b.format;
    if (view.b.itemsize != 8 || !format || (format[0] != 'l' && format[0] != 'q') || format[1])
      throw ferry::Error("sampler: epoch " + std::to_string(epoch) + ": a plan's order must be int64");
    const auto* p = static_cast<const std::int64_t*>(view.b.buf);
    std::vector<std::size_t> indices(static_cast<std::size_t>(view.b.len / 8));
    for (std::size_t i = 0; i < indices.size(); ++i) {
      if (p[i] < 0 || static_cast<std::size_t>(p[i]) >= dataset_size_)
        throw ferry::Error("sampler: epoch " + std::to_string(epoch) + " has index " + std::to_string(p[i]) +
                           ", outside the dataset's " + std::to_string(dataset_size_) + " samples");
      indices[i] = static_cast<std::size_t>(p[i]);
    }
    return ferry::make_batches(std::move(indices), nb::cast<std::size_t>(t[1]), nb::cast<bool>(t[2]));
  }

  Callable plan_;
  std::size_t batches_, dataset_size_;
};

// A dataset as the module holds it. Registry datasets are type-erased (std::vector<Tensor>
// samples); GPU decode needs the typed ImageFolder or TarImages (the loader's direct mode); tar
// shards read as a stream are their own kind.

struct PyDataset {
  std::string name, config;
  std::optional<ferry::OpenedDataset> opened;  // ferry's own datasets (DatasetRegistry::open)
  std::vector<std::string> fields;             // named fields: batches are dicts (token sequences)
  std::string token_type;                      // token sequences: the file's token type ("uint16", ...)
  std::vector<std::string> classes;            // an image folder's class names (label i: classes[i])
  // A Python dataset (Note [Python datasets]).
  std::optional<PyMap> py_map;
  std::optional<PyIter> py_iter;
  std::optional<PyCollate> py_collate;
  std::shared_ptr<PyBatchSampler> py_sampler;  // null: ferry's own sampler (shuffle, seed)
  Callable py_worker_start;                    // worker_start(id, num_workers, seed) on each worker thread

  bool stream() const {
    return py_iter || (opened && (std::holds_alternative<ferry::TarImageStream>(*opened) ||
                                  std::holds_alternative<ferry::TarGpuStream>(*opened) ||
                                  std::holds_alternative<ferry::TableTokens>(*opened)));
  }
  bool has_size() const { return !stream(); }
  std::size_t size() const {
    if (py_map) return py_map->size();
    if (opened && !stream())
      return std::visit(
          [](const auto& d) -> std::size_t {
            if constexpr (requires { d.size(); })
              return d.size();
            else
              return 0;
          },
          *opened);
    throw nb::type_error(("dataset '" + name + "' is a stream (tar shards, table windows): it has no len()").c_str());
  }
  std::string repr() const { return "ferry.datasets." + name + "(\"" + config + "\")"; }
};

/// The dataset classes and functions of the module (ferry._ferry.Dataset, make_dataset, ...).
void register_datasets(nb::module_& m);

}  // namespace ferry_py
