"""Python datasets on ferry's worker threads: the callables the C++ loader calls into.

See Note [Python datasets] in python/src/module.cpp. The loader's C++ workers take the GIL to call
these; everything here is safe to call from several threads at once.
"""

from __future__ import annotations

import collections.abc
import random
import sys
import threading
import warnings
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


def reseed(seed: int) -> None:
    """Seeds Python's ``random``, torch's global generator and numpy's (if imported) with `seed`."""
    random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


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


def pin(obj: Any) -> Any:
    """torch's pin_memory rules: tensors (and any object with a pin_memory() method) are copied to
    page-locked memory; anything else is kept as it is."""
    return _map_tensors(obj, lambda t: t.pin_memory(),
                        lambda o: o.pin_memory() if hasattr(o, "pin_memory") else o)


def to_device(obj: Any, device: Any) -> Any:
    """Every tensor in a batch (the same containers as pin()) moved to `device`, without waiting."""
    return _map_tensors(obj, lambda t: t.to(device, non_blocking=True), lambda o: o)


class Unbatched:
    """collate_fn applied to each sample alone (batch_size=None), picklable for worker processes."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: List[Any]) -> Any:
        return self.collate_fn(samples[0])


def make_dataset(dataset: Any, *, batch_size: Optional[int], shuffle: bool, sampler: Any, batch_sampler: Any,
                 drop_last: bool, collate_fn: Optional[Callable], pin_memory: bool,
                 worker_init_fn: Optional[Callable], generator: Any, num_workers: int, worker_type: str,
                 multiprocessing_context: Any, sample_seeding: bool = False, prefetch_factor: int = 2,
                 pinned_memory_limit: Optional[int] = None) -> "tuple[Any, dict, Any]":
    """The C++ dataset over a Python one, the options the engine must run it with, and the worker
    processes (a ferry._procs.Pool, or None)."""
    iterable = is_iterable(dataset)
    if not iterable and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            "DataLoader: dataset must be a ferry dataset, a map-style dataset (__getitem__ and __len__) or an "
            f"iterable one (__iter__), got {type(dataset).__name__}")
    if batch_sampler is not None and (batch_size != 1 or shuffle or sampler is not None or drop_last):
        raise ValueError("DataLoader: batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    if sampler is not None and shuffle:
        raise ValueError("DataLoader: sampler option is mutually exclusive with shuffle")
    if iterable and (shuffle or sampler is not None or batch_sampler is not None):
        what = "shuffle" if shuffle else "sampler" if sampler is not None else "batch_sampler"
        raise ValueError(f"DataLoader: an iterable dataset decides its own order: {what} is not for it")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"DataLoader: batch_size must be an int >= 1 or None, got {batch_size!r}")

    import torch  # a Python dataset's batches are torch's
    import torch.utils.data as data

    if worker_type not in ("process", "thread"):
        raise ValueError(f"DataLoader: worker_type must be 'process' or 'thread', got {worker_type!r}")
    if sample_seeding and iterable:
        raise ValueError("DataLoader: sample_seeding is for map-style datasets (an iterable dataset has no "
                         "sample indices to key seeds by)")
    if sample_seeding and worker_type == "thread" and num_workers > 1:
        raise ValueError("DataLoader: sample_seeding seeds the process's global generators (random, torch, "
                         "numpy), which worker threads share: with several threads one sample's draws could "
                         "follow another's seed. Use worker_type='process', or num_workers <= 1, or seed a "
                         "generator of the dataset's own from ferry.sample_seed()")
    if collate_fn is None:
        collate_fn = data.default_collate if batch_size is not None else data.default_convert
    collate = Unbatched(collate_fn) if batch_size is None else collate_fn
    pinning = bool(pin_memory)
    if pinning:
        if not torch.cuda.is_available():
            warnings.warn("DataLoader: pin_memory=True but torch sees no CUDA device; batches stay pageable",
                          stacklevel=3)
            pinning = False
    from . import _procs

    pool = None
    if num_workers > 0 and worker_type == "process":
        slabs = None
        from . import _slabs

        if not iterable and (pinning or _slabs.FOR_PAGEABLE):  # Note [Slabs]: pinned batches are written there
            slabs = _slabs.Slabs(pinned=pinning and _ferry.cuda_available(),
                                 max_count=num_workers * prefetch_factor + 4, limit=pinned_memory_limit)
        pool = _procs.Pool(_procs.context(multiprocessing_context),
                           (dataset, "iter" if iterable else "map", collate, worker_init_fn, bool(sample_seeding)),
                           slabs)

    def finish(samples: List[Any]) -> Any:
        if samples and isinstance(samples[0], _procs.Collated):
            batch = samples[0].batch  # collated by a worker process
        else:
            batch = collate(samples)
        return pin(batch) if pinning else batch

    threaded = num_workers > 0

    def worker_start(worker: int, workers: int, seed: int) -> None:
        if not threaded:
            return  # as torch: no worker info and no worker_init_fn without workers
        _local.info = WorkerInfo(worker, workers, seed + worker, dataset)
        # One intra-op thread for torch calls on this thread (collate, pin_memory's copy), as
        # torch's own workers and pin thread have: the setting is this thread's, and without it
        # each worker thread's torch call may start a team of OpenMP threads as wide as the machine.
        torch.set_num_threads(1)
        if pool is not None:
            pool.start(worker, workers, seed)  # worker_init_fn runs in the process
        elif worker_init_fn is not None:
            worker_init_fn(worker)

    engine = {"batch_size": 1 if batch_size is None else batch_size, "shuffle": shuffle, "drop_last": drop_last}
    name = type(dataset).__name__
    if iterable:
        def open_stream(worker: int, workers: int, seed: int, epoch: int) -> Any:
            if threaded and getattr(_local, "info", None) is None:
                _local.info = WorkerInfo(worker, workers, seed + worker, dataset)
            if pool is not None:
                pool.call(worker, ("open",))
                return _procs.RemoteStream(pool, worker, engine["batch_size"])
            return iter(dataset)

        cpp = _ferry.python_dataset(fetch=None, fetch_one=None, size=None, open=open_stream, finish=finish, plan=None,
                                    plan_batches=0, worker_start=worker_start, name=name)
        return cpp, engine, pool

    size = len(dataset)
    getitems = getattr(dataset, "__getitems__", None)
    if pool is not None:
        def fetch(indices: List[int], seed: int, epoch: int) -> List[Any]:
            batch = pool.call(_local.info.id, ("map", list(indices), seed, epoch))
            return [_procs.Collated(batch)] + [None] * (len(indices) - 1)

        def fetch_one(index: int, seed: int, epoch: int) -> Any:
            return pool.call(_local.info.id, ("one", index, seed, epoch))
    else:
        seeding = bool(sample_seeding)

        def fetch(indices: List[int], seed: int, epoch: int) -> List[Any]:
            return fetch_samples(dataset, getitems, indices, seed, epoch, seeding)

        def fetch_one(index: int, seed: int, epoch: int) -> Any:
            return fetch_samples(dataset, None, [index], seed, epoch, seeding)[0]

    plan = None
    plan_batches = 0
    if batch_size is not None and sampler is None and batch_sampler is None and generator is not None and shuffle:
        sampler = data.RandomSampler(dataset, generator=generator)  # as torch: the generator draws the order
        engine["shuffle"] = False
    if batch_sampler is None and sampler is not None:
        batch_sampler = data.BatchSampler(sampler, engine["batch_size"], drop_last)
    if batch_sampler is not None:
        user = batch_sampler

        def plan(epoch: int) -> List[List[int]]:
            # torch's DataLoader draws its workers' base seed from `generator` (or torch's global
            # generator) as each epoch starts, before the sampler runs; drawing it too keeps a
            # sampler that shares the generator on torch's order.
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            return [list(b) for b in user]

        plan_batches = len(batch_sampler)
        engine = {"batch_size": 1, "shuffle": False, "drop_last": False}
    cpp = _ferry.python_dataset(fetch=fetch, fetch_one=fetch_one, size=size, open=None, finish=finish, plan=plan,
                                plan_batches=plan_batches, worker_start=worker_start, name=name)
    return cpp, {**engine, "batch_sampler": batch_sampler, "sampler": sampler}, pool
