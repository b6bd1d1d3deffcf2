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
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <dlpack/dlpack.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/ferry.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// --- datasets -------------------------------------------------------------------------------------

// The labeled-image stream of tar shards (ferry::make_tar_images); each loader takes a copy.
using TarStream = decltype(ferry::make_tar_images(std::declval<const ferry::DatasetConfig&>()));

// A dataset as the module holds it. Registry datasets are type-erased (std::vector<Tensor>
// samples); GPU decode needs the typed ImageFolder or TarImages (the loader's direct mode); tar
// shards read as a stream are their own kind.

struct PyDataset {
  std::string name, config;
  std::optional<ferry::DynamicDataset> dynamic;
  std::optional<ferry::ImageFolder> gpu_images;
  std::optional<ferry::TarImages> gpu_tar;
  std::optional<TarStream> tar;

  bool has_size() const { return !tar; }
  std::size_t size() const {
    if (dynamic) return dynamic->size();
    if (gpu_images) return gpu_images->size();
    if (gpu_tar) return gpu_tar->size();
    throw nb::type_error(("dataset '" + name + "' is a stream (tar shards): it has no len()").c_str());
  }
  std::string repr() const { return "ferry.datasets." + name + "(\"" + config + "\")"; }
};

PyDataset make_dataset(const std::string& name, const std::string& config) {
  PyDataset d;
  d.name = name;
  d.config = config;
  if (name == "tar") {
    d.tar.emplace(ferry::make_tar_images(ferry::DatasetConfig("tar", config)));
  } else if (name == "image_folder" && ferry::DatasetConfig("image_folder", config).str("decode", "cpu") == "gpu") {
    d.gpu_images.emplace(ferry::make_image_folder(ferry::DatasetConfig("image_folder", config)));
  } else if (name == "tar_index" && ferry::DatasetConfig("tar_index", config).str("decode", "cpu") == "gpu") {
    d.gpu_tar.emplace(ferry::make_tar_index(ferry::DatasetConfig("tar_index", config)));
  } else {
    d.dynamic.emplace(ferry::DatasetRegistry::global().create(name, config));
  }
  return d;
}

// --- the loader -----------------------------------------------------------------------------------

std::vector<ferry::Tensor> fields(std::vector<ferry::Tensor>&& b) { return std::move(b); }
std::vector<ferry::Tensor> fields(ferry::LabeledBatch&& b) { return {std::move(b.image), std::move(b.label)}; }

// One epoch at a time over any dataset kind; every call on the consumer (Python's) thread.
class Loader {
 public:
  virtual ~Loader() = default;
  virtual void begin() = 0;
  /// The next batch's fields; false at the end of the epoch. Blocks (call without the GIL).
  virtual bool next(std::vector<ferry::Tensor>& out) = 0;
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

template <class D>
class LoaderOf final : public Loader {
 public:
  LoaderOf(D dataset, const ferry::DataLoaderOptions& options) : loader_(std::move(dataset), options) {}
  ~LoaderOf() override { end(); }

