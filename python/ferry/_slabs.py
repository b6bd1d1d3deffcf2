"""Shared-memory slabs that worker processes write batches into (Note [Slabs]).

Note [Slabs]
When batches are pinned (pin_memory or device), a worker process collates a batch, then copies
its tensors into a slab: a memfd segment that the main process made, mapped in both processes
(its descriptor sent once a process over the process's pipe) and registered with CUDA
(cudaHostRegister; unregistered where ferry sees no CUDA device). Only the
batch's structure crosses the pipe: the batch is pickled with each tensor replaced by a
persistent id (offset, dtype, shape), and the main process rebuilds the tensors as views of the
slab. A registered slab *is* pinned memory: torch's pin_memory() keeps it as it is (no copy) and
the device copy reads straight from what the worker wrote.

A slab is leased by the loader's worker thread for one batch and comes back when the last tensor
viewing it is freed (torch.frombuffer holds the lease object; its __del__ returns the slab), and,
for batches copied to a device, not before the copy's event has completed (the loader keeps the
CPU batch until then). A request carries a free slab where there is one; a process whose batch
has none, or does not fit the one it was given, says how many bytes it needs ("need") once it has
collated the batch, and the worker thread answers with a slab that holds them: a free one, taken
at once, or a new one made then (1.25x the largest batch seen, rounded up to 1 MiB). Registering
a slab of a float image batch takes a tenth of a second or more, and CUDA registers one at a time
(bench/RESULTS.md, "Python datasets"): slabs are made outside the lock that leases take, one at a
time, the lowest worker first (under round-robin, the batch the consumer waits for), and only as
they are needed (the first epoch makes them; later ones reuse them). A slab smaller than the
largest batch seen is retired as it comes back.
The number of slabs is bounded (workers x prefetch_factor + 4) and, when pinned, so are their
bytes (pinned_memory_limit, or half the machine's memory and 3/4 of what is free); a batch that
finds no slab within the bounds (a loop that keeps many batches) travels as torch's per-tensor
shared memory, never waits. memfd segments have no name: nothing is left in /dev/shm whatever
happens to either process.
"""

from __future__ import annotations

import collections
import ctypes
import io
import mmap
import multiprocessing.reduction
import os
import pickle
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _ferry

