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
                  seeding: bool, take: Optional[Callable[[Any], Any]] = None) -> List[Any]:
    """A batch's samples, with ferry.sample_seed() answering for each (and, with `seeding`, the
    global generators seeded from it first: once a sample, or once a batch for __getitems__).
    `take`: what is kept of each sample as __getitem__ returns it (not with __getitems__)."""
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
            out.append(dataset[i] if take is None else take(dataset[i]))
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


class Place:
    """Where a tensor of a batch going through ferry's pipeline stood: its index among the batch's
    tensors, and its dtype (the delivered tensor is viewed as it, should the two differ)."""

    __slots__ = ("index", "dtype")

    def __init__(self, index: int, dtype: Any) -> None:
        self.index, self.dtype = index, dtype


class _Foreign(Exception):
    """A tensor ferry's pipeline does not take as it is."""


_DTYPES = frozenset(_ferry.DTYPE_NAMES)  # the dtypes ferry carries, by torch's names


def host_batch(batch: Any) -> Any:
    """A batch collated on a worker thread (or the loader's own thread), as a TensorBatch for
    ferry's pipeline; None where it holds no tensor, or one the pipeline does not take as it is.

    Note [Thread batches through the pipeline]
    With pin_memory or a device, a batch a worker thread collated (or the loader's own thread,
    num_workers=0) crosses ferry's pipeline as a worker process's slab does (Note [Python batches
    through the pipeline] in python/src/python_datasets.h): its tensors go to the C++ loader as
    views of torch's memory (no copy), held by a reference to the tensors, the rest of the batch
    as its structure, each tensor replaced by a Place. ferry's pin thread copies the tensors into
    one block of the loader's pinned pool (one budget, one fence), and with a device the device
    stage makes the copy, where torch's pin_memory() copied each tensor on the worker and the
    consumer's thread queued the device copy. The views, and with them the reference, go with the
    batch to the consumer's thread, which lets them go holding the GIL: the pin thread never
    waits for the GIL, nor takes it as Python exits (Note [Threads Python ends at exit] in
    python/src/gil.h). The consumer's thread puts the delivered tensors back (rebuild_host), pinning any other
    object with a pin_memory() method, so the batch is what torch's pin_memory() makes: containers
    rebuilt as it rebuilds them, every other object kept as it is (not copied), each tensor
    occurrence its own pinned tensor. A batch holding a tensor the pipeline does not take as it is
    (a subclass, one requiring grad, not contiguous, not on the CPU, sparse, quantized, or of a
    dtype ferry has not) is pinned by torch on the worker, as before."""
    import torch

    tensors: List[Any] = []
    views: List[Any] = []  # (address, dtype name, shape) of each

    def on_tensor(t: Any) -> Any:
        name = str(t.dtype)[6:]  # "torch.float32"
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad \
                or t.is_quantized or t.is_nested or name not in _DTYPES or not t.is_contiguous():
            raise _Foreign
        tensors.append(t)
        views.append((t.data_ptr(), name, tuple(t.shape)))
        return Place(len(tensors) - 1, t.dtype)

    try:
        structure = _map_tensors(batch, on_tensor, lambda o: o)
    except _Foreign:
        return None
    if not tensors:
        return None
    return _ferry.TensorBatch.of_host(structure, tensors, views)


def rebuild_host(structure: Any, tensors: List[Any], pinning: bool) -> Any:
    """The batch host_batch() took apart, with the delivered tensors in their places (and, with
    `pinning`, objects with a pin_memory() method pinned, as torch's pin_memory asks them)."""
    def on_other(o: Any) -> Any:
        if type(o) is Place:
            t = tensors[o.index]
            return t if t.dtype == o.dtype else t.view(o.dtype)
        return o.pin_memory() if pinning and hasattr(o, "pin_memory") else o

    return _map_tensors(structure, lambda t: t, on_other)


def to_device(obj: Any, device: Any) -> Any:
    """Every tensor in a batch (the same containers as pin()) moved to `device`, without waiting."""
    return _map_tensors(obj, lambda t: t.to(device, non_blocking=True), lambda o: o)
