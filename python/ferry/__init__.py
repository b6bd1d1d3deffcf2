"""ferry: a data loader for training loops that feed GPUs, with PyTorch's DataLoader API.

    import ferry, torch

    train = ferry.datasets.image_folder("photos/train", size=224, random_crop=True, decode="gpu")
    loader = ferry.DataLoader(train, batch_size=256, shuffle=True, num_workers=2, device=0)
    for epoch in range(10):
        loader.set_epoch(epoch)
        for images, labels in loader:      # torch.Tensors on cuda:0, ordered on the current stream
            ...

With ferry's datasets every sample is read, decoded, transformed and collated by ferry's C++
threads; no Python runs per sample, and the GIL is released while the loop waits for a batch.
Batches reach torch through DLPack without a copy: a tensor keeps ferry's buffer alive until torch
frees it.

A Python dataset (map-style or iterable, as torch.utils.data takes them) runs in worker processes
that ferry's worker threads drive (or on the threads: worker_type="thread"), with collate_fn,
sampler, batch_sampler, worker_init_fn and ferry.get_worker_info():

    loader = ferry.DataLoader(MyDataset(...), batch_size=64, shuffle=True, num_workers=8)
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401  (its exit handler is registered first, so it runs after ferry's)
import numbers
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, Optional

from . import _bridge, _ferry, _python, _slabs, _zygote
from . import datasets
from ._ferry import (  # noqa: F401  (re-exported)
    CudaError,
    DataError,
    Error,
    Interrupted,
    IoError,
    OptionError,
    TimeoutError,
    Tokenizer,
    WorkerError,
    object_store_stats,
)
from .datasets import Dataset, load_plugin  # noqa: F401
from ._python import WorkerInfo, get_worker_info, sample_seed  # noqa: F401

__all__ = [
    "DataLoader", "LoaderStats", "datasets", "load_plugin", "Dataset", "get_worker_info", "WorkerInfo",
    "sample_seed",
    "Error", "WorkerError", "TimeoutError", "DataError", "IoError", "CudaError", "Interrupted", "OptionError",
    "object_store_stats", "Tokenizer",
]
__version__ = "0.2.0"

_CUDA_STREAM_LEGACY = 0x1  # cudaStreamLegacy (driver_types.h)

# PyTorch DataLoader arguments a ferry dataset does not take (a Python dataset takes them all), and why.
_NOT_FOR_FERRY_DATASETS = {
    "sampler": "ferry samples by shuffle=/seed=; for several processes pass num_replicas= and rank=",
    "batch_sampler": "ferry batches by batch_size=/drop_last=",
    "collate_fn": "ferry collates in C++ (the dataset's fields, stacked)",
    "worker_init_fn": "ferry's workers are C++ threads that run no Python for a ferry dataset",
    "generator": "ferry's randomness is keyed by seed= (and the epoch and sample index)",
}


def _torch():
    import torch  # imported on first use: `import ferry` works without torch
    import torch.utils.dlpack

    return torch


def _integer(name: str, value: Any) -> int:
    """An int argument as the library takes it (its range is the library's rule: OptionError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"DataLoader: {name}={value!r} is not an int")
    return int(value)


def _device_index(device: Any) -> Optional[int]:
    if device is None:
        return None
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):
        return int(device)
    text = str(device)  # "cuda", "cuda:1", torch.device("cuda", 1)
    if text == "cuda":
        cuda = _torch().cuda
        return cuda.current_device() if cuda.is_available() else 0  # no CUDA: the caller raises CudaError
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"DataLoader: device must be a CUDA device (an index, 'cuda:N' or torch.device), got {device!r}")


# Loaders of Python datasets, released at exit while Python can still run their workers' calls
# (Note [Python datasets]: a cycle through the C++ loader keeps a module-level one alive until then).
_python_loaders: "weakref.WeakSet[DataLoader]" = weakref.WeakSet()


