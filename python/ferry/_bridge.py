"""The C++ loader's dataset over a Python one (Note [Python datasets] in python/src/python_datasets.h):
its callables, the engine's options, the worker processes, and PyTorch's seeds.

Note [PyTorch's seeds]
Unless the user passes seed= (or sample_seeding=True), a Python dataset's loader follows
torch's DataLoader: at each epoch's iter() (only the first with persistent workers) a base seed is
drawn from `generator` (torch's default generator when None, so torch.manual_seed governs a
run); worker w's seed is base + w, `random`, torch and numpy are seeded from it in each worker
process as its epoch starts, and get_worker_info().seed reports it; shuffle=True draws its order
from a RandomSampler over the same generator, after the base seed, as torch's does. With seed=
the order is ferry's (keyed by seed and epoch, the same for any worker count) and the base seed
of epoch e is seed + e * max(num_workers, 1): reproducible without torch.manual_seed, and no two
workers of a run share a seed. state_dict() saves the epoch's base seed and the generator's state
as the order was drawn, so a resumed epoch has the same seeds and the same order.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional

from . import _ferry, _slabs
from ._python import WorkerInfo, _local, fetch_samples, host_batch, is_iterable, pin


class Unbatched:
    """collate_fn applied to each sample alone (batch_size=None), picklable for worker processes."""

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: List[Any]) -> Any:
        return self.collate_fn(samples[0])


class Seeds:
    """The epoch's base seed (Note [PyTorch's seeds]), read by the worker threads as they start."""

    def __init__(self) -> None:
        self.base = 0


def draw_base_seed(generator: Any) -> int:
    """One int64 from `generator` (torch's default one when None), as torch's DataLoader draws its base seed."""
    import torch

    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


_torch_draws: Optional[bool] = None  # whether random_order() draws as this torch's RandomSampler does


def random_order(sampler: Any) -> Any:
    """What iterating `sampler` yields, where it is torch's RandomSampler without replacement over
    its data once: the same draws from the same generator (randperm, then the remainder's, none of
    whose n indices are taken), without a Python step an index, which put 0.37 s of 0.78 s before
    the first batch of a million objects (2-core machine). None elsewhere, and where this torch's
    RandomSampler draws otherwise (asked once a process, of a small one, as a loader is made:
    ask_torch_draws()). The order is an int64 tensor."""
    import torch.utils.data as data

    if not _torch_draws or type(sampler) is not data.RandomSampler or sampler.replacement:
        return None
    n = len(sampler.data_source)
    if sampler.num_samples != n or n == 0:
        return None
    return _draw(n, sampler.generator)


def ask_torch_draws() -> None:
    """Finds whether random_order() may answer, once a process: on the thread making a loader,
    as it moves torch's default generator and puts it back (a plan may be drawn on another)."""
    global _torch_draws
    if _torch_draws is None:
        _torch_draws = _draws_as_torch()


def _draw(n: int, generator: Any) -> Any:
    import torch

    if generator is None:  # a generator of its own, seeded from torch's default one
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    order = torch.randperm(n, generator=generator)
    torch.randperm(n, generator=generator)  # the remainder's draw: the generator moves on as torch's does
    return order


def _draws_as_torch() -> bool:
    """Whether _draw() gives what this torch's RandomSampler yields, and leaves its generator (or
    torch's default one) where the sampler does, over a small one."""
    import torch
    import torch.utils.data as data

    source = range(13)
    ours, theirs = torch.Generator(), torch.Generator()
    ours.manual_seed(20261129)
    theirs.manual_seed(20261129)
    if _draw(13, ours).tolist() != list(data.RandomSampler(source, generator=theirs)) or \
            not torch.equal(ours.get_state(), theirs.get_state()):
        return False
    saved = torch.get_rng_state()
    try:
        mine = _draw(13, None).tolist()
        after = torch.get_rng_state()
        torch.set_rng_state(saved)
        return mine == list(data.RandomSampler(source)) and torch.equal(after, torch.get_rng_state())
    finally:
        torch.set_rng_state(saved)


def make_dataset(dataset: Any, *, batch_size: Optional[int], shuffle: bool, sampler: Any, batch_sampler: Any,
                 drop_last: bool, collate_fn: Optional[Callable], pin_memory: bool,
                 worker_init_fn: Optional[Callable], generator: Any, num_workers: int, worker_type: str,
                 multiprocessing_context: Any, seeds: Seeds, torch_order: bool, sample_seeding: bool = False,
                 prefetch_factor: int = 2, pinned_memory_limit: Optional[int] = None) -> "tuple[Any, dict, Any]":
    """The C++ dataset over a Python one, the options the engine must run it with (and the
    attributes PyTorch code reads: sampler, batch_sampler, collate_fn), and the worker processes
    (a ferry._procs.Pool, or None). `torch_order`: shuffle as torch does (a RandomSampler over
    `generator`), not by ferry's seed."""
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
    attributes = {"collate_fn": collate_fn, "sampler": sampler, "batch_sampler": batch_sampler}
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
        if not iterable and (pinning or _slabs.FOR_PAGEABLE):  # Note [Slabs]: pinned batches are written there
            slabs = _slabs.Slabs(pinned=pinning and _ferry.cuda_available(),
                                 max_count=num_workers * prefetch_factor + 4, limit=pinned_memory_limit)
        pool = _procs.Pool(_procs.context(multiprocessing_context),
                           (dataset, "iter" if iterable else "map" if batch_size is not None else "map-unbatched",
                            collate, worker_init_fn, bool(sample_seeding)),
                           slabs)

    # Note [Thread batches through the pipeline] (ferry/_python.py): a batch collated on this
    # process's threads goes through ferry's pin thread and device stage where it is pinned
    # (`pinned_through`), and, without CUDA, where the tests ask (_slabs.FOR_PAGEABLE).
    pinned_through = pool is None and pinning and _ferry.cuda_available()
    through = pinned_through or (pool is None and _slabs.FOR_PAGEABLE)

    def finish(samples: List[Any]) -> Any:
        if samples and isinstance(samples[0], _procs.Collated):  # collated by a worker process
            batch = samples[0].batch
            if type(batch) is _ferry.TensorBatch:  # its tensors in a slab (Note [Slabs] in ferry/_slabs.py)
                return batch
        else:
            batch = collate(samples)
            if through:
                made = host_batch(batch)
                if made is not None:
                    return made
        return pin(batch) if pinning else batch

    threaded = num_workers > 0

    def worker_start(worker: int, workers: int, seed: int) -> None:
        if not threaded:
            return  # as torch: no worker info and no worker_init_fn without workers
        _local.info = WorkerInfo(worker, workers, seeds.base + worker, dataset)
        # One intra-op thread for torch calls on this thread (collate, pin_memory's copy), as
        # torch's own workers and pin thread have: the setting is this thread's, and without it
        # each worker thread's torch call may start a team of OpenMP threads as wide as the machine.
        torch.set_num_threads(1)
        if pool is not None:
            pool.start(worker, workers)  # seeds and worker_init_fn in the process
        elif worker_init_fn is not None:
            worker_init_fn(worker)

    engine = {"batch_size": 1 if batch_size is None else batch_size, "shuffle": shuffle, "drop_last": drop_last}
    name = type(dataset).__name__
    if iterable:
        def open_stream(worker: int, workers: int, seed: int, epoch: int) -> Any:
            if threaded and getattr(_local, "info", None) is None:
                _local.info = WorkerInfo(worker, workers, seeds.base + worker, dataset)
            if pool is not None:
                pool.call(worker, ("open",))
                return _procs.RemoteStream(pool, worker, engine["batch_size"])
            return iter(dataset)

        # As torch: an iterable dataset's sampler is an endless constant one, batched where batch_size is set.
        attributes["sampler"] = data.dataloader._InfiniteConstantSampler()
        if batch_size is not None:
            attributes["batch_sampler"] = data.BatchSampler(attributes["sampler"], batch_size, drop_last)
        cpp = _ferry.python_dataset(fetch=None, fetch_one=None, size=None, open=open_stream, finish=finish, plan=None,
                                    plan_batches=0, worker_start=worker_start, name=name)
        return cpp, {**engine, **attributes, "order": None, "through": through,
                     "pinned_through": pinned_through}, pool

    size = len(dataset)
    # As torch: __getitems__ once a batch with automatic batching only (batch_size=None: __getitem__).
    getitems = getattr(dataset, "__getitems__", None) if batch_size is not None else None
    if pool is not None:
        def fetch(indices: List[int], seed: int, epoch: int) -> List[Any]:
            return [pool.call(_local.info.id, ("map", list(indices), seed, epoch))] + [None] * (len(indices) - 1)

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
    order: Any = None  # (the generator a RandomSampler of ours draws from, its state as each epoch's plan began)
    if batch_sampler is None and sampler is None:
        if shuffle and (torch_order or generator is not None):  # as torch: the generator draws the order
            sampler = data.RandomSampler(dataset, generator=generator)
            engine["shuffle"] = False
            order = (torch.default_generator if generator is None else generator, {})
        else:  # the engine's own order; the attributes are torch's objects all the same
            attributes["sampler"] = data.RandomSampler(dataset) if shuffle else data.SequentialSampler(dataset)
            if batch_size is not None:
                attributes["batch_sampler"] = data.BatchSampler(attributes["sampler"], batch_size, drop_last)
    chunked = False  # batch_sampler is our BatchSampler over a sampler: its batches are slices of the order
    if batch_sampler is None and sampler is not None:
        attributes["sampler"] = sampler
        batch_sampler = data.BatchSampler(sampler, engine["batch_size"], drop_last)
        chunked = True
        if type(sampler) is data.RandomSampler:
            ask_torch_draws()
        if batch_size is not None:
            attributes["batch_sampler"] = batch_sampler
    if batch_sampler is not None:
        user = batch_sampler
        if attributes["sampler"] is None:  # as torch: the user's batch_sampler beside a default sampler
            attributes["sampler"] = data.SequentialSampler(dataset)

        def plan(epoch: int) -> Any:  # batches, or (order, batch size, drop_last): PyBatchSampler
            if order is not None:  # kept for state_dict(): a resumed epoch draws its order again
                states = order[1]
                states[epoch] = bytes(order[0].get_state().numpy())
                for old in [e for e in states if e + 2 < epoch]:
                    del states[old]
            if chunked:  # what BatchSampler yields, without a Python step an index (0.3 s for a million)
                drawn = random_order(user.sampler)
                if drawn is not None:
                    try:  # the order as a buffer, grouped in C++ (python_datasets.h, PyBatchSampler)
                        return (drawn.numpy(), user.batch_size, user.drop_last)
                    except (RuntimeError, TypeError):  # a torch without numpy
                        indices = drawn.tolist()
                else:
                    indices = list(user.sampler)
                size = user.batch_size
                stop = len(indices) - len(indices) % size if user.drop_last else len(indices)
                return [indices[i:i + size] for i in range(0, stop, size)]
            return [list(b) for b in user]

        plan_batches = len(batch_sampler)
        engine = {"batch_size": 1, "shuffle": False, "drop_last": False}
    cpp = _ferry.python_dataset(fetch=fetch, fetch_one=fetch_one, size=size, open=None, finish=finish, plan=plan,
                                plan_batches=plan_batches, worker_start=worker_start, name=name)
    return cpp, {**engine, **attributes, "order": order, "through": through,
                 "pinned_through": pinned_through}, pool