  void begin() override {
    end();
    it_.emplace(loader_.begin());
    advance_ = false;
  }
  bool next(std::vector<ferry::Tensor>& out) override {
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
    out = fields(std::move(*it));
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
  ferry::DataLoader<D> loader_;
  std::optional<typename ferry::DataLoader<D>::iterator> it_;
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
      : convert_(std::move(convert)), has_size_(dataset.has_size()), trace_(options.trace) {
    options.wait_poll = [] {
      nb::gil_scoped_acquire gil;
      return PyErr_CheckSignals() != 0;  // a handler raised (KeyboardInterrupt): stop waiting
    };
    options.wait_poll_period = std::chrono::milliseconds(50);
    if (dataset.tar) {
      if (options.shuffle)  // as PyTorch refuses shuffle for an IterableDataset
        throw nb::value_error("DataLoader: shuffle=True is not for a stream of tar shards, which decides its own order: "
                              "ferry.datasets.tar(..., shuffle=True) (the default) shuffles the shards and within a buffer");
      impl_ = make(*dataset.tar, options);
    } else if (dataset.gpu_images || dataset.gpu_tar) {
      if (!options.device)
        throw ferry::Error("dataset '" + dataset.name + "': decode=gpu needs DataLoader(device=...): the GPU decodes on the device stage");
      if (dataset.gpu_tar) impl_ = make(*dataset.gpu_tar, options);
      else impl_ = make(*dataset.gpu_images, options);
    } else {
      impl_ = make(*dataset.dynamic, options);
    }
  }

  PyLoader& iter() {
    impl_->begin();
    return *this;
  }

  nb::object next() {
    if (!impl_->live()) throw nb::stop_iteration();
    std::vector<ferry::Tensor> batch;
    bool got = false;
    try {
      nb::gil_scoped_release nogil;
      got = impl_->next(batch);
    } catch (const ferry::Interrupted&) {
      impl_->end();  // Ctrl-C: the workers stop; the loader can start another epoch
      if (PyErr_Occurred()) throw nb::python_error();
      throw;
    }
    if (!got) throw nb::stop_iteration();
    last_pointers_.clear();
    nb::list out;
    for (const ferry::Tensor& t : batch) {
      last_pointers_.push_back(reinterpret_cast<std::uintptr_t>(t.defined() ? t.raw() : nullptr));
      const bool as_bool = t.defined() && t.dtype() == ferry::DType::Bool && !convert_.is_none();
      nb::object cap = capsule_of(t, as_bool);
      if (convert_.is_none()) out.append(cap);
      else if (as_bool) out.append(convert_(cap).attr("view")(torch_bool()));  // see capsule_of
      else out.append(convert_(cap));
    }
    return nb::tuple(out);
  }

  std::size_t len() const {
    if (!has_size_) throw nb::type_error("this DataLoader's dataset is a stream (tar shards): it has no len()");
    return impl_->size();
  }
  void end() { impl_->end(); }
  Loader& impl() { return *impl_; }
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

  std::unique_ptr<Loader> impl_;
  static nb::object torch_bool() {
    static nb::object* b = new nb::object(nb::module_::import_("torch").attr("bool"));  // never freed: outlives finalization
    return *b;
  }
  nb::object convert_;
  bool has_size_;
  std::shared_ptr<ferry::TraceRecorder> trace_;
  std::vector<std::uintptr_t> last_pointers_;
};

// --- options --------------------------------------------------------------------------------------

ferry::DataLoaderOptions make_options(std::size_t batch_size, bool shuffle, int num_workers, bool pin_memory,
                                      bool drop_last, double timeout, int prefetch_factor, bool persistent_workers,
                                      std::uint64_t seed, std::optional<int> device, bool in_order,
                                      const std::string& on_error, std::size_t max_errors, double max_error_fraction,
                                      const std::string& gather, std::optional<std::size_t> pinned_memory_limit,
                                      std::uintptr_t stream, std::int64_t trace_batches, int gpu_decode_threads) {
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
  d["wall_seconds"] = s.wall_seconds;
  d["batches"] = s.batches;
  d["batches_per_second"] = s.batches_per_second();
  d["workers"] = s.workers;
  d["fetch_seconds"] = s.fetch_seconds;
  d["transform_seconds"] = s.transform_seconds;
  d["collate_seconds"] = s.collate_seconds;
  d["pin_seconds"] = s.pin_seconds;
  d["copy_seconds"] = s.copy_seconds;
  d["decode_seconds"] = s.decode_seconds;
  d["decode_threads"] = s.decode_threads;
  d["images_decoded"] = s.images_decoded;
  d["gather_seconds"] = s.gather_seconds;
  d["rows_gathered"] = s.rows_gathered;
  d["device_gather"] = s.device_gather;
  d["wait_seconds"] = s.wait_seconds;
  d["pinning"] = s.pinning;
  d["device"] = s.device;
  d["numa_node"] = s.numa_node;
  d["samples_skipped"] = s.samples_skipped;
  d["samples_replaced"] = s.samples_replaced;
  d["data_errors"] = s.data_errors;
  d["io_errors"] = s.io_errors;
  d["stuck_samples"] = s.stuck_samples;
  d["io_retries"] = s.io_retries;
  d["timeouts"] = s.timeouts;
  d["abandoned_workers"] = s.abandoned_workers;
  d["first_errors"] = s.first_errors;
  d["bottleneck"] = s.bottleneck();
  d["report"] = s.report();
  return d;
}

// The batches a plain C++ DataLoader makes for (dataset, options, epoch), each field's bytes: what
// the tests compare the Python loader's tensors with.
std::vector<std::vector<nb::bytes>> reference_batches(const PyDataset& dataset, const ferry::DataLoaderOptions& options,
                                                      std::uint64_t epoch) {
  if (!dataset.dynamic) throw ferry::Error("_reference_batches: registry datasets only");
  std::vector<std::vector<ferry::Tensor>> batches;
  {
    nb::gil_scoped_release nogil;
    ferry::DataLoader loader(*dataset.dynamic, options);
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
  nb::gil_scoped_release nogil;
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
  if (dataset.gpu_images) return run(ferry::DataLoader(*dataset.gpu_images, options));
  if (dataset.gpu_tar) return run(ferry::DataLoader(*dataset.gpu_tar, options));
  if (dataset.dynamic) return run(ferry::DataLoader(*dataset.dynamic, options));
  throw ferry::Error("cpp_seconds: map-style datasets only");
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

void raise(PyObject* type, const char* message, std::initializer_list<std::pair<const char*, nb::object>> attrs = {}) {
  nb::object exc = nb::steal(PyObject_CallFunction(type, "s", message));
  if (!exc.is_valid()) return;  // the call set its own error
  for (const auto& [k, v] : attrs) nb::setattr(exc, k, v);
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
    raise(g_exc.worker, e.what(), {{"worker", nb::cast(e.worker())}, {"batch", nb::cast(e.batch())}});
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
      .def_ro("config", &PyDataset::config);
  m.def("make_dataset", &make_dataset, "name"_a, "config"_a,
        "The registry's dataset `name` from a 'key=value,...' configuration (and 'tar', and "
        "image_folder with decode=gpu).");
  m.def("registered", [] { return ferry::DatasetRegistry::global().names(); }, "Dataset names the registry knows.");
  m.def("help", [](const std::string& name) { return ferry::DatasetRegistry::global().help(name); }, "name"_a,
        "The configuration keys of a registered dataset.");
  m.def("load_plugin", [](const std::string& path) { return ferry::DatasetRegistry::global().load_plugin(path); },
        "path"_a, "Loads a dataset plugin library; returns the names it registered.");

  nb::class_<ferry::DataLoaderOptions>(m, "Options");
  m.def("make_options", &make_options, "batch_size"_a, "shuffle"_a, "num_workers"_a, "pin_memory"_a, "drop_last"_a,
        "timeout"_a, "prefetch_factor"_a, "persistent_workers"_a, "seed"_a, "device"_a.none(), "in_order"_a,
        "on_error"_a, "max_errors"_a, "max_error_fraction"_a, "gather"_a, "pinned_memory_limit"_a.none(),
        "stream"_a, "trace_batches"_a, "gpu_decode_threads"_a = 1);

  nb::class_<PyLoader>(m, "Loader")
      .def(nb::init<const PyDataset&, ferry::DataLoaderOptions, nb::object>(), "dataset"_a, "options"_a, "convert"_a.none())
      .def("__iter__", &PyLoader::iter, nb::rv_policy::reference_internal)
      .def("__next__", &PyLoader::next)
      .def("__len__", &PyLoader::len)
      .def("end", &PyLoader::end, "Ends the epoch in progress (its workers stop).")
      .def("set_epoch", [](PyLoader& l, std::uint64_t e) { l.impl().set_epoch(e); }, "epoch"_a)
      .def_prop_ro("next_epoch", [](PyLoader& l) { return l.impl().next_epoch(); })
      .def("stats", [](PyLoader& l) { return stats_dict(l.impl().stats()); })
      .def("reset_stats", [](PyLoader& l) { l.impl().reset_stats(); })
      .def("state", [](PyLoader& l) { return l.impl().state().to_string(); })
      .def("restore", [](PyLoader& l, const std::string& text) { l.impl().restore(ferry::LoaderState::from_string(text)); },
           "state"_a)
      .def("write_trace", &PyLoader::write_trace, "path"_a, "Writes the recorded batches' timelines as a Chrome trace.")
      .def("last_pointers", &PyLoader::last_pointers, "The data pointers of the last batch's tensors (tests).");

  m.def("reference_batches", &reference_batches, "dataset"_a, "options"_a, "epoch"_a,
        "A plain C++ DataLoader's batches as bytes (tests).");
  m.def("cpp_seconds", &cpp_seconds, "dataset"_a, "options"_a, "warmup"_a, "batches"_a,
        "Seconds a C++ loop takes for `batches` batches of the same loader (benchmarks).");
  m.def("pinned_bytes", &ferry::PinnedPool::process_pinned_bytes,
        "Page-locked bytes ferry's pinned pools hold now, in this process (tests).");
  m.def("cuda_available", [] { return ferry::cuda::device_count() > 0; }, "Whether ferry sees a CUDA device.");
}
