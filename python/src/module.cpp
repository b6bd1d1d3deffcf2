// ferry._ferry — the Python module's C++ half: datasets from the registry, the loader over them,
// and batches handed to PyTorch through DLPack without a copy (python/ferry/__init__.py is the
// other half: PyTorch's keyword names, torch conversion, stubs).
//
// Note [Python loader]
// Every sample is made by ferry's C++ threads; Python code runs only between batches. The
// consumer's wait for a batch runs with the GIL released, and DataLoaderOptions::wait_poll takes
// the GIL back every 50 ms to run Python's signal handlers: Ctrl-C becomes KeyboardInterrupt
// within that time, the epoch is ended (its workers stop once the sample call they are in
// returns) and the loader can start another. A batch's tensors leave as DLPack capsules that own
// a reference to ferry's buffer (ferry::to_dlpack), so torch.from_dlpack shares the bytes and the
// buffer goes back to ferry's pool only when the last torch tensor viewing it is freed, on
// whichever thread frees it. Pinned batches are exported as CPU memory (kDLCPU: torch has no
// kDLCUDAHost import; torch's is_pinned() still sees the page-locked block), device batches as
// kDLCUDA on the loader's device, ordered on the consumer stream the Python side passes
// (torch.cuda.current_stream()), the stream ferry's device stage makes wait on each batch's copy.
#include <Python.h>
#include <cxxabi.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <dlpack/dlpack.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/ferry.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// --- datasets -------------------------------------------------------------------------------------

// --- Python datasets ------------------------------------------------------------------------------
//
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

// Whether the interpreter is finalizing: a thread of ferry's that asked for the GIL now would be
// ended (Note [Threads Python ends at exit]).
bool finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

[[noreturn]] void park_until_exit() noexcept;

