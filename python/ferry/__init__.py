"""ferry: a data loader for training loops that feed GPUs, with PyTorch's DataLoader API.

    import ferry, torch

    train = ferry.datasets.image_folder("photos/train", size=224, random_crop=True, decode="gpu")
    loader = ferry.DataLoader(train, batch_size=256, shuffle=True, num_workers=2, device=0)
    for epoch in range(10):
        loader.set_epoch(epoch)
        for images, labels in loader:      # torch.Tensors on cuda:0, ordered on the current stream
            ...

Every sample is read, decoded, transformed and collated by ferry's C++ threads; no Python runs per
sample, and the GIL is released while the loop waits for a batch. Batches reach torch through
DLPack without a copy: a tensor keeps ferry's buffer alive until torch frees it.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Iterator, Optional, Tuple

from . import _ferry
from . import datasets
from ._ferry import (  # noqa: F401  (re-exported)
    CudaError,
    DataError,
    Error,
    Interrupted,
    IoError,
    TimeoutError,
    WorkerError,
)
from .datasets import Dataset, load_plugin  # noqa: F401

__all__ = [
    "DataLoader", "LoaderStats", "datasets", "load_plugin", "Dataset",
    "Error", "WorkerError", "TimeoutError", "DataError", "IoError", "CudaError", "Interrupted",
]
__version__ = "0.1.0"

_CUDA_STREAM_LEGACY = 0x1  # cudaStreamLegacy (driver_types.h)

# PyTorch DataLoader arguments ferry does not take, and why.
_UNSUPPORTED = {
    "sampler": "ferry samples by shuffle=/seed=; for several processes use ferry's DistributedEnv (C++)",
    "batch_sampler": "ferry batches by batch_size=/drop_last=",
    "collate_fn": "ferry collates in C++ (the dataset's fields, stacked)",
    "worker_init_fn": "ferry's workers are C++ threads that run no Python",
    "generator": "ferry's randomness is keyed by seed= (and the epoch and sample index)",
    "multiprocessing_context": "ferry's workers are threads, not processes",
    "pin_memory_device": "pass device= to receive batches on a GPU",
}


def _torch():
    import torch  # imported on first use: `import ferry` works without torch
    import torch.utils.dlpack

    return torch


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


class LoaderStats(dict):
    """Where the loader's time went: a dict of per-stage seconds, counts and busy fractions.

    str() (and print) gives ferry's report: batches/s, each stage's time and load, the bottleneck.
    """

    def __str__(self) -> str:
        return self["report"]


class DataLoader:
    """torch.utils.data.DataLoader's interface over a ferry dataset, run by ferry's C++ threads.

    Args (PyTorch's names and defaults where PyTorch has them):
        dataset: a ferry dataset (``ferry.datasets.*``); samples are made in C++ only.
        batch_size, shuffle, drop_last: as in PyTorch.
        num_workers: worker threads (0: batches made on the consumer's thread, or the pin thread).
        pin_memory: deliver CPU batches in page-locked memory (torch ``is_pinned()``).
        timeout: seconds a batch may take in a worker; a worker stuck longer (even in a read that
            never returns) is abandoned and the batch fails with ferry.TimeoutError (or, with
            on_error="skip"/"replace", is made again without the stuck sample). 0: no limit. With
            num_workers=0 there is no worker to abandon and it does not apply (as in PyTorch).
        prefetch_factor: batches in flight per worker (default 2).
        persistent_workers: keep the worker threads across epochs; they then also make the next
            epoch's first batches while the current epoch ends (C++ prefetch_next_epoch), so an
            epoch does not start by waiting.
        seed: keys the shuffle and every sample's random transform with the epoch and index: the
            same seed gives the same batches for any num_workers. The default, 0, is fixed, so
            every run shuffles the same way (PyTorch draws a fresh seed each run): ferry picks
            reproducible runs, and a checkpoint's state_dict() names its seed, which
            load_state_dict() checks. For another order each run pass e.g.
            seed=random.randrange(2**63). ``loader.seed`` reads it back.
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
            and normalize included, or an error saying why it cannot).
        pinned_memory_limit: bytes of page-locked memory the loader may hold. Unset (None), the
            budget starts at 2 GiB and grows once, at the first batch, to hold every batch the
            pipeline may keep alive (prefetch_factor x num_workers and the stages behind them),
            within half the machine's memory, and says so at info level; set, it is never
            exceeded and a pipeline that cannot fit is an error naming the numbers.
            Batches are recycled from this pool: holding many batches alive (e.g. list(loader))
            with pin_memory or device makes the loader wait for one to be freed.
        trace_batches: record the first N batches' timelines (write_trace(path) saves them).
        gpu_decode_threads: with device and a dataset that decodes on the GPU
            (``image_folder(..., decode="gpu")``, ``tar_index``), how many batches nvJPEG decodes at
            once, each on a thread of its own that is busy for the whole decode (C++
            DataLoaderOptions::gpu_decode_threads). 1 (the default) shares the GPU with a training
            step most gently; 2 deliver about 1.5x as many images on about one CPU core more. Set
            CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before CUDA starts: nvJPEG's kernels
            otherwise wait behind the step's (ferry logs a warning).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        seed: int = 0,
        device: Any = None,
        in_order: bool = True,
        on_error: str = "raise",
        max_errors: int = 0,
        max_error_fraction: float = 0.1,
        gather: str = "auto",
        pinned_memory_limit: Optional[int] = None,
        stream: Any = None,
        trace_batches: int = 0,
        gpu_decode_threads: int = 1,
        **unsupported: Any,
    ) -> None:
        for name in unsupported:
            why = _UNSUPPORTED.get(name)
            if why is None:
                raise TypeError(f"DataLoader() got an unexpected keyword argument {name!r}")
            raise TypeError(f"DataLoader: {name}= is not supported: {why}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"DataLoader: batch_size must be an int >= 1, got {batch_size!r}"
                             + (" (PyTorch's batch_size=None, samples without batching, is not supported)"
                                if batch_size is None else ""))
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
            raise ValueError(f"DataLoader: seed must be an int in [0, 2**64), got {seed!r}")
        if not isinstance(dataset, _ferry.Dataset):
            raise TypeError(
                "DataLoader: dataset must be a ferry dataset (ferry.datasets.image_folder, idx, npy, tar, "
                f"synthetic, or a plugin's through ferry.datasets.registry), got {type(dataset).__name__}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.device = _device_index(device)
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
        torch = _torch()
        # torch's C importer of DLPack capsules (what torch.utils.dlpack.from_dlpack calls for a
        # capsule, without its Python-level checks: a few microseconds a tensor).
        convert = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack
        options = _ferry.make_options(
            batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, pin_memory=pin_memory,
            drop_last=drop_last, timeout=float(timeout),
            prefetch_factor=2 if prefetch_factor is None else prefetch_factor,
            persistent_workers=persistent_workers, seed=seed, device=self.device, in_order=in_order,
            on_error=on_error, max_errors=max_errors, max_error_fraction=max_error_fraction, gather=gather,
            pinned_memory_limit=pinned_memory_limit, stream=stream_handle, trace_batches=trace_batches,
            gpu_decode_threads=gpu_decode_threads)
        self._options = options
        self._loader = _ferry.Loader(dataset, options, convert)

    def __iter__(self) -> Iterator[Tuple[Any, ...]]:
        """Starts the next epoch (ending one still in progress) and yields its batches."""
        return iter(self._loader)

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
        return LoaderStats(self._loader.stats())

    def reset_stats(self) -> None:
        self._loader.reset_stats()

    def state_dict(self) -> Dict[str, str]:
        """Where the loader stands (after the last batch received), to save with a checkpoint."""
        return {"ferry_loader_state": self._loader.state()}

    def load_state_dict(self, state: Dict[str, str]) -> None:
        """The next iteration continues where `state` stood, without fetching a consumed sample again."""
        if "ferry_loader_state" not in state:
            raise KeyError("load_state_dict: not a ferry DataLoader state (no 'ferry_loader_state' key)")
        self._loader.restore(state["ferry_loader_state"])

    def write_trace(self, path: str) -> None:
        """Writes the first trace_batches batches' timelines as a Chrome trace (chrome://tracing, Perfetto)."""
        self._loader.write_trace(path)

    def close(self) -> None:
        """Ends the epoch in progress: its workers stop (also done when the loader is freed)."""
        self._loader.end()

    def __repr__(self) -> str:
        dev = "" if self.device is None else f", device={self.device}"
        return f"ferry.DataLoader({self.dataset!r}, batch_size={self.batch_size}{dev})"
