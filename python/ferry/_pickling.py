"""How a Python dataset travels to worker processes (Note [Datasets by value]).

Note [Datasets by value]
The dataset, collate_fn and worker_init_fn are pickled once a loader (and again at an epoch's
start where non-persistent workers must see a changed dataset), by cloudpickle: what a script's
`__main__` or a notebook cell defines travels by value (its class's code), what a module defines
by reference (the module is imported once, in the loader's zygote, Note [Zygote]). Tensors go by
torch's own reductions (their storage moved to shared memory, which the workers then map, so an
in-place change in the main process is seen there too); numpy arrays by value.

Whether a dataset changed is told by its fingerprint: the same pickling with each tensor named by
its identity and version counter instead of its storage, so that taking one costs about what the
pickling of its Python objects costs, and shares nothing. At an epoch's start the question is
first asked of a quick fingerprint: the same, pickled without pickle's memo (its "fast" mode), so
an object reached twice is written twice and identity is not recorded, only values, and with
classes and functions named by their identity (a class redefined is another class), and a class
or function that travels by value (a script's, a notebook's) with what its full pickle holds that
can change: its data attributes, defaults, closures, and the globals its code names. For a million
(path, label) tuples it took 0.08-0.16 s where the memo's took 0.5-0.9 s (2-core machine). When the
quick fingerprints match, nothing of value changed and the dataset is not sent again; when they
differ, the full fingerprint decides and the dataset is sent. A dataset with a cycle, or one whose
shared objects make the quick form grow past four times the full one, gets no quick fingerprint.
"""

from __future__ import annotations

import io
import multiprocessing.reduction
import pickle
import sys
import threading
import types
from collections import ChainMap
from typing import Any, List, Optional, Tuple

import cloudpickle

from . import _ferry


# Note [What a fork would have shared]
# torch's fork-started workers take a dataset holding a lock, a logger's handler or the process's
# standard streams as the fork copies them; a pickle refuses them ("cannot pickle '_thread.lock'").
# A dataset sent by value takes them as a fork would give them, but safe: each lock (Lock, RLock)
# arrives a new one, unlocked (a fork copies a lock held by another thread held, for ever), and
# sys.stdin, sys.stdout and sys.stderr arrive as the worker's own (the same descriptors, which the
# worker inherited). A fingerprint writes them so too, by kind, so they are never a change. Any other open
# file still cannot travel: the refusal names where it is (Note [Datasets by value]) and the way
# out (open it in the worker, in __getitem__ or worker_init_fn, or worker_type="thread").
_LOCKS = (type(threading.Lock()), type(threading.RLock()))


def _std_stream(name: str) -> Any:
    return getattr(sys, name)


def _fork_like(obj: Any) -> Any:
    """The reduction of an object a fork would have shared (Note [What a fork would have shared]),
    or None."""
    kind = type(obj)
    if kind in _LOCKS:
        return (threading.RLock if kind is _LOCKS[1] else threading.Lock), ()
    if isinstance(obj, io.IOBase):
        for name in ("stdin", "stdout", "stderr"):
            if obj is getattr(sys, name, None) or obj is getattr(sys, f"__{name}__", None):
                return _std_stream, (name,)
    return None


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with the reductions torch registers for multiprocessing (tensors by shared
    memory), and locks and the standard streams as a fork would give them."""

    dispatch_table = ChainMap(multiprocessing.reduction.ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
                              cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        return _fork_like(obj) or super().reducer_override(obj)


# Note [Replies by the main process's names]
# A worker's batch, sample or exception may hold a class or function of the user's script: a
# namedtuple made there, a batch class a collate_fn returns. The main process has them as
# `__main__.Name`, and torch's fork-started workers pickle them by that name. ferry's worker may
# not hold them under it: one forked from a zygote received them by value (Note [Datasets by
# value]) and its own `__main__` is ferry's; a spawn or forkserver worker's script runs as
# `__mp_main__`. Plain pickling then fails ("attribute lookup Pair on __main__ failed", or "not
# the same object as __main__.Pair"). ReplyPickler names such a class or function by its
# qualified name in the main process's `__main__` instead (main_attr), so the main process gets
# its own object, as with torch. A class local to a function cannot be named, and fails as with torch.


def _in_main(qualname: str) -> Any:
    """The object `qualname` names in this process's `__main__`, or None."""
    obj: Any = sys.modules.get("__main__")
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def main_attr(qualname: str) -> Any:
    """The object `qualname` names in this process's `__main__` (a worker's reply unpickled)."""
    obj = _in_main(qualname)
    if obj is None:
        raise pickle.UnpicklingError(
            f"a worker's batch holds __main__.{qualname}, which this process's __main__ does not define "
            "(a class or function of the script the workers run must be defined at the script's top level)")
    return obj


