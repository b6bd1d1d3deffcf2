"""Python datasets on ferry's worker threads: the callables the C++ loader calls into.

See Note [Python datasets] in python/src/python_datasets.h. The loader's C++ workers take the GIL to call
these; everything here is safe to call from several threads at once.
"""

from __future__ import annotations

import collections.abc
import random
import sys
import threading
from typing import Any, Callable, List, Optional

from . import _ferry

_local = threading.local()


class WorkerInfo:
    """What ``ferry.get_worker_info()`` returns inside a worker: as torch's WorkerInfo."""

    __slots__ = ("id", "num_workers", "seed", "dataset")

    def __init__(self, id: int, num_workers: int, seed: int, dataset: Any) -> None:
        self.id = id
        self.num_workers = num_workers
        self.seed = seed
        self.dataset = dataset

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed})"


def get_worker_info() -> Optional[WorkerInfo]:
    """Inside a worker of a ``ferry.DataLoader`` over a Python dataset: the worker's ``id``,
    ``num_workers``, ``seed`` (the loader's seed + id) and ``dataset``; None on any other thread and
    with ``num_workers=0``, as ``torch.utils.data.get_worker_info()``. ferry's workers are threads
    of this process, so torch's own get_worker_info() (a per-process global) answers None there:
    an IterableDataset that shards by worker should call this one (or both)."""
    return getattr(_local, "info", None)


def sample_seed(index: Optional[int] = None) -> Optional[int]:
    """Inside a map-style Python dataset's ``__getitem__`` (or ``__getitems__``) called by a
    ``ferry.DataLoader``: a 64-bit seed of the sample's own, keyed by (the loader's seed, the epoch,
    the sample's index), on any worker kind and count. Seed a generator with it (``random.Random``,
    ``torch.Generator().manual_seed``, ``numpy.random.default_rng``) and the sample's random
    transforms come out the same for any ``num_workers``, worker type and resume; the next epoch
    gives other ones. ``index`` names another sample of the batch (``__getitems__`` has no single
    sample: pass each index). None outside a fetch, and in an iterable dataset. It is the first 64
    bits of the Generator that C++ datasets get as ``ctx.rng()``."""
    current = getattr(_local, "sample", None)
    if current is None:
        return None
    seed, epoch, i = current
    if index is not None:
        i = index
    if i is None:
        return None
    return _ferry.sample_seed(seed, epoch, int(i))


def reseed(seed: int, numpy_seed: Any = None) -> None:
    """Seeds Python's ``random``, torch's global generator and numpy's (if imported) with `seed`
    (numpy with `numpy_seed` where given: torch's workers seed it with a state of its own)."""
    random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32 if numpy_seed is None else numpy_seed)


def fetch_samples(dataset: Any, getitems: Optional[Callable], indices: List[int], seed: int, epoch: int,
                  seeding: bool) -> List[Any]:
    """A batch's samples, with ferry.sample_seed() answering for each (and, with `seeding`, the
    global generators seeded from it first: once a sample, or once a batch for __getitems__)."""
    try:
        if getitems is not None:
            _local.sample = (seed, epoch, None)
            if seeding and indices:
                reseed(_ferry.sample_seed(seed, epoch, int(indices[0])))
            return getitems(indices)
        out = []
        for i in indices:
            _local.sample = (seed, epoch, i)
            if seeding:
                reseed(_ferry.sample_seed(seed, epoch, int(i)))
            out.append(dataset[i])
        return out
    finally:
        _local.sample = None


def default_worker_type() -> str:
    """"thread" where this Python runs without a GIL (a free-threaded build with the GIL off),
    else "process"."""
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return "thread" if gil_enabled is not None and not gil_enabled() else "process"


def is_iterable(dataset: Any) -> bool:
    data = sys.modules.get("torch.utils.data")
    if data is not None and isinstance(dataset, data.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))


def _map_tensors(obj: Any, on_tensor: Callable[[Any], Any], on_other: Callable[[Any], Any]) -> Any:
    """`obj` with every tensor in it (in tuples, lists, dicts and namedtuples, as torch's
    pin_memory walks them) replaced by on_tensor(tensor), and every other leaf by on_other(leaf)."""
    import torch

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return on_tensor(o)
        if isinstance(o, (str, bytes)):
            return o
        if isinstance(o, collections.abc.Mapping):
            mapped = {k: walk(v) for k, v in o.items()}
            try:
                return type(o)(mapped)  # type: ignore[call-arg]  # a Mapping subclass that takes a dict
            except TypeError:
                return mapped
        if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple
            return type(o)(*(walk(v) for v in o))
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        if isinstance(o, collections.abc.Sequence):
            try:
                return type(o)([walk(v) for v in o])  # type: ignore[call-arg]  # a Sequence that takes a list
            except TypeError:
                return [walk(v) for v in o]
        return on_other(o)

    return walk(obj)


def pin(obj: Any, tensors: bool = True) -> Any:
    """torch's pin_memory rules: tensors (and any object with a pin_memory() method) are copied to
    page-locked memory; anything else is kept as it is. `tensors=False`: the tensors are pinned
    already (a worker process's slab) and kept as they are."""
    return _map_tensors(obj, (lambda t: t.pin_memory()) if tensors else (lambda t: t),
                        lambda o: o.pin_memory() if hasattr(o, "pin_memory") else o)


def to_device(obj: Any, device: Any) -> Any:
    """Every tensor in a batch (the same containers as pin()) moved to `device`, without waiting."""
    return _map_tensors(obj, lambda t: t.to(device, non_blocking=True), lambda o: o)
