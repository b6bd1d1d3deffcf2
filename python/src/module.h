// python/src/module.h — the parts of ferry._ferry, each registered by the file that holds it
// (module.cpp calls them in this order).
#pragma once

#include <nanobind/nanobind.h>

namespace ferry_py {

namespace nb = nanobind;

/// ferry.Error and its subclasses, and the translator of C++ errors to them (errors.cpp).
void register_errors(nb::module_& m);
/// Datasets: the registry's, token windows, mixtures, Python datasets (datasets.cpp).
void register_datasets(nb::module_& m);
/// The loader and its options (loader.cpp).
void register_loader(nb::module_& m);
/// A fast digest of a byte stream, for a dataset's quick fingerprint (digest.cpp).
void register_digest(nb::module_& m);
/// Shared blocks for worker processes' batches, and the batches they make (blocks.cpp).
void register_blocks(nb::module_& m);
/// ferry.Tokenizer (text.cpp).
void register_text(nb::module_& m);
/// What tests and benchmarks call (hooks.cpp).
void register_hooks(nb::module_& m);

}  // namespace ferry_py
