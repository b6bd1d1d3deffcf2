// python/src/datasets.cpp — ferry._ferry's datasets: the registry's, token windows, mixtures,
// and the Python datasets the package hands over (ferry/_bridge.py makes their callables).
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>

#include "ferry/loaders/storage.h"
#include "python_datasets.h"

namespace ferry_py {
namespace {

using namespace nb::literals;

// `config`: typed values (each key's items as they are: what ferry.datasets passes), or the
// registry's "key=value,..." text.
PyDataset make_dataset_from(const ferry::DatasetConfig& config, std::optional<double> timeout) {
  PyDataset d;
  d.name = config.dataset();
  d.config = config.text();
  std::optional<ferry::ReadDeadline> deadline;  // the reads made while it is built (ferry/loaders/storage.h)
  if (timeout) deadline.emplace(std::chrono::milliseconds(static_cast<long long>(*timeout * 1000.0 + 0.5)));
  d.opened.emplace(ferry::DatasetRegistry::global().open(config, &d.classes));
  if (const auto* seqs = std::get_if<ferry::TokenSequences>(&*d.opened)) {  // dict batches
    d.fields = seqs->field_names();
    d.token_type = ferry::token_type_name(seqs->corpus().type());
  } else if (const auto* table = std::get_if<ferry::TableTokens>(&*d.opened)) {
    d.fields = table->field_names();
  }
  return d;
}

PyDataset make_dataset(const std::string& name, const ferry::DatasetConfig::Values& values, std::optional<double> timeout) {
  return make_dataset_from(ferry::DatasetConfig(name, values), timeout);
}

PyDataset make_dataset_text(const std::string& name, const std::string& config, std::optional<double> timeout) {
  return make_dataset_from(ferry::DatasetConfig(name, config), timeout);
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

}  // namespace

void register_datasets(nb::module_& m) {
  nb::class_<PyDataset>(m, "Dataset", "A dataset ferry reads with its own threads (make one with ferry.datasets).")
      .def("__len__", &PyDataset::size)
      .def("__repr__", &PyDataset::repr)
      .def_ro("name", &PyDataset::name)
      .def_ro("config", &PyDataset::config)
      .def_ro("fields", &PyDataset::fields, "Field names when batches are dicts (token sequences), else empty.")
      .def_ro("token_type", &PyDataset::token_type, "Token sequences: the file's token type (\"uint16\", ...); else empty.")
      .def_ro("classes", &PyDataset::classes,
              "An image folder's class names, sorted (label i is classes[i], as torchvision's ImageFolder); else empty.")
      .def_prop_ro(
          "class_to_idx",
          [](const PyDataset& d) {
            nb::dict out;
            for (std::size_t i = 0; i < d.classes.size(); ++i) out[nb::str(d.classes[i].c_str())] = i;
            return out;
          },
          "An image folder's {class name: label}, as torchvision's ImageFolder; else empty.");
  m.def("raw_token_windows", &raw_token_windows, "dataset"_a,
        "A token dataset with raw windows over the same open corpus, and the dtype they widen to.");
  m.def("token_gather_problem", &token_gather_problem, "dataset"_a,
        "Why the GPU cannot gather a token dataset's windows from its file's mapping ('' when it can).");
  m.def("make_mixture", &make_mixture, "sources"_a, "weights"_a, "seed"_a, "block"_a, "size"_a.none(), "schedule"_a,
        "A weighted mixture of ferry datasets (C++ ferry::Mixture).");
  m.def("make_dataset", &make_dataset, "name"_a, "config"_a, "timeout"_a.none() = nb::none(),
        "The registry's dataset `name` from typed options: each key's items as they are (one for a scalar), "
        "nothing escaped or split (and 'tar', and image_folder with decode=gpu); its object-store reads bounded by "
        "`timeout` seconds (ferry::ReadDeadline).");
  m.def("make_dataset", &make_dataset_text, "name"_a, "config"_a, "timeout"_a.none() = nb::none(),
        "The same from the registry's 'key=value,...' text (a backslash escapes ',', '=', ':' and itself).");
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
      "registered", [] { return ferry::DatasetRegistry::global().names(); }, "Dataset names the registry knows.");
  m.def(
      "help", [](const std::string& name) { return ferry::DatasetRegistry::global().help(name); }, "name"_a,
      "The configuration keys of a registered dataset.");
  m.def(
      "dataset_schema",
      [](const std::string& name) {
        const ferry::DatasetSchema* schema = ferry::DatasetRegistry::global().schema(name);
        if (!schema) throw nb::key_error(("no schema for dataset '" + name + "' (a plugin's declares none)").c_str());
        nb::list out;
        for (const ferry::DatasetOption& o : schema->options) {
          nb::dict d;
          d["key"] = o.key;
          d["kind"] = ferry::DatasetOption::kind_name(o.kind);
          d["default"] = o.fallback.empty() ? nb::none() : nb::cast(o.fallback);
          d["required"] = o.required;
          d["min"] = o.min ? nb::cast(*o.min) : nb::none();
          d["max"] = o.max ? nb::cast(*o.max) : nb::none();
          d["choices"] = o.choices;
          d["doc"] = o.doc;
          out.append(d);
        }
        return out;
      },
      "name"_a,
      "A dataset's options as its schema declares them (ferry/loaders/registry.h, DatasetSchema): a list of dicts "
      "(key, kind, default as text or None, required, min, max, choices, doc).");
  m.def(
      "load_plugin", [](const std::string& path) { return ferry::DatasetRegistry::global().load_plugin(path); }, "path"_a,
      "Loads a dataset plugin library; returns the names it registered.");
}

}  // namespace ferry_py