class ReplyPickler(multiprocessing.reduction.ForkingPickler):
    """What a worker sends back: torch's multiprocessing reductions, and a class or function of the
    user's `__main__` by its name there (Note [Replies by the main process's names])."""

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, type) or type(obj) is types.FunctionType) and getattr(obj, "__module__", None) == "__main__":
            name = getattr(obj, "__qualname__", "")
            if "<locals>" not in name and _in_main(name) is not obj:
                return main_attr, (name,)
        return NotImplemented


def _named(*key: Any) -> Any:  # what fingerprints write in an object's place: only pickled, never unpickled
    return key


class _Fingerprinter(cloudpickle.Pickler):
    """cloudpickle with every tensor replaced by (id, version): no storage shared, no bytes copied."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        import torch

        self._tensor = torch.Tensor
        self.tensors = 0

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, self._tensor):
            self.tensors += 1
            return _named, (id(obj), obj._version)
        like = _fork_like(obj)  # as dumps() writes it: where no tensor is in it, this pickle is what is sent
        if like is not None:
            return like
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """`obj` as bytes a worker process can load (pickle.loads, with cloudpickle importable)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def fingerprint(obj: Any) -> Tuple[bytes, bool]:
    """Bytes that change when `obj` (as it would be pickled) changes, tensors named by identity and
    version; and whether those bytes are `obj`'s pickle as dumps() would make it (no tensor in it)."""
    buf = io.BytesIO()
    pickler = _Fingerprinter(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.tensors == 0


class _Quick(pickle.Pickler):
    """pickle without the memo, tensors named by identity and version, classes and functions by
    identity. A class or function that travels by value (a script's, a notebook's) is written
    once a fingerprint with what its full pickle holds that can change: a class's data
    attributes; a function's defaults, closure and the globals its code names, with each of its
    class's methods' globals (a global the script changes between epochs is a change, as the
    workers would see it). Not cloudpickle: its by-value classes lead back to themselves through
    their methods, a cycle that pickling without the memo cannot take."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        import torch

        self._tensor = torch.Tensor
        self._written: set = set()  # by-value classes and functions already written out
        self.fast = True  # no memo: each object reached is written again (a cycle raises ValueError)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, self._tensor):
            return _named, (id(obj), obj._version)
        like = _fork_like(obj)
        if like is not None:
            return like
        if not isinstance(obj, _CODE_TYPES) or obj is _named:
            return NotImplemented  # (the namer itself is written by name)
        if id(obj) in self._written or not _by_value(obj):
            return _named, (id(obj),)
        self._written.add(id(obj))
        if isinstance(obj, type):
            data, functions = [], []
            for k, v in sorted(vars(obj).items()):
                f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                if isinstance(f, types.FunctionType):
                    functions.append(f)
                elif not k.startswith("__") and not callable(v) and not isinstance(v, _DESCRIPTORS):
                    data.append((k, v))
            return _named, (id(obj), tuple(data), tuple(_globals_of(f) for f in functions))
        if isinstance(obj, types.FunctionType):
            cells = tuple(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            return _named, (id(obj), obj.__defaults__, obj.__kwdefaults__, cells, _globals_of(obj))
        return _named, (id(obj),)


def _by_value(obj: Any) -> bool:
    """Whether cloudpickle writes `obj` (a class or function) by value: its module is __main__ or
    cannot be imported, or its module does not hold it under its name (a lambda, a function or
    class made inside a function)."""
    if not isinstance(obj, (type, types.FunctionType)):
        return False
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module is sys.modules.get("__main__"):
        return True
    found: Any = module
    for part in getattr(obj, "__qualname__", "<>").split("."):
        found = getattr(found, part, None)
    return found is not obj


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents  # an empty cell raises
    except ValueError:
        return False
    return True


def _globals_of(f: types.FunctionType) -> Tuple[Tuple[str, Any], ...]:
    """The globals `f`'s code names (its nested functions' too), as they are now."""
    names: set = set()
    codes = [f.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    g = f.__globals__
    return tuple((n, g[n]) for n in sorted(names) if n in g)


_CODE_TYPES = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)
_DESCRIPTORS = (property, types.MemberDescriptorType, types.GetSetDescriptorType)  # a class's, not data


def quick_fingerprint(obj: Any, limit: int) -> Optional[bytes]:
    """The digest of `obj`'s values, pickled without the memo (tensors named as by fingerprint(),
    classes and functions by identity); None where that cannot be taken: a cycle, more than `limit`
    bytes, or anything that does not pickle."""
    out = _ferry.Digest(limit)  # written to as the pickle is made (which is not kept); past the limit, a ValueError
    pickler = _Quick(out)
    try:
        pickler.dump(obj)
    except Exception:  # noqa: BLE001  (then the full fingerprint answers)
        return None
    return out.digest()


def _check(obj: Any) -> Optional[BaseException]:
    try:
        _Fingerprinter(io.BytesIO()).dump(obj)
    except Exception as exc:  # noqa: BLE001  (any failure of pickling is the answer)
        return exc
    return None


def _parts(obj: Any) -> List[Tuple[str, Any]]:
    """The named parts of `obj` that pickling would visit: attributes, items, closure cells."""
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in list(obj.items())[:10000]]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(list(obj)[:10000])]
    parts: List[Tuple[str, Any]] = []
    closure = getattr(obj, "__closure__", None)
    if closure:
        names = getattr(getattr(obj, "__code__", None), "co_freevars", ())
        for name, cell in zip(names, closure, strict=True):
            try:
                parts.append((f" (closure variable {name!r})", cell.cell_contents))
            except ValueError:
                pass
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        parts.extend((f".{k}", v) for k, v in state.items())
    for slot in getattr(type(obj), "__slots__", ()):
        if isinstance(slot, str) and hasattr(obj, slot):
            parts.append((f".{slot}", getattr(obj, slot)))
    return parts


def find_unpicklable(obj: Any, name: str) -> Optional[Tuple[str, BaseException]]:
    """Where in `obj` (named `name`) pickling fails: the deepest part that fails by itself, as a
    path ("dataset.files.handle") and the exception; None if `obj` pickles."""
    error = _check(obj)
    if error is None:
        return None
    path, seen = name, {id(obj)}
    for _ in range(32):  # deep enough for any dataset; a cycle ends at `seen`
        for part, value in _parts(obj):
            if id(value) in seen:
                continue
            e = _check(value)
            if e is not None:
                path, obj, error = path + part, value, e
                seen.add(id(value))
                break
        else:
            break
    return path, error


def check_picklable(payload: tuple) -> "tuple[bytes, bool]":
    """The payload's fingerprint (Note [Datasets by value]), or a TypeError naming what in the
    dataset, collate_fn or worker_init_fn cannot travel to a worker process."""
    try:
        return fingerprint(payload)
    except Exception:  # noqa: BLE001
        pass
    found = None
    for name, obj in zip(("dataset", "", "collate_fn", "worker_init_fn"), payload, strict=False):
        if name:
            found = find_unpicklable(obj, name)
            if found is not None:
                break
    where, exc = found if found is not None else ("the dataset", RuntimeError("it does not pickle"))
    raise TypeError(
        f"DataLoader: worker processes need the dataset, collate_fn and worker_init_fn to pickle, and {where} "
        f"({type(exc).__name__}: {exc}) does not: a script's or notebook's classes, functions and lambdas travel "
        "by value, and locks and the standard streams arrive as a fork would give them, but an open file or "
        "socket, a CUDA tensor or a generator cannot cross a process. Make it in the worker (in __getitem__, or "
        "worker_init_fn), or pass worker_type='thread'") from exc


def digest(data: Any) -> bytes:
    """The digest of `data`, a buffer (Note [A fingerprint's digest])."""
    d = _ferry.Digest()
    d.update(data)
    return d.digest()


def baseline(payload: tuple, limit: int) -> Tuple[Optional[bytes], Optional[bytes], Optional[str]]:
    """What a loader zygote forked from the main process tells it of the payload it holds (Note
    [Loader zygotes forked from the main process]): its quick fingerprint (at most `limit` bytes);
    where that cannot be taken, the digest of its full one; where the payload does not pickle,
    check_picklable's message naming what fails."""
    quick = quick_fingerprint(payload, limit)
    if quick is not None:
        return quick, None, None
    try:
        full, _ = check_picklable(payload)
    except TypeError as exc:
        return None, None, str(exc)
    return None, digest(full), None
