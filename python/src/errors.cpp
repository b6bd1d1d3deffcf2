// python/src/errors.cpp — ferry's exceptions in Python: ferry.Error and its subclasses, raised
// with the C++ error's message and fields; a Python dataset's own exception as the cause.
#include <nanobind/stl/string.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "gil.h"
#include "module.h"

namespace ferry_py {
namespace {

using namespace nb::literals;

struct Exceptions {
  PyObject* error = nullptr;
  PyObject* worker = nullptr;
  PyObject* timeout = nullptr;
  PyObject* data = nullptr;
  PyObject* io = nullptr;
  PyObject* cuda = nullptr;
  PyObject* interrupted = nullptr;
  PyObject* option = nullptr;
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
  } catch (const ferry::OptionError& e) {
    raise(g_exc.option, e.what());
  } catch (const ferry::Error& e) {
    raise(g_exc.error, e.what());
  }
}

}  // namespace

void register_errors(nb::module_& m) {
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
  // A ValueError too: PyTorch's DataLoader raises ValueError for an option out of range.
  nb::object option_bases = nb::steal(PyTuple_Pack(2, g_exc.error, PyExc_ValueError));
  if (!option_bases.is_valid()) throw nb::python_error();
  g_exc.option = new_exception(m, "OptionError", option_bases.ptr(),
                               "A loader option out of its range, or options that conflict; names the option and "
                               "the value given. Also a ValueError.");
  nb::register_exception_translator(translate);
}

}  // namespace ferry_py
