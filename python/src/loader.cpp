// python/src/loader.cpp — ferry._ferry's loader: the C++ DataLoader over any of the module's
// datasets, its options, and batches handed to PyTorch through DLPack without a copy.
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
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <dlpack/dlpack.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "module.h"
#include "python_datasets.h"

namespace ferry_py {
namespace {

using namespace nb::literals;

// A delivered batch: ferry's tensors, or the Python object a Python dataset's collate made.
struct Delivery {
  std::vector<ferry::Tensor> tensors;
  PyRef object;
  std::vector<ferry::Tensor> sources;  // PyBatch::sources, let go with the GIL held (PyLoader::next)
};
void deliver(std::vector<ferry::Tensor>&& b, Delivery& d) { d.tensors = std::move(b); }
void deliver(ferry::LabeledBatch&& b, Delivery& d) { d.tensors = {std::move(b.image), std::move(b.label)}; }
void deliver(PyBatch&& b, Delivery& d) {
  d.object = std::move(b.object);
  d.tensors = std::move(b.tensors);
  d.sources = std::move(b.sources);
}

// A Python batch delivered with its tensors (Note [Python batches through the pipeline]): its
// structure and the tensors, converted, that the Python half puts back in it.
struct Delivered {
  nb::object structure;
  nb::list tensors;
};

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
    if (batch.object) {
      if (batch.tensors.empty()) return batch.object.take();
      return nb::cast(Delivered{batch.object.take(), std::move(out)});
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

ferry::DataLoaderOptions make_options(std::int64_t batch_size, bool shuffle, int num_workers, bool pin_memory, bool drop_last,
                                      double timeout, int prefetch_factor, bool persistent_workers, std::uint64_t seed,
                                      std::optional<int> device, bool in_order, const std::string& on_error,
                                      std::size_t max_errors, double max_error_fraction, const std::string& gather,
                                      std::optional<std::size_t> pinned_memory_limit, std::uintptr_t stream,
                                      std::int64_t trace_batches, int gpu_decode_threads) {
  // Conversions, then the library's rules (ferry::detail::validate_options, before any worker
  // starts; the loader checks again knowing whether the dataset is a stream). A conversion that
  // cannot be made is an OptionError too.
  auto cannot = [](const std::string& what) { throw ferry::OptionError("DataLoader: " + what); };
  ferry::DataLoaderOptions o;
  if (batch_size < 0) cannot("batch_size=" + std::to_string(batch_size) + " is not a number of samples");
  o.batch_size = static_cast<std::size_t>(batch_size);
  o.shuffle = shuffle;
  o.num_workers = num_workers;
  o.pin_memory = pin_memory;
  o.drop_last = drop_last;
  if (!(timeout >= 0) || timeout > 1e12) {
    std::ostringstream given;
    given << timeout;
    cannot("timeout=" + given.str() + " is not a number of seconds >= 0");
  }
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
  if (trace_batches < 0) cannot("trace_batches=" + std::to_string(trace_batches) + " is not a number of batches");
  if (trace_batches > 0) o.trace = std::make_shared<ferry::TraceRecorder>(trace_batches);
  ferry::detail::validate_options(o, /*streaming=*/false);
  return o;
}

nb::dict stats_dict(const ferry::LoaderStats& s) {
  nb::dict d;
  s.for_each([&](const char* name, const auto& value) { d[name] = value; });  // the one list: LoaderStats::for_each
  d["report"] = s.report();
  return d;
}

}  // namespace

void register_loader(nb::module_& m) {
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
  m.def(
      "pins", [](const ferry::DataLoaderOptions& o) { return ferry::detail::normalize_options(o, false).pin_memory; },
      "options"_a, "Whether a loader with these options pins its batches (a device implies pinning).");
  m.def("make_options", &make_options, "batch_size"_a, "shuffle"_a, "num_workers"_a, "pin_memory"_a, "drop_last"_a, "timeout"_a,
        "prefetch_factor"_a, "persistent_workers"_a, "seed"_a, "device"_a.none(), "in_order"_a, "on_error"_a, "max_errors"_a,
        "max_error_fraction"_a, "gather"_a, "pinned_memory_limit"_a.none(), "stream"_a, "trace_batches"_a,
        "gpu_decode_threads"_a = 0);

  nb::class_<Delivered>(m, "Delivered",
                        "A Python batch delivered with its tensors: its structure (a pickle whose persistent ids "
                        "are places in `tensors`) and the tensors (Note [Python batches through the pipeline]).")
      .def_ro("structure", &Delivered::structure)
      .def_ro("tensors", &Delivered::tensors);
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
}

}  // namespace ferry_py