@atexit.register
def _release_python_loaders() -> None:
    abandoned = False
    for loader in list(_python_loaders):
        # A worker abandoned inside the dataset may return while Python finalizes; Python then ends
        # its thread, which keeps its objects (Note [Threads Python ends at exit] in python/src/gil.h):
        # no leak report for those.
        abandoned = abandoned or loader._loader.stats()["abandoned_workers"] > 0
        loader._loader.release()
        if loader._pool is not None:
            loader._pool.close(exiting=True)
        # A worker still inside the dataset (abandoned by a timeout or Ctrl-C) keeps the cycle's
        # Python half alive; let the C++ objects go now.
        loader._loader = loader._options = None
    # A daemon thread still running (a loop over a loader) is ended by Python wherever it next
    # takes the GIL, inside one of ferry's calls (where it parks: the same Note) or in Python code,
    # and keeps the objects it holds: no leak report for those either.
    daemons = any(t.daemon and t.is_alive() and not t.name.startswith("ferry:")  # ferry's own hold no user objects
                  for t in threading.enumerate() if t is not threading.current_thread())
    if abandoned or daemons:
        _ferry.quiet_leak_warnings()


class _PythonBatches:
    """A Python dataset's batches: keeps the loader (and its worker processes) alive while the loop
    runs, as in `for b in ferry.DataLoader(...)`, and moves batches to the device. A failed batch
    raises and the next call goes on, as with the loader's own iterator."""

    __slots__ = ("_owner", "_batches", "_move", "_pool", "_pin")

    def __init__(self, owner: Any, batches: Iterator[Any], move: Optional[Callable[[Any], Any]]) -> None:
        self._owner, self._batches, self._move, self._pool = owner, batches, move, owner._pool
        # objects with a pin_memory() of their own, as torch's pin_memory asks them
        self._pin = owner._pins_delivered

    def __iter__(self) -> "_PythonBatches":
        return self

    def __next__(self) -> Any:
        pool = self._pool
        try:
            batch = next(self._batches)
        except StopIteration:
            if pool is not None:
                pool.settle()  # by the first epoch's end, whether the dataset pickles is known
            raise
        if pool is not None and pool.unsettled:
            pool.settle(wait=False)
        if type(batch) is _ferry.Delivered:  # through ferry's pipeline: pinned, or on the device already
            if type(batch.structure) is not bytes:  # a worker thread's (Note [Thread batches through the pipeline])
                return _python.rebuild_host(batch.structure, batch.tensors, self._pin)
            batch = _slabs.rebuild(batch)
            return _python.pin(batch, tensors=False) if self._pin else batch
        if self._move is None:
            return batch
        return self._move(batch)


class LoaderStats(dict):
    """Where the loader's time went: a dict of per-stage seconds, counts and busy fractions.

    str() (and print) gives ferry's report: batches/s, each stage's time and load, the bottleneck.
    """

    def __str__(self) -> str:
        return self["report"]