ALIGN = 256  # each tensor's offset in a slab (DMA- and vector-friendly)
# Slabs replace the pin copy, so they serve pinned batches (pin_memory or device) only: for a
# pageable batch, torch's per-tensor shared memory is already zero-copy into this process, and a
# slab would add the worker's copy (0.86-0.91x of PyTorch's rate for 38.5 MB batches, against
# 1.25-1.42x without; bench/RESULTS.md). The tests turn this on to run the slab path without CUDA.
FOR_PAGEABLE = False
_ROUND = 1 << 20
# The slabs this process has made and not closed: a loader zygote forked from it closes its copies
# of their files (Note [Loader zygotes forked from the main process] in _zygote.py).
made: "weakref.WeakSet[Slab]" = weakref.WeakSet()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Slab:
    """One memfd segment, mapped here (and registered with CUDA when `pinned`)."""

    def __init__(self, slab_id: int, size: int, pinned: bool) -> None:
        self.id, self.size, self.registered = slab_id, size, False
        self.fd = os.memfd_create(f"ferry-slab-{slab_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
            # Not in a process forked from this one (a loader zygote, Note [Loader zygotes forked
            # from the main process] in _zygote.py), which would keep the segment after its loader.
            self.mm.madvise(mmap.MADV_DONTFORK)
        except BaseException:
            os.close(self.fd)
            raise
        first = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(first)
        del first  # no export left: the mapping can close
        if pinned:
            try:
                _ferry.host_register(self.address, size)
            except BaseException:
                self.close()
                raise
            self.registered = True
        self.lease_type = type("SlabLease", (ctypes.c_uint8 * size,), {"__del__": _lease_gone})
        made.add(self)

    def forget(self) -> None:
        """In a process forked from the one that made it: closes this process's copy of its file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.registered = False

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.registered:
            _ferry.host_unregister(self.address)
            self.registered = False
        self.mm.close()
        os.close(self.fd)
        self.fd = -1


def _lease_gone(lease: Any) -> None:
    """The last view of a batch's slab is gone (a finalizer: any thread, no lock taken)."""
    slabs = getattr(lease, "slabs", None)
    if slabs is not None:
        slabs.give_back(lease.slab)


class Slabs:
    """The slabs of one loader (main process)."""

    def __init__(self, pinned: bool, max_count: int, limit: Optional[int]) -> None:
        self.pinned, self.max_count = pinned, max_count
        if limit is None:  # the loader's own rule for an unset pinned budget (DataLoaderOptions)
            limit = _ferry.pinned_growth_cap() or _ferry.DEFAULT_PINNED_MEMORY_LIMIT
        self.limit = limit
        self.size = 0  # learned from the batches: a new slab's size
        self._lock = threading.Lock()
        self._free: List[Slab] = []
        self._returned: "collections.deque[Slab]" = collections.deque()
        self._live: Dict[int, Slab] = {}
        self._making = 0  # slabs being made (outside the lock), counted against the bounds
        self._make_turn = threading.Condition()  # lease_for's turns: one at a time, lowest worker first
        self._queue: List[int] = []  # the workers waiting for their turn
        self._queue_busy = False
        self.retired: set = set()  # ids the processes should unmap
        self._next_id = 0
        self._closed = False
        self._warned = False
        self.batches = 0  # batches whose tensors all travelled in a slab
        self.misses = 0  # batches (or parts) that travelled as torch's shared memory
        self.made = 0  # slabs made
        self.make_seconds = 0.0  # spent making them (memfd, mapping, cudaHostRegister)

    def _collect(self) -> None:  # under the lock
        while self._returned:
            slab = self._returned.popleft()
            if self._closed or slab.size < self.size:
                self._retire(slab)
            else:
                self._free.append(slab)

    def _retire(self, slab: Slab) -> None:  # under the lock
        self._live.pop(slab.id, None)
        self.retired.add(slab.id)
        slab.close()

    def _take_free(self, needed: int) -> Optional[Slab]:  # under the lock
        while self._free:
            slab = self._free.pop()
            if slab.size >= max(needed, self.size):
                return slab
            self._retire(slab)
        return None

    def lease(self) -> Optional[Slab]:
        """A free slab for a batch about to be asked for, or None (none free: the process asks
        for one once it knows the batch's bytes, lease_for)."""
        with self._lock:
            self._collect()
            if self._closed or self.size == 0:
                return None
            return self._take_free(self.size)

    def lease_for(self, needed: int, given: Optional[Slab], worker: int = 0) -> Optional[Slab]:
        """A slab of at least `needed` bytes for a batch a process has collated (it did not fit
        `given`, which comes back): a free one, or one made now; None past the bounds (the batch
        then travels as torch's shared memory). Slabs are made one at a time, the lowest
        `worker` waiting first: CUDA registers one at a time whatever the threads
        (bench/probe_slabs.py), and with batch b made by worker b mod num_workers the
        lowest worker's batch is the one the consumer waits for."""
        slab = self._lease_for(needed, given, make=False)  # a free one needs no turn
        if slab is not None or self._closed:
            return slab
        with self._make_turn:
            self._queue.append(worker)
            try:
                while self._queue_busy or min(self._queue) != worker:
                    self._make_turn.wait()
            finally:  # also when the wait is interrupted: a turn left queued would stop the others
                self._queue.remove(worker)
                self._make_turn.notify_all()
            self._queue_busy = True
        try:
            return self._lease_for(needed, None, make=True)
        finally:
            with self._make_turn:
                self._queue_busy = False
                self._make_turn.notify_all()

    def _lease_for(self, needed: int, given: Optional[Slab], make: bool) -> Optional[Slab]:
        with self._lock:
            if needed > self.size:  # new slabs grow to hold it; smaller ones retire
                self.size = _round_up(needed + needed // 4, _ROUND)
            if given is not None:
                self._returned.append(given)
            self._collect()
            if self._closed:
                return None
            slab = self._take_free(needed)
            if slab is not None or not make:
                return slab
            count = len(self._live) + self._making
            if count >= self.max_count or (self.pinned and (count + 1) * self.size > self.limit):
                return None
            self._making += 1
            slab_id, size = self._next_id, self.size
            self._next_id += 1
        started = time.perf_counter()
        try:
            slab = Slab(slab_id, size, self.pinned)  # tens of ms when registered: not under the lock
        except Exception as exc:  # noqa: BLE001  (no memory, or CUDA's refusal: this batch goes torch's way)
            with self._lock:
                self._making -= 1
                warn, self._warned = not self._warned, True
            if warn:
                warnings.warn(f"DataLoader: a shared-memory slab of {size} bytes for the worker processes' batches "
                              f"could not be made ({exc}); batches without one travel as torch's shared memory",
                              RuntimeWarning, stacklevel=2)
            return None
        except BaseException:
            with self._lock:
                self._making -= 1
            raise
        with self._lock:
            self._making -= 1
            self.made += 1
            self.make_seconds += time.perf_counter() - started
            if not self._closed:
                self._live[slab.id] = slab
                return slab
        slab.close()  # the loader closed meanwhile
        return None

    def give_back(self, slab: Slab) -> None:
        """A leased slab back: its batch's views are gone, or no batch took it. Takes no lock (it
        runs in finalizers, on any thread)."""
        self._returned.append(slab)  # deque.append/popleft are atomic
        if self._closed:  # the loader is gone: nobody else will take it back (see close)
            self._drain_closed()

    def view_batch(self, blob: bytes, slab: Optional[Slab], placed: bool, missed: bool) -> Any:
        """The batch a process pickled, its tensors rebuilt as views of `slab`."""
        with self._lock:
            if missed or not placed:
                self.misses += int(missed)
            else:
                self.batches += 1
        if slab is None or not placed:
            if slab is not None:
                self.give_back(slab)
            return _SlabUnpickler(io.BytesIO(blob), None).load()
        lease = slab.lease_type.from_address(slab.address)  # type: ignore[attr-defined]  # a ctypes type; no export: the mapping closes when the slab does
        lease.slabs, lease.slab = self, slab
        import torch

        base = torch.frombuffer(lease, dtype=torch.uint8)
        del lease  # the views hold it
        return _SlabUnpickler(io.BytesIO(blob), base).load()

    def close(self) -> None:
        """Closes the free slabs; a slab still viewed by a batch closes when that batch is freed."""
        with self._lock:
            self._closed = True  # set before the drain: a lease that comes back later drains itself
            for slab in self._free:
                self._retire(slab)
            self._free = []
        self._drain_closed()

    def _drain_closed(self) -> None:
        while True:
            try:
                slab = self._returned.popleft()
            except IndexError:
                return
            self._live.pop(slab.id, None)
            slab.close()

    def live_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._live.values())


class _SlabUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, base: Any) -> None:
        super().__init__(file)
        self._base = base

    def persistent_load(self, pid: Any) -> Any:
        _, offset, dtype, shape, nbytes = pid
        return self._base[offset:offset + nbytes].view(dtype).view(shape)


