// python/src/gil.h — the Python module's internals: the GIL and references to Python objects,
// taken and dropped from any of ferry's threads (Note [Threads Python ends at exit]).
#pragma once

#include <Python.h>
#include <cxxabi.h>
#include <nanobind/nanobind.h>

#include <chrono>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "ferry/ferry.h"

namespace ferry_py {

namespace nb = nanobind;

// Note [Threads Python ends at exit]
// A thread that asks for the GIL once the interpreter is finalizing is ended by Python
// (3.11-3.13: PyThread_exit_thread, which unwinds the thread's stack as pthread_exit does): a
// worker abandoned inside the dataset (a timeout, Ctrl-C) whose call returns while the program
// exits, or a daemon thread of the user's that comes back from a loader's call (NoGil). Unwinding
// ferry's frames would release a GIL the thread does not hold ("Fatal Python error:
// PyGILState_Release: thread state ... must be current when releasing") and meet handlers
// that may not swallow the unwind; either aborts the process. The thread waits here instead, its
// stack as it was, until the process exits (Python 3.14 parks such threads the same way).
[[noreturn]] inline void park_until_exit() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// Whether the interpreter is finalizing: a thread of ferry's that asked for the GIL now would be
// ended (Note [Threads Python ends at exit]).
inline bool finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

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
inline void restore_thread(PyThreadState* state) {
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

inline Callable callable(nb::object f) { return std::make_shared<PyRef>(std::move(f)); }

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

}  // namespace ferry_py