class DataLoader:
    """torch.utils.data.DataLoader's interface over a ferry dataset, run by ferry's C++ threads.

    Args (PyTorch's names and defaults where PyTorch has them):
        dataset: a ferry dataset (``ferry.datasets.*``: samples made in C++ only), or a Python one:
            map-style (``__getitem__`` and ``__len__``; ``__getitems__`` once a batch if it has
            it) or iterable (``__iter__``), run by worker processes or threads (worker_type).
        batch_size, shuffle, drop_last: as in PyTorch (batch_size=None: a Python dataset's
            samples one at a time, unbatched).
        sampler, batch_sampler, collate_fn, worker_init_fn, generator: as in PyTorch, for Python
            datasets (a ferry dataset samples by shuffle/seed and collates in C++).
        worker_type: for a Python dataset with num_workers > 0: "process" (each worker thread
            drives a process of its own, which runs the dataset and collate_fn: forked from a
            zygote that holds the dataset, sent once, so a worker starts as fast as a fork and
            never runs the main script again: no `if __name__ == "__main__":` needed, and a
            script's or notebook's classes and lambdas travel by value (cloudpickle); what cannot
            cross a process, an open socket or a lock, is named in a TypeError) or "thread" (the
            dataset runs on the worker threads, each call holding the GIL). Unset (None):
            "thread" where Python runs without a GIL (a free-threaded build with the GIL off,
            checked when the loader is made), else "process".
        sample_seeding: for a map-style Python dataset: before each sample, seed Python's
            ``random``, torch's and numpy's global generators with ``ferry.sample_seed()`` (keyed
            by seed, epoch and index), so that a dataset's random transforms (torchvision's
            included) give the same batches for any num_workers and on resume (once a batch,
            from its first index, for ``__getitems__``). For worker processes, or at most one
            worker thread: threads share those generators with each other and with the rest of
            this process (another loader's thread workers included).
        multiprocessing_context: for worker processes: unset, they are forked from ferry's
            zygote (Note [Zygote] in ferry/_zygote.py); "forkserver", "spawn" or a context object
            start them that way instead, each importing the main module again ("fork" is
            refused: this process runs threads).
        pin_memory_device: accepted and kept (PyTorch deprecates it); pass device= instead.
        num_workers: worker threads (0: batches made on the consumer's thread, or the pin thread).
        pin_memory: deliver CPU batches in page-locked memory (torch ``is_pinned()``).
        timeout: seconds a batch may take in a worker; a worker stuck longer (even in a read that
            never returns) is abandoned and the batch fails with ferry.TimeoutError (or, with
            on_error="skip"/"replace", is made again without the stuck sample). 0: no limit. With
            num_workers=0 there is no worker to abandon and it does not apply (as in PyTorch).
        prefetch_factor: batches in flight per worker (default 2).
        persistent_workers: keep the worker threads (and a Python dataset's worker processes)
            across epochs; they then also make the next epoch's first batches while the current
            epoch ends (C++ prefetch_next_epoch), so an epoch does not start by waiting, where the
            next epoch's order is known ahead (ferry's own: a ferry dataset, or seed=). An order
            from a sampler, a batch_sampler or torch's generator is asked for at the epoch's
            iter(), as torch asks (after sampler.set_epoch(), after the loop's draws). Without
            it, as in PyTorch, each epoch of a Python dataset has new worker processes, which see
            the dataset as it is at that iter() and run worker_init_fn again.
        seed: keys the shuffle and every sample's random transform with the epoch and index: the
            same seed gives the same batches for any num_workers. For a ferry dataset the default
            (None) is 0, fixed, so every run shuffles the same way: ferry picks reproducible runs,
            and a checkpoint's state_dict() names its seed, which load_state_dict() checks; for
            another order each run pass e.g. seed=random.randrange(2**63). For a Python dataset,
            unset, the loader does as torch's (Note [PyTorch's seeds] in ferry/_bridge.py): each
            epoch (the first only, with persistent workers) draws a base seed from ``generator``
            (torch's default generator if None, so torch.manual_seed governs the run), the order
            from a RandomSampler over it, worker w is seeded base + w (``random``, torch, numpy)
            as its epoch starts; set, the order is ferry's and worker w of epoch e is seeded
            seed + e * num_workers + w, the same every run. ``loader.seed`` reads it back (0 when
            unset).
        device: deliver batches on this CUDA device (an index, "cuda:N" or a torch.device). They
            are ordered on ``stream`` (default: torch's current stream on that device when the
            loader is made): kernels on that stream see the batch, with no host synchronization.
        in_order: deliver in sampler order (True) or as batches complete.
        on_error: what a damaged or stuck sample costs: "raise" (its batch fails with an
            exception at its position; the loop may catch it and go on), "skip" (the batch comes
            one row short) or "replace" (another sample takes its row).
        max_errors, max_error_fraction: skip/replace limits per epoch.
        gather: with device, how batches of rows (idx, npy) are made: "auto" (the GPU gathers
            them where it can; the host path for a memory-mapped .npy), "host" (workers copy rows
            into pinned blocks), "device" (the GPU gathers them from registered memory, idx's flip
            and normalize included, or an error saying why it cannot). A loader the GPU gathers for
            starts no worker whatever num_workers says: its pin thread writes each batch's indices.
            For token windows (``datasets.tokens``, ``megatron``): "auto" has workers write int64
            (or int32) input_ids and labels into pinned batches; "device" has the GPU read ordered
            or random-offset windows of a local file (from a page-locked copy of it made when the
            loader starts) and write input_ids and labels itself (no worker starts), and moves other windows (packed, shuffled documents,
            s3://, a vocab check) as the file stores them, widened on the GPU. The same batches
            either way (bench/RESULTS.md "Language-model tokens").
        pinned_memory_limit: bytes of page-locked memory the loader may hold. Unset (None), the
            budget starts at 2 GiB and grows once, at the first batch, to hold every batch the
            pipeline may keep alive (prefetch_factor x num_workers and the stages behind them),
            within half the machine's memory, and says so at info level; set, it is never
            exceeded and a pipeline that cannot fit is an error naming the numbers.
            Batches are recycled from this pool: holding many batches alive (e.g. list(loader))
            with pin_memory or device makes the loader wait for one to be freed. Without pinning,
            it caps the host batches kept for reuse (never waited for), grown the same way unset.
        trace_batches: record the first N batches' timelines (write_trace(path) saves them).
        num_replicas, rank: for a ferry dataset in data-parallel training: this process reads rank
            `rank`'s share of every epoch, split over `num_replicas` processes as torch's
            DistributedSampler splits it (each rank every num_replicas-th sample of one seeded
            order, padded to equal counts, or cut with drop_last; C++ ferry::DistributedSampler);
            shuffle, seed and drop_last apply to the whole order. A state_dict() saved at one
            num_replicas restores at another: the epoch goes on from where the whole group stood,
            split over the new ranks, so with the same global batch size (batch_size x num_replicas)
            the global batches are those the uninterrupted run would have given. Under torchrun:
            num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]).
        gpu_decode_threads: with device and a dataset that decodes on the GPU
            (``image_folder(..., decode="gpu")``, ``tar_index``), how many batches nvJPEG decodes at
            once, each on a thread of its own that is busy for the whole decode (C++
            DataLoaderOptions::gpu_decode_threads). 0 (the default) chooses from the hardware at the
            first decode: 2 where the GPU has JPEG engines (A100, H100, H200) and the machine 8 CPUs
            or more, else 1 (``stats()["decode_threads"]`` says which); 2 deliver about 1.5x one's
            images on about one CPU core more. Set
            CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before CUDA starts: nvJPEG's kernels
            otherwise wait behind the step's (ferry logs a warning).
    """

    # Set in __init__ (declared here for the type checker: module-level code reads them first).
    dataset: Any
    batch_size: Optional[int]
    device: Any
    _loader: Any
    _options: Any
    _pool: Any
    _python: bool
    _widen: Any
    _torch_stream: Any
    _torch_device: Any
    _seeds: _bridge.Seeds
    seed: int
    num_workers: int
    persistent_workers: bool
    generator: Any

    def __init__(
        self,
        dataset: Any,
        batch_size: Optional[int] = 1,
        shuffle: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        seed: Optional[int] = None,
        device: Any = None,
        in_order: bool = True,
        on_error: str = "raise",
        max_errors: int = 0,
        max_error_fraction: float = 0.1,
        gather: str = "auto",
        pinned_memory_limit: Optional[int] = None,
        stream: Any = None,
        trace_batches: int = 0,
        gpu_decode_threads: int = 0,
        sampler: Any = None,
        batch_sampler: Any = None,
        collate_fn: Optional[Callable[[Any], Any]] = None,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        generator: Any = None,
        multiprocessing_context: Any = None,
        pin_memory_device: str = "",
        worker_type: Optional[str] = None,
        sample_seeding: bool = False,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
    ) -> None:
        python = not isinstance(dataset, _ferry.Dataset)
        if worker_type is None:
            worker_type = _python.default_worker_type()
        if sample_seeding and not python:
            raise TypeError("DataLoader: sample_seeding= is for Python datasets: a ferry dataset's random "
                            "transforms are keyed by (seed, epoch, index) already")
        if not python:
            given = {"sampler": sampler, "batch_sampler": batch_sampler, "collate_fn": collate_fn,
                     "worker_init_fn": worker_init_fn, "generator": generator}
            for name, value in given.items():
                if value is not None:
                    raise TypeError(f"DataLoader: {name}= is not for a ferry dataset: {_NOT_FOR_FERRY_DATASETS[name]}")
            if batch_size is None:
                raise ValueError("DataLoader: batch_size=None (samples without batching) is for Python datasets; "
                                 "a ferry dataset's loader batches")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                                 or not 0 <= seed < 2**64):
            raise ValueError(f"DataLoader: seed must be an int in [0, 2**64) or None, got {seed!r}")
        # Note [PyTorch's seeds] (ferry/_bridge.py): a Python dataset without seed= takes torch's.
        self._torch_seeds = python and seed is None and not sample_seeding
        seed = 0 if seed is None else int(seed)  # type: ignore[call-overload]  # checked above
        if multiprocessing_context is not None and not (python and worker_type == "process"):
            warnings.warn("DataLoader: multiprocessing_context has no effect: this loader's workers are threads",
                          stacklevel=2)

        def make_options(batch: Any, shuffle: bool, drop_last: bool, pin: bool, device: Optional[int], stream: int) -> Any:
            # The library's options, checked by its one set of rules (ferry::detail::validate_options;
            # a value out of range is an OptionError, a ValueError as PyTorch raises).
            return _ferry.make_options(
                batch_size=batch, shuffle=shuffle, num_workers=num_workers, pin_memory=pin,
                drop_last=drop_last, timeout=float(timeout),
                prefetch_factor=2 if prefetch_factor is None else prefetch_factor,
                persistent_workers=persistent_workers, seed=seed, device=device, in_order=in_order,
                on_error=on_error, max_errors=max_errors, max_error_fraction=max_error_fraction, gather=gather,
                pinned_memory_limit=pinned_memory_limit, stream=stream, trace_batches=trace_batches,
                gpu_decode_threads=gpu_decode_threads)

        # Checked before a Python dataset's workers, slabs or zygote are asked for.
        num_workers = _integer("num_workers", num_workers)
        device_index = _device_index(device)
        asked = make_options(1 if batch_size is None else _integer("batch_size", batch_size), shuffle, drop_last,
                             bool(pin_memory), device_index, 0)
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        # The attributes PyTorch code reads.
        self.num_workers = int(num_workers)
        self.drop_last = drop_last
        self.pin_memory = pin_memory
        self.timeout = timeout
        self.prefetch_factor = prefetch_factor if prefetch_factor is not None or num_workers == 0 else 2
        self.persistent_workers = persistent_workers
        self.in_order = in_order
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn
        self.generator = generator
        self.multiprocessing_context = multiprocessing_context
        self.pin_memory_device = pin_memory_device
        self.device = device_index
        self._python = python
        self._pool = None
        # Note [Thread batches through the pipeline] (ferry/_python.py): worker threads' batches go
        # through the pipeline (and there are pinned).
        self._host_batches = self._host_batches_pinned = False
        self._seeds = _bridge.Seeds()
        self._seed_epoch: Optional[int] = None  # the epoch the base seed was drawn for
        self._resume_seeds: Optional[Dict[str, int]] = None
        self._order: Any = None  # (generator, {epoch: its state as the epoch's order was drawn})
        self.worker_type = worker_type if python else "thread"
        engine_batch, engine_shuffle, engine_drop_last = batch_size, shuffle, drop_last
        if python:
            # Note [Python datasets] (python/src/python_datasets.h): the workers run the dataset's Python
            # code; a worker process's batch comes in a slab, through ferry's pin thread and device
            # stage (Note [Python batches through the pipeline]), and so does a worker thread's,
            # pinned by the pin thread (Note [Thread batches through the pipeline]); a batch the
            # pipeline does not take is pinned on the worker (torch's pin_memory) and copied on
            # the consumer's stream as it arrives.
            cpp_dataset, engine, self._pool = _bridge.make_dataset(
                dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
                drop_last=drop_last, collate_fn=collate_fn, pin_memory=_ferry.pins(asked),
                worker_init_fn=worker_init_fn, generator=generator, num_workers=num_workers, worker_type=worker_type,
                multiprocessing_context=multiprocessing_context, seeds=self._seeds, torch_order=self._torch_seeds,
                sample_seeding=sample_seeding,
                prefetch_factor=2 if prefetch_factor is None else prefetch_factor,
                pinned_memory_limit=pinned_memory_limit)
            engine_batch, engine_shuffle, engine_drop_last = engine["batch_size"], engine["shuffle"], engine["drop_last"]
            self.sampler, self.batch_sampler = engine["sampler"], engine["batch_sampler"]
            if batch_sampler is not None:  # as torch: the batches are the batch sampler's
                self.batch_size, self.drop_last = None, False
            self.collate_fn = engine["collate_fn"]
            self._order = engine["order"]
            self._host_batches, self._host_batches_pinned = engine["through"], engine["pinned_through"]
            if gather != "auto":
                raise ValueError("DataLoader: gather= is for ferry's datasets of rows (idx, npy)")
        else:
            cpp_dataset = dataset
        # Token windows with a device and gather="device": where the windows are runs of a local
        # file (ordered or random-offset windows), the GPU reads them from a page-locked copy of
        # the file and writes input_ids and labels itself (Note [Token windows on the GPU] in
        # ferry/loaders/tokens.h), and gather="device" passes through. Elsewhere (packed or
        # shuffled-document windows, an object in storage, a vocab check):
        # Note [Token windows widened on the GPU]
        # The windows cross the link as the file stores them (2 bytes a token of a uint16 file,
        # not 16 for int64 input_ids and labels) and are widened and shifted on the GPU, on the
        # consumer's stream, as each batch is handed over (_widened): a few torch operations a
        # batch on this thread (bench/RESULTS.md "Language-model tokens").
        self._widen = None
        if not python and getattr(dataset, "name", "") in ("tokens", "megatron") and gather == "device":
            if self.device is None:
                raise ValueError("DataLoader: gather='device' for token windows needs device=")
            if _ferry.token_gather_problem(dataset):
                if dataset.fields[:1] != ["tokens"]:  # not raw already
                    cpp_dataset, out_dtype = _ferry.raw_token_windows(dataset)
                    self._widen = (dataset.token_type, out_dtype)
                gather = "auto"
        stream_handle = 0
        if self.device is not None:
            torch = _torch()
            if not torch.cuda.is_available():
                raise CudaError(
                    f"DataLoader: device=cuda:{self.device} needs CUDA, and this torch has none "
                    f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}): leave device unset "
                    "for batches on the host, or install a CUDA build of torch")
            if stream is None:
                stream = torch.cuda.current_stream(self.device)
            stream_handle = int(getattr(stream, "cuda_stream", stream))
            if stream_handle == 0:
                # torch's default stream is CUDA's legacy default stream (handle 0); ferry takes a
                # null consumer stream to mean "make one", so name the legacy stream explicitly.
                stream_handle = _CUDA_STREAM_LEGACY
        self._stream = stream
        if python and self.device is not None:
            torch = _torch()
            self._torch_stream = stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream(self.device)
            self._torch_device = torch.device("cuda", self.device)
        torch = _torch()
        # torch's C importer of DLPack capsules (what torch.utils.dlpack.from_dlpack calls for a
        # capsule, without its Python-level checks: a few microseconds a tensor).
        convert = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
        # A Python dataset's batches in worker processes' slabs go through ferry's pipeline: pinned
        # already, and copied by the device stage (Note [Slabs] in ferry/_slabs.py); so do worker
        # threads' batches, pinned by the pin thread. Batches that do not (a tensor the pipeline
        # does not take) are pinned by torch on the worker, and moved on the consumer's stream here.
        slabs = None if self._pool is None else self._pool.slabs
        through = (slabs is not None and slabs.pinned) or self._host_batches_pinned
        self._pins_delivered = through  # a delivered batch was pinned (objects with pin_memory() follow)
        if python and not through:
            options = make_options(engine_batch, engine_shuffle, engine_drop_last, False, None, 0)
        else:
            options = make_options(engine_batch, engine_shuffle, engine_drop_last, bool(pin_memory) or through,
                                   self.device, stream_handle)
        if through and slabs is not None:
            options = _ferry.with_shared_blocks(options, slabs.blocks)
        if num_replicas is not None or rank is not None:
            if python:
                raise TypeError("DataLoader: num_replicas= and rank= are for ferry datasets; a Python dataset takes "
                                "sampler=torch.utils.data.DistributedSampler(dataset)")
            if num_replicas is None or rank is None:
                raise ValueError("DataLoader: pass num_replicas= and rank= together")
            for name, value in (("num_replicas", num_replicas), ("rank", rank)):
                if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                    raise ValueError(f"DataLoader: {name} must be an int >= 0, got {value!r}")
            options = _ferry.with_distributed_sampler(options, cpp_dataset, int(num_replicas), int(rank))
        self.num_replicas, self.rank = num_replicas, rank
        self._options = options
        self._loader = _ferry.Loader(cpp_dataset, options, convert)
        if python:
            _python_loaders.add(self)
        # Worker processes start now, while the script goes on; forked from a loader zygote forked
        # from this process, they start at iter() (Note [Loader zygotes forked from the main process]).
        if self._pool is not None and not self._pool.forked:
            self._pool.prestart(self.num_workers)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:  # the threads that drive the processes first, then the processes
            loader = getattr(self, "_loader", None)
            if loader is not None:
                loader.release()
            pool.close()

    def __iter__(self) -> Iterator[Any]:
        """Starts the next epoch (ending one still in progress) and yields its batches."""
        if self._python:
            self._begin_python_epoch()
        batches = self._loader.begin()
        if self._python and (self.device is not None or self._pool is not None or self._host_batches):
            return self._python_batches(batches)
        if self._widen is not None:
            return self._widened(batches)
        return batches

    def _begin_python_epoch(self) -> None:
        """The epoch's base seed and, without persistent workers, its own worker processes over the
        dataset as it is now (Note [PyTorch's seeds] in ferry/_bridge.py)."""
        epoch = self._loader.next_epoch
        persistent = self.persistent_workers and self.num_workers > 0
        resume, self._resume_seeds = self._resume_seeds, None
        if resume is not None and (resume["epoch"] == epoch or persistent):  # the saved run's seeds
            base = resume["base_seed"]
        elif self._seed_epoch is not None and persistent:
            base = self._seeds.base  # as torch: persistent workers are seeded once
        elif self._torch_seeds:
            base = _bridge.draw_base_seed(self.generator)
        else:
            base = (self.seed + epoch * max(self.num_workers, 1)) % 2**63
        self._seeds.base, self._seed_epoch = base, epoch
        if self._pool is not None:
            self._pool.begin_epoch(base, renew=not persistent)

    def _widened(self, batches: Iterator[Any]) -> Iterator[Any]:
        """A token dataset's raw windows as input_ids and labels (Note [Token windows widened on the GPU])."""
        torch = _torch()
        token_type, out_dtype = self._widen
        out = torch.int32 if out_dtype == "int32" else torch.int64
        mask = {"uint16": 0xFFFF, "uint32": 0xFFFFFFFF}.get(token_type)
        for b in batches:
            t = b.pop("tokens")
            if mask is not None:  # unsigned ids came in a signed type of their width, their bits kept
                t = t.to(torch.int64 if token_type == "uint32" else torch.int32).bitwise_and_(mask)
            widened = {"input_ids": t[:, :-1].to(out).contiguous(), "labels": t[:, 1:].to(out).contiguous()}
            if "position_ids" in b:
                widened["position_ids"] = b.pop("position_ids").to(out)
                widened["cu_seqlens"] = b.pop("cu_seqlens")
            yield widened

    def _python_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        move = None
        if self.device is not None:
            torch = _torch()

            def move(batch: Any) -> Any:  # pinned on the worker: the copy is queued, not waited for
                with torch.cuda.stream(self._torch_stream):
                    return _python.to_device(batch, self._torch_device)

        return _PythonBatches(self, batches, move)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._loader)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration runs (its shuffle and random transforms)."""
        self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs."""
        return self._loader.next_epoch

    def stats(self) -> LoaderStats:
        """Where the time went since the first epoch began (or reset_stats()); print() shows the report."""
        stats = LoaderStats(self._loader.stats())
        slabs = None if self._pool is None else self._pool.slabs
        if slabs is not None:  # worker processes' batches: in a slab, or (partly) as torch's shared memory
            stats.update(slabs.stats())
        return stats

    def reset_stats(self) -> None:
        self._loader.reset_stats()

    def state_dict(self) -> Dict[str, Any]:
        """Where the loader stands (after the last batch received), to save with a checkpoint; for a
        Python dataset also the epoch's base seed (Note [PyTorch's seeds])."""
        state: Dict[str, Any] = {"ferry_loader_state": self._loader.state()}
        if self._python and self._seed_epoch is not None:
            seeds: Dict[str, Any] = {"epoch": self._seed_epoch, "base_seed": self._seeds.base}
            drawn = None if self._order is None else self._order[1].get(self._seed_epoch)
            if drawn is not None:  # the generator's state as the epoch's order was drawn
                seeds["order_generator_state"] = drawn
            state["ferry_worker_seeds"] = seeds
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The next iteration continues where `state` stood, without fetching a consumed sample again."""
        if "ferry_loader_state" not in state:
            raise KeyError("load_state_dict: not a ferry DataLoader state (no 'ferry_loader_state' key)")
        seeds = state.get("ferry_worker_seeds")
        drawn = None if seeds is None else seeds.get("order_generator_state")
        if self._python and self._order is not None and drawn is not None:
            # The saved epoch's order is drawn again as restore() plans it: from the generator as it
            # stood then (which then goes on as the saved run's did).
            torch = _torch()
            self._order[0].set_state(torch.frombuffer(bytearray(drawn), dtype=torch.uint8))
        self._loader.restore(state["ferry_loader_state"])
        if self._python and seeds is not None:
            self._resume_seeds = {"epoch": int(seeds["epoch"]), "base_seed": int(seeds["base_seed"])}

    def write_trace(self, path: str) -> None:
        """Writes the first trace_batches batches' timelines as a Chrome trace (chrome://tracing, Perfetto)."""
        self._loader.write_trace(path)

    def close(self) -> None:
        """Ends the epoch in progress: its workers stop (also done when the loader is freed)."""
        self._loader.end()

    def __repr__(self) -> str:
        dev = "" if self.device is None else f", device={self.device}"
        return f"ferry.DataLoader({self.dataset!r}, batch_size={self.batch_size}{dev})"


# Last, once everything ferry imports is imported: the zygote that worker processes are forked
# from (Note [Zygote] in ferry/_zygote.py), forked now while this process has one thread.
_zygote.at_import()