# --- the worker process's side ------------------------------------------------------------------

class ProcessSlabs:
    """The slabs a worker process has mapped, by id."""

    def __init__(self) -> None:
        self._maps: Dict[int, Tuple[mmap.mmap, Any]] = {}

    def add(self, slab_id: int, size: int, fd: int) -> None:
        import torch

        try:  # its pages are there (the main process made them): map them all now, not a fault a page
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._maps[slab_id] = (mm, torch.frombuffer(mm, dtype=torch.uint8))

    def drop(self, ids: List[int]) -> None:
        for slab_id in ids:
            entry = self._maps.pop(slab_id, None)
            if entry is not None:
                mm, base = entry
                del base, entry
                mm.close()

    def dump(self, batch: Any, slab_id: Optional[int],
             ask: Optional[Callable[[int], Optional[int]]] = None) -> Tuple[bytes, bool, bool, bool]:
        """The batch pickled with its tensors written into slab `slab_id`; whether any went into
        the slab; whether any that a slab takes did not (those, and every tensor without a slab,
        go as torch's shared memory); whether every tensor did. With `ask` (the main process's answer, a slab's id or None, for a batch
        of so many bytes), a batch that has no slab or does not fit its slab asks for one."""
        if ask is not None:
            if slab_id is not None:
                try:
                    return self._dump(batch, slab_id, _STRICT)
                except _NoRoom:
                    pass
            needed = _SlabPickler(_Discard(), None, _MEASURE).measure(batch)
            slab_id = ask(needed) if needed else None
        return self._dump(batch, slab_id, _LENIENT)

    def _dump(self, batch: Any, slab_id: Optional[int], mode: int) -> Tuple[bytes, bool, bool, bool]:
        base = self._maps[slab_id][1] if slab_id is not None else None
        out = io.BytesIO()
        pickler = _SlabPickler(out, base, mode)
        pickler.dump(batch)
        whole = pickler.placed and not pickler.missed and not pickler.foreign
        return out.getvalue(), pickler.placed, pickler.missed, whole