// A strong reference to a Python object that any thread may drop (the GIL is taken to drop it).
class PyRef {
 public:
  PyRef() = default;
  explicit PyRef(nb::object o) noexcept : p_(o.release().ptr()) {}
  PyRef(PyRef&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  PyRef& operator=(PyRef&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() { reset(); }

  void reset() noexcept {
    PyObject* p = std::exchange(p_, nullptr);
    // After finalization there is nothing left to free; while it runs, a thread asking for the
    // GIL here would be ended by Python (Note [Threads Python ends at exit]): the reference is
    // left. Finalization may also begin between the check and the GIL; the thread then parks
    // rather than let Python's unwind reach this noexcept frame, which would abort the process.
    if (!p || !Py_IsInitialized() || finalizing()) return;
    try {
      PyGILState_STATE s = PyGILState_Ensure();
      Py_DECREF(p);
      PyGILState_Release(s);
    } catch (abi::__forced_unwind&) {
      park_until_exit();
    }
  }
  /// The object, as a new reference (GIL held); this PyRef is empty after.
  nb::object take() noexcept { return nb::steal(std::exchange(p_, nullptr)); }
  nb::handle get() const noexcept { return p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  PyObject* p_ = nullptr;
};

// An exception raised by the user's Python code on a worker: the original exception object rides
// inside ferry's WorkerError to the consumer, where it becomes the raised error's __cause__.
class PyException : public ferry::Error {
 public:
  explicit PyException(nb::python_error& e)  // GIL held
      : ferry::Error(message(e)), value_(std::make_shared<PyRef>(nb::borrow(e.value()))) {
    nb::object tb = e.traceback();
    if (tb.is_valid() && !tb.is_none()) PyException_SetTraceback(value_->get().ptr(), tb.ptr());
  }
  nb::handle value() const noexcept { return value_->get(); }

 private:
  // The exception's text and traceback; for one raised in a worker process (ferry/_procs.py),
  // the worker's traceback too, which its cause carries.
  static std::string message(nb::python_error& e) {
    std::string text = e.what();
    nb::object cause = nb::steal(PyException_GetCause(e.value().ptr()));
    if (cause.is_valid() && nb::hasattr(cause, "ferry_remote_traceback"))
      text += "\nraised " + nb::cast<std::string>(cause.attr("ferry_remote_traceback"));
    return text;
  }

 public:
 private:
  std::shared_ptr<PyRef> value_;  // shared: exceptions are copied
};

// A thread ferry made keeps one Python thread state from its first call into Python to its exit,
// so what Python keeps per thread (threading.local: get_worker_info(), a dataset's per-thread file
// handles) lives as long as the worker, and each call takes only the GIL. The consumer's thread is
// Python's own and keeps its state anyway.
class ThreadStateKeeper {
 public:
  ThreadStateKeeper() {
    if (PyGILState_GetThisThreadState() != nullptr) return;
    state_ = PyGILState_Ensure();
    saved_ = PyEval_SaveThread();
  }
  ~ThreadStateKeeper() {
    if (!saved_ || !Py_IsInitialized() || finalizing()) return;  // a thread outliving Python keeps it
    PyEval_RestoreThread(saved_);
    PyGILState_Release(state_);
  }
  ThreadStateKeeper(const ThreadStateKeeper&) = delete;
  ThreadStateKeeper& operator=(const ThreadStateKeeper&) = delete;

 private:
  PyGILState_STATE state_{};
  PyThreadState* saved_ = nullptr;
};

// The GIL, for a call into Python from any thread (see ThreadStateKeeper). Taken through
// with_gil on threads ferry made.
class Gil {
 public:
  Gil() {
    thread_local ThreadStateKeeper keeper;
    state_ = PyGILState_Ensure();
  }
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// Note [Threads Python ends at exit]
// A thread that asks for the GIL once the interpreter is finalizing is ended by Python
// (3.11-3.13: PyThread_exit_thread, which unwinds the thread's stack as pthread_exit does): a
// worker abandoned inside the dataset (a timeout, Ctrl-C) whose call returns while the program
// exits, or a daemon thread of the user's that comes back from a loader's call (NoGil). Unwinding
// ferry's frames would release a GIL the thread does not hold ("Fatal Python error:
// PyGILState_Release: thread state ... must be current when releasing") and meet handlers
// that may not swallow the unwind; either aborts the process. The thread waits here instead, its
// stack as it was, until the process exits (Python 3.14 parks such threads the same way).
[[noreturn]] void park_until_exit() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// fn() with the GIL held, on any thread; a thread Python ends meanwhile parks (Note [Threads
// Python ends at exit]). The Gil lives outside the try, so that the unwind does not release it.
template <class F>
auto with_gil(F&& fn) -> decltype(fn()) {
  std::optional<Gil> gil;
  try {
    gil.emplace();
    return fn();
  } catch (abi::__forced_unwind&) {
    park_until_exit();
  }
}

// Takes the GIL back for NoGil. Not noexcept: the unwind of a thread Python ends is caught here
// (a noexcept frame on its way would abort the process), and the thread parks.
void restore_thread(PyThreadState* state) {
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    park_until_exit();
  }
}

// Releases the GIL for its scope, as nb::gil_scoped_release does, for any thread that calls into
// ferry: a thread of the user's (a daemon thread inside a loop) that comes back while the
// interpreter finalizes is ended by Python as it takes the GIL back, and parks instead of aborting
// (Note [Threads Python ends at exit]).
class NoGil {
 public:
  NoGil() noexcept : state_(PyEval_SaveThread()) {}
  ~NoGil() { restore_thread(state_); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* state_;
};

using Callable = std::shared_ptr<PyRef>;  // shared by the copies a loader makes of its dataset

Callable callable(nb::object f) { return std::make_shared<PyRef>(std::move(f)); }

// Calls f(args...) with the GIL taken; a Python exception becomes PyException. A thread Python
// ends during the call parks here, its caller's objects untouched (Note [Threads Python ends at
// exit]).
template <class... A>
nb::object call(const Callable& f, A&&... args) {
  try {
    return f->get()(std::forward<A>(args)...);
  } catch (nb::python_error& e) {
    throw PyException(e);
  } catch (abi::__forced_unwind&) {
    park_until_exit();
  }
}

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

// collate_fn, then pin_memory, on the worker that fetched the samples.
struct PyCollate {
  Callable finish;  // finish(list of samples) -> batch
  PyRef operator()(std::vector<PyRef>&& samples) const {
    return with_gil([&] {
      nb::list list;
      for (PyRef& s : samples) list.append(s.take());
      return PyRef(call(finish, list));
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
    if (out.size() != batches_)
      throw ferry::Error("sampler: epoch " + std::to_string(epoch) + " gave " + std::to_string(out.size()) +
                         " batches, but len() said " + std::to_string(batches_) +
                         ": ferry plans each epoch by its length (resume counts on it)");
    return out;
  }

 private:
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
  // A Python dataset (Note [Python datasets]).
  std::optional<PyMap> py_map;
  std::optional<PyIter> py_iter;
  std::optional<PyCollate> py_collate;
  std::shared_ptr<PyBatchSampler> py_sampler;  // null: ferry's own sampler (shuffle, seed)
  Callable py_worker_start;                    // worker_start(id, num_workers, seed) on each worker thread

  bool stream() const {
    return py_iter || (opened && (std::holds_alternative<ferry::TarImageStream>(*opened) ||
                                  std::holds_alternative<ferry::TarGpuStream>(*opened)));
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
    throw nb::type_error(("dataset '" + name + "' is a stream (tar shards): it has no len()").c_str());
  }
  std::string repr() const { return "ferry.datasets." + name + "(\"" + config + "\")"; }
};

PyDataset make_dataset(const std::string& name, const std::string& config) {
  PyDataset d;
  d.name = name;
  d.config = config;
  d.opened.emplace(ferry::DatasetRegistry::global().open(name, config));
  if (const auto* seqs = std::get_if<ferry::TokenSequences>(&*d.opened)) {  // dict batches
    d.fields = seqs->field_names();
    d.token_type = ferry::token_type_name(seqs->corpus().type());
  }
  return d;
}

// The same token sequences with raw windows (TokenSequenceOptions::raw), over the corpus already
// open, and the dtype the loader widens them to (Note [Token windows widened on the GPU]).
std::pair<PyDataset, std::string> raw_token_windows(const PyDataset& tokens) {
  const auto* seqs = tokens.opened ? std::get_if<ferry::TokenSequences>(&*tokens.opened) : nullptr;
  if (!seqs) throw nb::type_error("raw_token_windows: not a ferry token dataset (ferry.datasets.tokens or megatron)");
  ferry::TokenSequenceOptions o = seqs->options();
  o.raw = true;
  PyDataset d;
  d.name = tokens.name;
  d.config = tokens.config;
  ferry::TokenSequences raw(seqs->shared_corpus(), o);
  d.fields = raw.field_names();
  d.token_type = tokens.token_type;
  d.opened.emplace(std::move(raw));
  return {std::move(d), ferry::dtype_name(seqs->options().dtype)};
}

// Why the GPU cannot gather this token dataset's windows from the file's mapping ("" when it can:
// Note [Token windows on the GPU], ferry/loaders/tokens.h).
std::string token_gather_problem(const PyDataset& tokens) {
  const auto* seqs = tokens.opened ? std::get_if<ferry::TokenSequences>(&*tokens.opened) : nullptr;
  if (!seqs) throw nb::type_error("token_gather_problem: not a ferry token dataset (ferry.datasets.tokens or megatron)");
  std::string why;
  return seqs->host_rows(why).empty() ? why : std::string();
}

// A weighted mixture of ferry datasets (ferry::Mixture); `schedule` holds later weights, each
// with the global index it applies from.
PyDataset make_mixture(const std::vector<const PyDataset*>& sources, const std::vector<double>& weights, std::uint64_t seed,
                       std::size_t block, std::optional<std::size_t> size,
                       const std::vector<std::pair<std::uint64_t, std::vector<double>>>& schedule) {
  std::vector<ferry::DynamicDataset> datasets;
  PyDataset d;
  d.name = "mixture";
  for (std::size_t k = 0; k < sources.size(); ++k) {
    const PyDataset* s = sources[k];
    const auto* dynamic = s && s->opened ? std::get_if<ferry::DynamicDataset>(&*s->opened) : nullptr;
    const auto* seqs = s && s->opened ? std::get_if<ferry::TokenSequences>(&*s->opened) : nullptr;
    if (!dynamic && !seqs)
      throw nb::type_error(("mixture: source " + std::to_string(k) +
                            " is not a map-style ferry dataset (ferry.datasets.tokens, megatron, npy, ...)")
                               .c_str());
    if (k > 0 && s->fields != d.fields)
      throw nb::value_error(("mixture: source " + std::to_string(k) +
                             "'s fields differ from source 0's (packed and unpacked sequences, or other datasets)")
                                .c_str());
    d.fields = s->fields;
    datasets.push_back(dynamic ? *dynamic : ferry::DynamicDataset(*seqs));
    d.config += (k ? "; " : "") + s->name + "(" + s->config + ")";
  }
  ferry::MixtureOptions o;
  o.seed = seed;
  o.block = block;
  o.size = size;
  ferry::Mixture m(std::move(datasets), weights, o);
  for (const auto& [from, w] : schedule) m = m.reweighted(w, from);
  d.opened.emplace(ferry::DynamicDataset(std::move(m)));
  return d;
}

// --- the loader -----------------------------------------------------------------------------------

// A delivered batch: ferry's tensors, or the Python object a Python dataset's collate made.
struct Delivery {
  std::vector<ferry::Tensor> tensors;
  PyRef object;
};
void deliver(std::vector<ferry::Tensor>&& b, Delivery& d) { d.tensors = std::move(b); }
void deliver(ferry::LabeledBatch&& b, Delivery& d) { d.tensors = {std::move(b.image), std::move(b.label)}; }
void deliver(PyRef&& b, Delivery& d) { d.object = std::move(b); }

// One epoch at a time over any dataset kind; every call on the consumer (Python's) thread.
class Loader {
 public:
  virtual ~Loader() = default;
  virtual void begin() = 0;
  /// The next batch's fields; false at the end of the epoch. Blocks (call without the GIL).
  virtual bool next(Delivery& out) = 0;
  virtual void end() noexcept = 0;
  virtual bool live() const noexcept = 0;
  virtual std::size_t size() const = 0;
  virtual void set_epoch(std::uint64_t epoch) = 0;
  virtual std::uint64_t next_epoch() const = 0;
  virtual ferry::LoaderStats stats() const = 0;
  virtual void reset_stats() = 0;
  virtual ferry::LoaderState state() const = 0;
  virtual void restore(const ferry::LoaderState& state) = 0;
};

template <class D, class C = ferry::DefaultCollate>
class LoaderOf final : public Loader {
 public:
  LoaderOf(D dataset, const ferry::DataLoaderOptions& options, C collate = {})
      : loader_(std::move(dataset), options, std::move(collate)) {}
  ~LoaderOf() override { end(); }

  void begin() override {
    end();
    it_.emplace(loader_.begin());
    advance_ = false;
  }
  bool next(Delivery& out) override {
    if (!it_) return false;
    auto& it = *it_;
    if (advance_) {
      ++it;  // releases the previous batch's slot; fetches nothing yet
      advance_ = false;
    }
    // May throw: a failed batch (WorkerError, DataError, TimeoutError) has taken its position and
    // the next call goes on with the next one; Interrupted has taken nothing.
    if (it == loader_.end()) {
      end();
      return false;
    }
    deliver(std::move(*it), out);
    advance_ = true;
    return true;
  }
  void end() noexcept override { it_.reset(); }
  bool live() const noexcept override { return it_.has_value(); }
  std::size_t size() const override { return loader_.size(); }
  void set_epoch(std::uint64_t epoch) override { loader_.set_epoch(epoch); }
  std::uint64_t next_epoch() const override { return loader_.next_epoch(); }
  ferry::LoaderStats stats() const override { return loader_.stats(); }
  void reset_stats() override { loader_.reset_stats(); }
  ferry::LoaderState state() const override { return loader_.state(); }
  void restore(const ferry::LoaderState& state) override { loader_.restore(state); }

 private:
  ferry::DataLoader<D, C> loader_;
  std::optional<typename ferry::DataLoader<D, C>::iterator> it_;
  bool advance_ = false;
};

// The DLPack capsule of one tensor: torch.from_dlpack renames it "used_dltensor" and owns it
// from then on; a capsule nobody consumed frees its export here.
// as_uint8: a bool tensor goes as uint8 (the caller views it as torch.bool): torch before 2.1
// refuses DLPack's kDLBool ("Unsupported code 6").
nb::object capsule_of(const ferry::Tensor& t, bool as_uint8 = false) {
  DLManagedTensor* m = ferry::to_dlpack(t);
  if (as_uint8) m->dl_tensor.dtype = {kDLUInt, 8, 1};
  if (m->dl_tensor.device.device_type == kDLCUDAHost) m->dl_tensor.device = {kDLCPU, 0};  // see the Note
  // A batch's fields share one buffer at offsets; torch 1.13's import ignores byte_offset.
  m->dl_tensor.data = static_cast<char*>(m->dl_tensor.data) + m->dl_tensor.byte_offset;
  m->dl_tensor.byte_offset = 0;
  PyObject* cap = PyCapsule_New(m, "dltensor", [](PyObject* self) {
    if (!PyCapsule_IsValid(self, "dltensor")) return;  // consumed
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(self, "dltensor"));
    if (managed && managed->deleter) managed->deleter(managed);
  });
  if (!cap) {
    m->deleter(m);
    throw nb::python_error();
  }
  return nb::steal(cap);
}

class PyLoader {
 public:
  PyLoader(const PyDataset& dataset, ferry::DataLoaderOptions options, nb::object convert)
      : convert_(std::move(convert)), has_size_(dataset.has_size()), trace_(options.trace), fields_(dataset.fields) {
    // A handler raised (KeyboardInterrupt), or release() asks: stop waiting. A daemon thread
    // polling as the program exits parks (with_gil).
    options.wait_poll = [releasing = releasing_] {
      return releasing->load() || with_gil([] { return PyErr_CheckSignals() != 0; });
    };
    options.wait_poll_period = std::chrono::milliseconds(50);
    if (dataset.py_map || dataset.py_iter) {
      // Without workers the dataset runs on this (Python's main) thread, as in PyTorch: no thread
      // handoffs, and Ctrl-C raises KeyboardInterrupt inside the dataset's code, which next()
      // passes on as it is.
      if (options.num_workers == 0) options.wait_poll = nullptr;
      // As PyTorch: batch b to worker b mod num_workers, so a worker process's seeded generators
      // meet the same batches on every run (Note [PyTorch's seeds] in ferry/_bridge.py).
      options.round_robin = true;
      if (dataset.py_sampler) options.batch_sampler = dataset.py_sampler;
      if (dataset.py_worker_start)
        options.worker_init_fn = [start = dataset.py_worker_start](const ferry::WorkerInfo& w) {
          with_gil([&] { call(start, w.id, w.num_workers, w.seed); });
        };
      if (dataset.py_map)
        impl_ = std::make_unique<LoaderOf<PyMap, PyCollate>>(*dataset.py_map, options, *dataset.py_collate);
      else
        impl_ = std::make_unique<LoaderOf<PyIter, PyCollate>>(*dataset.py_iter, options, *dataset.py_collate);
    } else {
      if (dataset.stream() && options.shuffle)  // as PyTorch refuses shuffle for an IterableDataset
        throw nb::value_error(
            "DataLoader: shuffle=True is not for a stream of tar shards, which decides its own order: "
            "ferry.datasets.tar(..., shuffle=True) (the default) shuffles the shards and within a buffer");
      impl_ = std::visit([&](const auto& d) { return make(d, options); }, *dataset.opened);
    }
  }

  // Workers of a Python dataset take the GIL: whatever may wait for them runs without it.
  ~PyLoader() {
    NoGil nogil;
    impl_.reset();
  }

  PyLoader& iter() {
    const Busy busy(busy_);  // release() waits for it; next() then ends the loop
    Loader& loader = impl();
    NoGil nogil;
    loader.begin();
    return *this;
  }

  // Stops the workers and drops every reference into Python; the loader is unusable after. The
  // Python half calls it at exit for loaders of Python datasets, whose references (dataset ->
  // its class -> the module's globals -> the loader) form a cycle the collector cannot see into.
  // Another thread may be inside next() (a daemon thread's loop): it leaves at its next wait poll
  // (its loop ends, StopIteration), or once its sample is done where the dataset runs on it, and
  // the loader goes after. One still inside after a second (a long sample) keeps the loader: the
  // thread parks with it as the program exits (Note [Threads Python ends at exit]).
  void release() {
    releasing_->store(true);
    {
      NoGil nogil;  // the thread inside may need the GIL to leave
      for (int k = 0; k < 100 && busy_.load() > 0; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (busy_.load() > 0) return;
    // Moved with the GIL held, as every reader of impl_ holds it; a thread coming in now sees
    // releasing_ first.
    std::unique_ptr<Loader> gone = std::move(impl_);
    NoGil nogil;
    gone.reset();
  }

  nb::object next() {
    const Busy busy(busy_);
    if (releasing_->load() || !impl_ || !impl_->live()) throw nb::stop_iteration();
    Delivery batch;
    bool got = false;
    try {
      NoGil nogil;
      got = impl_->next(batch);
    } catch (const ferry::Interrupted&) {
      {
        NoGil nogil;
        impl_->end();  // Ctrl-C: the workers stop; the loader can start another epoch
      }
      if (releasing_->load()) throw nb::stop_iteration();  // release() asked (at exit)
      if (PyErr_Occurred()) throw nb::python_error();
      throw;
    } catch (const ferry::WorkerError& e) {
      // KeyboardInterrupt or SystemExit raised inside a Python dataset (num_workers=0: it runs on
      // this thread): not a failed batch but the program's own exit; end the epoch and re-raise.
      if (nb::handle exit = base_exception_of(e)) {
        {
          NoGil nogil;
          impl_->end();
        }
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exit.ptr())), exit.ptr());
        throw nb::python_error();
      }
      throw;
    }
    if (!got) throw nb::stop_iteration();
    last_pointers_.clear();
    if (batch.object) return batch.object.take();
    nb::list out;
    for (const ferry::Tensor& t : batch.tensors) {
      last_pointers_.push_back(reinterpret_cast<std::uintptr_t>(t.defined() ? t.raw() : nullptr));
      const bool as_bool = t.defined() && t.dtype() == ferry::DType::Bool && !convert_.is_none();
      nb::object cap = capsule_of(t, as_bool);
      if (convert_.is_none())
        out.append(cap);
      else if (as_bool)
        out.append(convert_(cap).attr("view")(torch_bool()));  // see capsule_of
      else
        out.append(convert_(cap));
    }
    if (!fields_.empty() && fields_.size() == out.size()) {
      nb::dict named;
      for (std::size_t k = 0; k < fields_.size(); ++k) named[fields_[k].c_str()] = out[k];
      return named;
    }
    return nb::tuple(out);
  }

  // The Python exception behind a WorkerError when it is no Exception (KeyboardInterrupt,
  // SystemExit): those are not the batch's failure.
  static nb::handle base_exception_of(const ferry::WorkerError& e) {
    if (!e.original()) return {};
    try {
      std::rethrow_exception(e.original());
    } catch (const PyException& py) {
      if (!PyObject_IsInstance(py.value().ptr(), PyExc_Exception)) return py.value();
    } catch (...) {
    }
    return {};
  }

  std::size_t len() const {
    if (!has_size_) throw nb::type_error("this DataLoader's dataset is a stream (tar shards): it has no len()");
    if (!impl_) throw ferry::Error("DataLoader: this loader was released (at interpreter exit)");
    return impl_->size();
  }
  void end() {
    if (!impl_) return;
    NoGil nogil;
    impl_->end();
  }
  Loader& impl() {
    if (!impl_) throw ferry::Error("DataLoader: this loader was released (at interpreter exit)");
    return *impl_;
  }
  const std::vector<std::uintptr_t>& last_pointers() const { return last_pointers_; }
  void write_trace(const std::string& path) const {
    if (!trace_) throw ferry::Error("DataLoader: no trace recorded: pass trace_batches=N");
    std::ofstream out(path);
    if (!out) throw ferry::Error("DataLoader: cannot write the trace to '" + path + "'");
    trace_->write_chrome_json(out);
  }

 private:
  template <class D>
  static std::unique_ptr<Loader> make(D dataset, const ferry::DataLoaderOptions& options) {
    return std::make_unique<LoaderOf<D>>(std::move(dataset), options);
  }

  // Threads inside next() or iter(); release() waits for them to leave (sequentially consistent
  // with releasing_: either release() sees a thread here, or the thread sees releasing_ set).
  struct Busy {
    explicit Busy(std::atomic<int>& n) noexcept : n_(n) { ++n_; }
    ~Busy() { --n_; }
    std::atomic<int>& n_;
  };
  std::atomic<int> busy_{0};
  std::shared_ptr<std::atomic<bool>> releasing_ = std::make_shared<std::atomic<bool>>(false);
  std::unique_ptr<Loader> impl_;
  static nb::object torch_bool() {
    static nb::object* b = new nb::object(nb::module_::import_("torch").attr("bool"));  // never freed: outlives finalization
    return *b;
  }
  nb::object convert_;
  bool has_size_;
  std::shared_ptr<ferry::TraceRecorder> trace_;
  std::vector<std::uintptr_t> last_pointers_;
  std::vector<std::string> fields_;  // non-empty: a batch is a dict of these names
};

// --- options --------------------------------------------------------------------------------------

ferry::DataLoaderOptions make_options(std::size_t batch_size, bool shuffle, int num_workers, bool pin_memory, bool drop_last,
                                      double timeout, int prefetch_factor, bool persistent_workers, std::uint64_t seed,
                                      std::optional<int> device, bool in_order, const std::string& on_error,
                                      std::size_t max_errors, double max_error_fraction, const std::string& gather,
                                      std::optional<std::size_t> pinned_memory_limit, std::uintptr_t stream,
                                      std::int64_t trace_batches, int gpu_decode_threads) {
  // Conversions only: every rule is the library's (ferry::detail::normalize_options).
  ferry::DataLoaderOptions o;
  o.batch_size = batch_size;
  o.shuffle = shuffle;
  o.num_workers = num_workers;
  o.pin_memory = pin_memory;
  o.drop_last = drop_last;
  if (!(timeout >= 0)) throw ferry::Error("DataLoader: timeout must be >= 0 seconds");
  o.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout * 1000.0 + 0.5));
  o.prefetch_factor = prefetch_factor;
  o.persistent_workers = persistent_workers;
  o.seed = seed;
  o.gpu_decode_threads = gpu_decode_threads;
  o.device = device;
  o.in_order = in_order;
  o.on_error = ferry::parse_on_error(on_error, "DataLoader: on_error");
  o.max_errors = max_errors;
  o.max_error_fraction = max_error_fraction;
  o.gather = ferry::parse_gather(gather, "DataLoader: gather");
  if (pinned_memory_limit) o.pinned_memory_limit = *pinned_memory_limit;
  o.consumer_stream = reinterpret_cast<void*>(stream);
  if (trace_batches < 0) throw ferry::Error("DataLoader: trace_batches must be >= 0");
  if (trace_batches > 0) o.trace = std::make_shared<ferry::TraceRecorder>(trace_batches);
  return o;
}

nb::dict stats_dict(const ferry::LoaderStats& s) {
  nb::dict d;
  s.for_each([&](const char* name, const auto& value) { d[name] = value; });  // the one list: LoaderStats::for_each
  d["report"] = s.report();
  return d;
}

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

// --- exceptions -----------------------------------------------------------------------------------

struct Exceptions {
  PyObject* error = nullptr;
  PyObject* worker = nullptr;
  PyObject* timeout = nullptr;
  PyObject* data = nullptr;
  PyObject* io = nullptr;
  PyObject* cuda = nullptr;
  PyObject* interrupted = nullptr;
};
Exceptions g_exc;

PyObject* new_exception(nb::module_& m, const char* name, PyObject* base, const char* doc) {
  const std::string qual = std::string("ferry.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qual.c_str(), doc, base, nullptr);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::borrow(type);
  return type;
}

void raise(PyObject* type, const char* message, std::initializer_list<std::pair<const char*, nb::object>> attrs = {},
           nb::handle cause = {}) {
  nb::object exc = nb::steal(PyObject_CallFunction(type, "s", message));
  if (!exc.is_valid()) return;  // the call set its own error
  for (const auto& [k, v] : attrs) nb::setattr(exc, k, v);
  if (cause) PyException_SetCause(exc.ptr(), nb::borrow(cause).release().ptr());  // steals the reference
  PyErr_SetObject(type, exc.ptr());
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const ferry::IoError& e) {
    raise(g_exc.io, e.what(), {{"file", nb::cast(e.file())}, {"errno", nb::cast(e.error_number())}});
  } catch (const ferry::DataError& e) {
    nb::object offset = e.offset() == ferry::DataError::kNoOffset ? nb::none() : nb::cast(e.offset());
    raise(g_exc.data, e.what(), {{"file", nb::cast(e.file())}, {"offset", offset}});
  } catch (const ferry::WorkerError& e) {
    // The user's Python exception (Note [Python datasets]) is the cause, its traceback kept.
    nb::handle cause;
    if (e.original()) {
      try {
        std::rethrow_exception(e.original());
      } catch (const PyException& py) {
        cause = py.value();
      } catch (...) {
      }
    }
    raise(g_exc.worker, e.what(), {{"worker", nb::cast(e.worker())}, {"batch", nb::cast(e.batch())}}, cause);
  } catch (const ferry::TimeoutError& e) {
    raise(g_exc.timeout, e.what());
  } catch (const ferry::CudaError& e) {
    raise(g_exc.cuda, e.what());
  } catch (const ferry::Interrupted& e) {
    raise(g_exc.interrupted, e.what());
  } catch (const ferry::Error& e) {
    raise(g_exc.error, e.what());
  }
}

}  // namespace

NB_MODULE(_ferry, m) {
  m.doc() = "ferry's C++ half: datasets, the loader and DLPack hand-over (use the ferry package).";

  g_exc.error = new_exception(m, "Error", PyExc_RuntimeError, "Base class of every error ferry raises.");
  g_exc.worker = new_exception(m, "WorkerError", g_exc.error,
                               "A dataset or transform failed inside the pipeline; raised at that batch's position. "
                               "Attributes: worker, batch.");
  g_exc.timeout = new_exception(m, "TimeoutError", g_exc.error,
                                "No batch within DataLoader(timeout=...): names the stage, batch and sample that stalled.");
  g_exc.data = new_exception(m, "DataError", g_exc.error,
                             "A file or record is malformed; names the file and offset. Attributes: file, offset.");
  g_exc.io = new_exception(m, "IoError", g_exc.data, "A DataError from the operating system. Attributes: file, errno.");
  g_exc.cuda = new_exception(m, "CudaError", g_exc.error, "A CUDA call failed, or the device asked for is not usable.");
  g_exc.interrupted = new_exception(m, "Interrupted", g_exc.error, "The wait for a batch was interrupted.");
  nb::register_exception_translator(translate);

  nb::class_<PyDataset>(m, "Dataset", "A dataset ferry reads with its own threads (make one with ferry.datasets).")
      .def("__len__", &PyDataset::size)
      .def("__repr__", &PyDataset::repr)
      .def_ro("name", &PyDataset::name)
      .def_ro("config", &PyDataset::config)
      .def_ro("fields", &PyDataset::fields, "Field names when batches are dicts (token sequences), else empty.")
      .def_ro("token_type", &PyDataset::token_type, "Token sequences: the file's token type (\"uint16\", ...); else empty.");
  m.def("raw_token_windows", &raw_token_windows, "dataset"_a,
        "A token dataset with raw windows over the same open corpus, and the dtype they widen to.");
  m.def("token_gather_problem", &token_gather_problem, "dataset"_a,
        "Why the GPU cannot gather a token dataset's windows from its file's mapping ('' when it can).");
  m.def("make_mixture", &make_mixture, "sources"_a, "weights"_a, "seed"_a, "block"_a, "size"_a.none(), "schedule"_a,
        "A weighted mixture of ferry datasets (C++ ferry::Mixture).");
  m.def("make_dataset", &make_dataset, "name"_a, "config"_a,
        "The registry's dataset `name` from a 'key=value,...' configuration (and 'tar', and "
        "image_folder with decode=gpu).");
  m.def(
      "python_dataset",
      [](nb::object fetch, nb::object fetch_one, std::optional<std::size_t> size, nb::object open, nb::object finish,
         nb::object plan, std::size_t plan_batches, nb::object worker_start, const std::string& name) {
        PyDataset d;
        d.name = name;
        if (!fetch.is_none())
          d.py_map.emplace(PyMap{callable(fetch), callable(fetch_one), size.value_or(0)});
        else
          d.py_iter.emplace(PyIter{callable(open)});
        d.py_collate.emplace(PyCollate{callable(finish)});
        if (!plan.is_none()) d.py_sampler = std::make_shared<PyBatchSampler>(callable(plan), plan_batches, size.value_or(0));
        if (!worker_start.is_none()) d.py_worker_start = callable(worker_start);
        return d;
      },
      "fetch"_a.none(), "fetch_one"_a.none(), "size"_a.none(), "open"_a.none(), "finish"_a, "plan"_a.none(), "plan_batches"_a,
      "worker_start"_a.none(), "name"_a, "A Python dataset run on ferry's threads (ferry/_python.py makes the callables).");
  m.def(
      "quiet_leak_warnings", [] { nb::set_leak_warnings(false); },
      "No leak report at exit: a worker ended inside the dataset while the program exited keeps its "
      "objects (Note [Threads Python ends at exit] in module.cpp).");
  m.def(
      "sample_seed",
      [](std::uint64_t seed, std::uint64_t epoch, std::uint64_t index) {
        return ferry::Generator(seed, epoch, index).next_u64();
      },
      "seed"_a, "epoch"_a, "index"_a,
      "The first 64 bits of the sample's own generator, keyed by (seed, epoch, index), as C++'s ctx.rng().");
  m.def(
      "host_register",
      [](std::uintptr_t address, std::size_t bytes) {
        NoGil unlocked;
        ferry::cuda::host_register(reinterpret_cast<void*>(address), bytes);
      },
      "address"_a, "bytes"_a, "Pins a mapping made elsewhere (cudaHostRegister, portable); raises ferry.CudaError.");
  m.attr("DEFAULT_PINNED_MEMORY_LIMIT") = ferry::DataLoaderOptions::kDefaultPinnedMemoryLimit;
  m.def("pinned_growth_cap", &ferry::detail::pinned_growth_cap,
        "How far an unset pinned budget may grow (half the machine's memory, at most 3/4 of what is free; 0: unknown).");
  m.def(
      "host_unregister",
      [](std::uintptr_t address) {
        NoGil unlocked;
        ferry::cuda::host_unregister(reinterpret_cast<void*>(address));
      },
      "address"_a, "Undoes host_register.");
  m.def(
      "registered", [] { return ferry::DatasetRegistry::global().names(); }, "Dataset names the registry knows.");
  m.def(
      "help", [](const std::string& name) { return ferry::DatasetRegistry::global().help(name); }, "name"_a,
      "The configuration keys of a registered dataset.");
  m.def(
      "load_plugin", [](const std::string& path) { return ferry::DatasetRegistry::global().load_plugin(path); }, "path"_a,
      "Loads a dataset plugin library; returns the names it registered.");

  nb::class_<ferry::DataLoaderOptions>(m, "Options");
  m.def(
      "with_distributed_sampler",
      [](const ferry::DataLoaderOptions& o, const PyDataset& dataset, std::size_t num_replicas, std::size_t rank) {
        // Conversions only: DistributedEnv makes the sampler (DistributedSampler checks the rank).
        if (!dataset.has_size())
          throw nb::type_error("DataLoader: num_replicas/rank are for map-style ferry datasets, not a stream");
        ferry::DistributedEnv env;
        env.world_size = num_replicas;
        env.rank = rank;
        return env.loader_options(dataset.size(), o, /*use_device=*/false);
      },
      "options"_a, "dataset"_a, "num_replicas"_a, "rank"_a,
      "The options with this rank's DistributedSampler over the dataset (C++ ferry::DistributedSampler).");
  m.def("make_options", &make_options, "batch_size"_a, "shuffle"_a, "num_workers"_a, "pin_memory"_a, "drop_last"_a, "timeout"_a,
        "prefetch_factor"_a, "persistent_workers"_a, "seed"_a, "device"_a.none(), "in_order"_a, "on_error"_a, "max_errors"_a,
        "max_error_fraction"_a, "gather"_a, "pinned_memory_limit"_a.none(), "stream"_a, "trace_batches"_a,
        "gpu_decode_threads"_a = 0);

  nb::class_<PyLoader>(m, "Loader")
      .def(nb::init<const PyDataset&, ferry::DataLoaderOptions, nb::object>(), "dataset"_a, "options"_a, "convert"_a.none())
      .def("begin", &PyLoader::iter, nb::rv_policy::reference_internal,
           "Starts the next epoch (ending one in progress); the loader is its own iterator.")
      .def(
          "__iter__", [](PyLoader& l) -> PyLoader& { return l; }, nb::rv_policy::reference_internal)
      .def("__next__", &PyLoader::next)
      .def("__len__", &PyLoader::len)
      .def("end", &PyLoader::end, "Ends the epoch in progress (its workers stop).")
      .def("release", &PyLoader::release, "Stops the workers and drops every Python reference (at exit).")
      .def(
          "set_epoch", [](PyLoader& l, std::uint64_t e) { l.impl().set_epoch(e); }, "epoch"_a, nb::call_guard<NoGil>())
      .def_prop_ro("next_epoch", [](PyLoader& l) { return l.impl().next_epoch(); })
      .def("stats", [](PyLoader& l) { return stats_dict(l.impl().stats()); })
      .def("reset_stats", [](PyLoader& l) { l.impl().reset_stats(); })
      .def(
          "state", [](PyLoader& l) { return l.impl().state().to_string(); }, nb::call_guard<NoGil>())
      .def(
          "restore", [](PyLoader& l, const std::string& text) { l.impl().restore(ferry::LoaderState::from_string(text)); },
          "state"_a, nb::call_guard<NoGil>())
      .def("write_trace", &PyLoader::write_trace, "path"_a, "Writes the recorded batches' timelines as a Chrome trace.")
      .def("last_pointers", &PyLoader::last_pointers, "The data pointers of the last batch's tensors (tests).");

  m.def("reference_batches", &reference_batches, "dataset"_a, "options"_a, "epoch"_a,
        "A plain C++ DataLoader's batches as bytes (tests).");
  m.def("cpp_seconds", &cpp_seconds, "dataset"_a, "options"_a, "warmup"_a, "batches"_a,
        "Seconds a C++ loop takes for `batches` batches of the same loader (benchmarks).");
  m.def("pinned_bytes", &ferry::PinnedPool::process_pinned_bytes,
        "Page-locked bytes ferry's pinned pools hold now, in this process (tests).");
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