_LENIENT, _STRICT, _MEASURE = 0, 1, 2  # a tensor that does not fit: torch's way, _NoRoom, counted only


class _NoRoom(Exception):
    """A tensor does not fit the slab (strict dumps)."""


class _Discard:
    def write(self, data: Any) -> int:
        return len(data)


class _SlabPickler(multiprocessing.reduction.ForkingPickler):
    def __init__(self, file: Any, base: Any, mode: int) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        import torch

        self._torch = torch
        self._base = base
        self._mode = mode
        self._capacity = 0 if base is None else base.numel()
        self._offset = 0
        self.needed = 0
        self.placed = self.missed = False
        self.foreign = False  # a tensor that no slab takes (on a device, sparse, requiring grad, quantized)
        self._seen: Dict[int, Any] = {}

    def measure(self, batch: Any) -> int:
        """The bytes the batch's tensors need in a slab (nothing is written or shared)."""
        self.dump(batch)
        return self.needed

    def persistent_id(self, obj: Any) -> Any:
        torch = self._torch
        if type(obj) is not torch.Tensor:
            return None
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.requires_grad or obj.is_quantized:
            self.foreign = True
            return None  # torch's way
        known = self._seen.get(id(obj))
        if known is not None:
            return known[1]
        nbytes = obj.numel() * obj.element_size()
        self.needed = _round_up(self.needed, ALIGN) + nbytes
        start = _round_up(self._offset, ALIGN)
        if self._mode == _MEASURE:
            pid: Any = ("measured", nbytes)
        elif self._base is None or start + nbytes > self._capacity:
            if self._mode == _STRICT:
                raise _NoRoom
            self.missed = True
            return None  # torch's way: its own shared memory
        else:
            src = obj.resolve_conj().resolve_neg() if obj.is_complex() else obj
            self._base[start:start + nbytes].view(obj.dtype).view(obj.shape).copy_(src)
            self._offset = start + nbytes
            self.placed = True
            pid = ("ferry-slab", start, obj.dtype, tuple(obj.shape), nbytes)
        self._seen[id(obj)] = (obj, pid)  # keeps obj alive, so its id is not reused meanwhile
        return pid
