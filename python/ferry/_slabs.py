"""Shared-memory slabs that worker processes write batches into (Note [Slabs]).

Note [Slabs]
When batches are pinned (pin_memory or device), a worker process collates a batch, then copies
its tensors into a slab (with torch's default_collate and a slab at hand, it stacks them there
instead: Note [Collated into the slab]): a block of the loader's pinned pool whose memory is a memfd segment,
mapped in both processes (its descriptor sent once a process over the process's pipe) and
registered with CUDA (Note [Shared blocks] in python/src/blocks.cpp). Only the batch's structure
crosses the pipe: the batch is pickled with each tensor replaced by a persistent id (its place in
the batch's list of tensors), and the tensors' places in the slab (offset, dtype, shape) come
beside it. The main process hands the loader the structure and the tensors as ferry tensors
viewing the slab (a TensorBatch), and the batch goes through ferry's pipeline as a C++ batch does
(Note [Python batches through the pipeline] in python/src/python_datasets.h): a registered slab
*is* pinned memory, so the pin thread passes it through, and with a device the device stage
copies it, its event fencing the block: the pool reuses the slab only once the last tensor
viewing it is gone *and* that copy has completed. The consumer's thread rebuilds the batch from
the structure with the delivered tensors (pinned host tensors, or device tensors ordered on the
consumer's stream).

A slab is leased by the loader's worker thread for one batch. A request carries a free slab where
there is one; a process whose batch has none, or does not fit the one it was given, says how many
bytes it needs ("need"): at the batch's first sample where it stacks samples as they come (Note
[Samples stacked as they come]; it goes on making samples until the answer comes), else once it
has collated the batch; the worker thread answers with a slab
that holds them: a free one, taken at once, or a new one made then (1.25x the largest batch seen,
rounded up to 1 MiB). Registering a slab of a float image batch takes a tenth of a second or
more, and CUDA registers one at a time (bench/RESULTS.md, "Python datasets"): slabs are made one
at a time, the lowest worker first (under round-robin, the batch the consumer waits for), and only
as they are needed (the first epoch makes them; later ones reuse them). The pool gives back free
slabs smaller than the batches now need as it makes room for new ones.
The number of slabs is bounded (workers x prefetch_factor + 4) and, when pinned, so are their
bytes (the pool's budget: pinned_memory_limit, or half the machine's memory and 3/4 of what is
free); a batch that finds no slab within the bounds (a loop that keeps many batches) travels as
torch's per-tensor shared memory, never waits for one. So does a batch holding a tensor ferry does
not carry (on a device, sparse, requiring grad, quantized, or of a dtype ferry has not). memfd
segments have no name: nothing is left in /dev/shm whatever happens to either process.
"""

from __future__ import annotations

import collections.abc
import io
import mmap
import os
import pickle
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _ferry
from ._pickling import ReplyPickler

ALIGN = 256  # each tensor's offset in a slab (DMA- and vector-friendly)
# Slabs replace the pin copy, so they serve pinned batches (pin_memory or device) only: for a
# pageable batch, torch's per-tensor shared memory is already zero-copy into this process, and a
# slab would add the worker's copy (0.86-0.91x of PyTorch's rate for 38.5 MB batches, against
# 1.25-1.42x without; bench/RESULTS.md). The tests turn this on to run the slab path without CUDA.
FOR_PAGEABLE = False
_ROUND = 1 << 20
# The dtypes ferry carries (ferry::DType), by name: torch's names for the same types.
DTYPES = frozenset(_ferry.DTYPE_NAMES)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Slabs:
    """The slabs of one loader (main process): leases of its pool's shared blocks."""

    def __init__(self, pinned: bool, max_count: int, limit: Optional[int]) -> None:
        self.pinned, self.max_count = pinned, max_count
        if limit is None:  # the loader's own rule for an unset pinned budget (DataLoaderOptions)
            limit = _ferry.pinned_growth_cap() or _ferry.DEFAULT_PINNED_MEMORY_LIMIT
        self.limit = limit
        self.blocks = _ferry.SharedBlocks(pinned, limit)
        self.size = 0  # learned from the batches: a new slab's size
        self._lock = threading.Lock()
        self._make_turn = threading.Condition()  # lease_for's turns: one at a time, lowest worker first
        self._queue: List[int] = []  # the workers waiting for their turn
        self._queue_busy = False
        self._retired: set = set()  # ids the processes should unmap
        self._closed = False
        self._warned = False
        self.batches = 0  # batches whose tensors all travelled in a slab
        self.misses = 0  # batches that travelled as torch's shared memory
        self.streamed = 0  # slab batches stacked as their samples came (Note [Samples stacked as they come])

    @property
    def retired(self) -> set:
        """Ids of the slabs the pool has freed: the processes unmap them."""
        with self._lock:
            self._retired.update(self.blocks.retired())
            return self._retired

    def lease(self) -> Any:
        """A free slab for a batch about to be asked for, or None (none free: the process asks
        for one once it knows the batch's bytes, lease_for)."""
        with self._lock:
            size = self.size
        if self._closed or size == 0:
            return None
        return self.blocks.lease(size, False, self.max_count)

    def lease_for(self, needed: int, worker: int = 0) -> Any:
        """A slab of at least `needed` bytes for a batch a process has collated (it had none, or
        the one it had is too small): a free one, or one made now; None past the bounds (the
        batch then travels as torch's shared memory). Slabs are made one at a time, the lowest
        `worker` waiting first: CUDA registers one at a time whatever the threads
        (bench/probe_slabs.py), and with batch b made by worker b mod num_workers the
        lowest worker's batch is the one the consumer waits for."""
        with self._lock:
            if needed > self.size:  # new slabs grow to hold it; smaller ones are given back
                self.size = _round_up(needed + needed // 4, _ROUND)
            size = self.size
        if self._closed:
            return None
        slab = self.blocks.lease(size, False, self.max_count)  # a free one needs no turn
        if slab is not None:
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
            if self._closed:
                return None
            return self.blocks.lease(size, True, self.max_count)  # tens of ms when registered
        except Exception as exc:  # noqa: BLE001  (no memory, or CUDA's refusal: this batch goes torch's way)
            with self._lock:
                warn, self._warned = not self._warned, True
            if warn:
                warnings.warn(f"DataLoader: a shared-memory slab of {size} bytes for the worker processes' batches "
                              f"could not be made ({exc}); batches without one travel as torch's shared memory",
                              RuntimeWarning, stacklevel=2)
            return None
        finally:
            with self._make_turn:
                self._queue_busy = False
                self._make_turn.notify_all()

    def view_batch(self, blob: bytes, slab: Any, regions: Optional[List[Tuple[int, str, Tuple[int, ...]]]],
                   streamed: bool = False) -> Any:
        """The batch a process pickled: a TensorBatch for the loader where its tensors are all in
        `slab` (`regions`: their places), else the batch itself (its tensors torch's shared memory).
        `streamed`: the process stacked its samples into the slab as they came."""
        with self._lock:
            if slab is not None and regions is not None:
                self.batches += 1
                self.streamed += bool(streamed)
            else:
                self.misses += 1
        if slab is None or regions is None:
            return pickle.loads(blob)
        return _ferry.TensorBatch(blob, slab, regions)

    def close(self) -> None:
        """No slab is leased after; each goes back to the pool as its batch is freed."""
        self._closed = True

    def stats(self) -> Dict[str, Any]:
        """The loader's slab counts, as stats() reports them."""
        blocks = self.blocks.stats()
        return {"slab_batches": self.batches, "slab_streamed": self.streamed, "slab_misses": self.misses,
                "slab_bytes": blocks["bytes"],
                "slabs_made": blocks["made"], "slab_make_seconds": blocks["make_seconds"]}


def rebuild(delivered: Any) -> Any:
    """A batch delivered with its tensors (ferry._ferry.Delivered): its structure, unpickled with
    each persistent id replaced by its tensor."""
    return _Rebuilder(io.BytesIO(delivered.structure), delivered.tensors).load()


class _Rebuilder(pickle.Unpickler):
    def __init__(self, file: Any, tensors: List[Any]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors[pid[1]]


# --- the worker process's side ------------------------------------------------------------------

class Asking:
    """How a worker process asks the main process for a slab (Note [Slabs]): send() the bytes a
    batch needs; answer() is (whether the answer has come, the slab's id or None), waiting for it
    with `wait`, else only looking. Calling it does both: the id, or None."""

    def send(self, needed: int) -> None:
        raise NotImplementedError

    def answer(self, wait: bool) -> Tuple[bool, Optional[int]]:
        raise NotImplementedError

    def __call__(self, needed: int) -> Optional[int]:
        self.send(needed)
        return self.answer(True)[1]


class ProcessSlabs:
    """The slabs a worker process has mapped, by id."""

    def __init__(self) -> None:
        self._maps: Dict[int, Tuple[mmap.mmap, Any]] = {}
        self._placed: Optional[_Placer] = None  # what collate() stacked into a slab, for the next dump()

    def placer(self, slab_id: Optional[int], samples: int, ask: "Optional[Asking]" = None) -> "_Placer":
        """What stacks a batch of `samples` samples into slab `slab_id`: take() each sample as it
        is made (Note [Samples stacked as they come]), then settle() the list and collate() it
        with it. With no slab, `ask` asks the main process for one once the first sample shows the
        batch's bytes, and the samples go on meanwhile (the placer's slab_id once answered)."""
        from torch.utils.data._utils import collate as torch_collate

        return _Placer(self._maps, torch_collate.collate_tensor_fn, samples, slab_id, ask)

    def collate(self, samples: List[Any], slab_id: int, placer: "Optional[_Placer]" = None) -> Any:
        """torch's default_collate of `samples`, each tensor it stacks made in slab `slab_id`
        where it fits (Note [Collated into the slab]), or already there where `placer` took the
        samples as they came; dump() of the result with the same slab writes those tensors no
        more."""
        from torch.utils.data._utils import collate as torch_collate

        if placer is None:
            placer = self.placer(slab_id, len(samples))
        fn_map = dict(torch_collate.default_collate_fn_map)
        import torch

        fn_map[torch.Tensor] = placer.stack
        batch = torch_collate.collate(samples, collate_fn_map=fn_map)
        self._placed = placer
        return batch

    def add(self, slab_id: int, size: int, fd: int) -> None:
        import torch

        try:  # its pages are there (the main process made them): map them all now, not a fault a page
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._maps[slab_id] = (mm, torch.frombuffer(mm, dtype=torch.uint8))

    def drop(self, ids: List[int]) -> None:
        """Unmaps slabs the pool has freed. Nothing of this process may view them any more: the
        worker's loop lets go of each batch once its reply is sent."""
        for slab_id in ids:
            entry = self._maps.pop(slab_id, None)
            if entry is not None:
                mm, base = entry
                del base, entry
                mm.close()

    def dump(self, batch: Any, slab_id: Optional[int],
             ask: Optional[Callable[[int], Optional[int]]] = None) -> Tuple[bytes, Optional[List[Any]]]:
        """The batch pickled, with its tensors written into slab `slab_id` where they all fit: (the
        pickle, the tensors' places in the slab), each tensor in the pickle a persistent id (its
        place in that list). Else (no slab, one too small, or a tensor ferry does not carry) the
        batch pickled as torch pickles it, its tensors in torch's shared memory: (the pickle,
        None). With `ask` (the main process's answer, a slab's id or None, for a batch of so many
        bytes), a batch that has no slab or does not fit its slab asks for one."""
        placed, self._placed = self._placed, None  # what collate() put in this slab for this batch
        if slab_id is not None:
            try:
                return self._dump(batch, slab_id, placed)
            except _NoRoom:
                foreign = False
            except _Foreign:
                foreign = True
            if placed is not None:  # the batch leaves the slab, which goes back to the pool
                placed.detach()
            if foreign:
                return _plain(batch), None
        if ask is None:
            return _plain(batch), None
        try:
            needed = _SlabPickler(_Discard(), None, _MEASURE).measure(batch)
        except _Foreign:
            return _plain(batch), None
        slab_id = ask(needed) if needed else None
        if slab_id is None:
            return _plain(batch), None
        try:
            return self._dump(batch, slab_id)
        except (_NoRoom, _Foreign):  # the slab answered is smaller than asked: not the main process's way
            return _plain(batch), None

    def _dump(self, batch: Any, slab_id: int, placed: "Optional[_Placer]" = None) -> Tuple[bytes, Optional[List[Any]]]:
        out = io.BytesIO()
        pickler = _SlabPickler(out, self._maps[slab_id][1], _STRICT, placed)
        pickler.dump(batch)
        return out.getvalue(), pickler.regions


class _Placer:
    """The tensors collate() stacked into one slab, and where.

    Note [Collated into the slab]
    A worker process given a slab with its request, whose collate_fn is torch's default_collate,
    collates through torch's own collate() with one entry of its map replaced: a list of plain CPU
    tensors of one shape and one dtype ferry carries is stacked (torch.stack, out=) straight into
    the slab, where torch's collate_tensor_fn stacks it into a new shared-memory segment that the
    slab pickler then copies into the slab. The values, dtype and shape are torch.stack's either
    way; anything else (a tensor subclass, one requiring grad, mixed shapes or dtypes, no room
    left) goes to torch's collate_tensor_fn as it is. The slab's first bytes hold the stacked
    tensors, in the order collate made them; dump() lays the batch's other tensors after them.
    Where the batch then does not go through this slab (it does not fit, or holds a tensor no
    slab takes), the placed tensors are moved to memory of their own first (detach()): the main
    process gives the slab back to the pool as it answers a request for a larger one. The ResNet
    recipe's float batch (154 MB) is thus written once, into memory already mapped, where it was
    written twice, first into a segment new each batch (147 page faults an image): 0.115 against
    0.692 ms of a worker's CPU an image on the H200 host (bench/RESULTS.md, "Python datasets:
    batches stacked into the slab"). Without __getitems__, each sample's tensors now go to the
    slab as the sample comes (Note [Samples stacked as they come]), and collate finds them there."""

    def __init__(self, maps: Dict[int, Tuple[mmap.mmap, Any]], fallback: Callable, samples: int,
                 slab_id: Optional[int] = None, ask: Optional[Asking] = None) -> None:
        import torch

        self._torch = torch
        self.fallback, self._maps = fallback, maps  # the process's slabs, by id
        self.base: Any = None if slab_id is None else maps[slab_id][1]  # the slab as bytes, once there is one
        self.samples = samples  # the batch's
        self.slab_id = slab_id  # the slab `base` views (None: none yet, or none given)
        self.refused = False  # a slab was asked for and none given
        self.streamed = False  # collate found a stacked tensor whole, its rows filled as the samples came
        self._ask = ask  # no slab yet: asked once the first sample is seen
        self._pending: Optional[Asking] = None  # asked, not yet answered
        self._held: List[Any] = []  # the samples taken while the answer was awaited, as they are
        self._late: List[Any] = []  # those samples again, their tensors in their rows (settle())
        self.offset = 0
        self.placed: Dict[int, Tuple[Any, Tuple[int, str, Tuple[int, ...]]]] = {}
        # Note [Samples stacked as they come]: by each tensor's place in the first sample's walk,
        # its stacked tensor and that tensor's place in the slab (None: not stacked as it came);
        # and each row handed out in a sample, by id: (its tensor's place in the walk, its row, it).
        self._stacks: List[Optional[Tuple[Any, Tuple[int, str, Tuple[int, ...]]]]] = []
        self._rows: Dict[int, Tuple[int, int, Any]] = {}
        self._taken = 0

    def _plain(self, t: Any) -> bool:
        """Whether `t` is a tensor this placer stacks: a plain CPU tensor of a dtype ferry carries."""
        torch = self._torch
        return type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided and \
            not t.is_nested and not t.is_quantized and not t.requires_grad and str(t.dtype)[6:] in DTYPES

    def _room(self, dtype: Any, shape: Tuple[int, ...], nbytes: int) -> Optional[Tuple[Any, int]]:
        """A tensor of `shape` in the slab after what is placed, and where it starts; None if it does not fit."""
        start = _round_up(self.offset, ALIGN)
        if start + nbytes > self.base.numel():
            return None
        self.offset = start + nbytes
        return self.base[start:start + nbytes].view(dtype).view(shape), start

    def take(self, sample: Any) -> Any:
        """The sample, each plain tensor in its tuples, lists, dicts and namedtuples copied into its
        row of the batch's stacked tensor in the slab, and replaced by that row.

        Note [Samples stacked as they come]
        torch's default_collate stacks a batch's tensors once every sample is made, so a worker
        holds the whole batch's samples until then (154 MB for the ResNet recipe's float images)
        and reads them back from memory to stack them: 3.22 against 2.83 ms of CPU an image in 15
        processes making the recipe's samples (bench/recipe_ceiling.py, --batch 256 against 1).
        A worker process collating with default_collate into a slab (Note [Collated into the
        slab]) instead copies each sample's tensors into the slab as the sample comes out of
        __getitem__, still in cache, and the sample keeps only the row: the first sample lays out
        a stacked tensor for each of its plain tensors, (batch size, *its shape), and the later
        samples' tensors of that place, dtype and shape go to their rows. collate() then finds,
        for such a place, every row of one stacked tensor in order, and returns that tensor: the
        values, dtype and shape torch.stack gives. Anything else (a tensor of another dtype or
        shape, a subclass, a container this does not rebuild: a custom Mapping or Sequence) stays
        in the sample as it was, and collate stacks the list it is in as before, rows included:
        the same values. A sample's containers are rebuilt as their own type (tuple, list, dict,
        namedtuple), as collate rebuilds them; the dataset's own objects are never changed.
        A request that carries no slab (none was free when it was sent: the slab of the batch
        just taken is still the consumer's) asks for one at its first sample, for the bytes that
        sample announces (at once, not once the batch is collated as dump() asks): in
        test_python_datasets.py's loader test of this, five of six batches found none in their
        request, and were held whole before. The samples go on while the main process answers
        (making a slab registers it with CUDA, a tenth of a second or more, one at a time: a
        first epoch's fifteen workers asking at once would wait up to two seconds): each sample
        taken meanwhile is held as it is, and the answer is looked for as each sample comes; once
        it has come, the held samples' tensors go to their rows, and settle() puts those samples,
        rebuilt, in the batch's list (it waits for the answer if the batch is made first). In 15
        processes on the H200 host: 3.35 against 3.59 and 3.71 against 4.24 ms of CPU an image on
        two starts of the host, where the recipe with no batches took 2.86 and 3.64
        (bench/RESULTS.md, "Python datasets: the refill under round-robin")."""
        row = self._taken
        self._taken += 1
        if row == 0 and self.base is None and self._ask is not None:
            self._bind(sample)
        if self._pending is not None:
            self._answered(False)
            if self._pending is not None:
                self._held.append(sample)
                return sample
        if row >= self.samples or self.base is None:
            return sample
        return self._walk(sample, row, [0])

    def settle(self, samples: List[Any]) -> List[Any]:
        """`samples` (the list of what take() returned) as collate is to take it: the answer to
        the slab asked for waited for if it has not come, and the samples held until it came
        replaced by their rebuilt selves, their tensors in their rows."""
        if self._pending is not None:
            self._answered(True)
        late, self._late = self._late, []
        samples[:len(late)] = late
        return samples

    def close(self) -> None:
        """The batch was not made: an answer still to come is waited for (the pipe must not keep
        it for the worker's next message) and let go, with what was held."""
        pending, self._pending = self._pending, None
        self._held, self._late = [], []
        if pending is not None:
            pending.answer(True)

    def _bind(self, first: Any) -> None:
        """Asks for a slab that holds the batch the first sample announces: its tensors stacked,
        and a number (an int, a float, a numpy value) a sample for what collate makes a tensor of,
        as dump() would count them. Asked once; None: the batch goes as it did."""
        ask, self._ask = self._ask, None
        torch = self._torch
        needed = 0
        todo = [first]
        walked = set()  # containers seen: one that holds itself is walked once, not forever
        while todo:
            o = todo.pop()
            container = isinstance(o, collections.abc.Mapping) or \
                (isinstance(o, collections.abc.Sequence) and not isinstance(o, (str, bytes)))
            if container:
                if id(o) in walked:
                    continue
                walked.add(id(o))
            if isinstance(o, collections.abc.Mapping):  # as default_collate walks them
                todo.extend(o.values())
            elif container:
                todo.extend(o)
            elif isinstance(o, torch.Tensor):
                needed = _round_up(needed, ALIGN) + o.numel() * o.element_size() * self.samples
            elif isinstance(o, (int, float)):  # bool is an int
                needed = _round_up(needed, ALIGN) + 8 * self.samples
            elif type(o).__module__ == "numpy" and isinstance(getattr(o, "nbytes", None), int):
                needed = _round_up(needed, ALIGN) + o.nbytes * self.samples
        if ask is None or not needed:
            self.refused = True
            return
        ask.send(needed)
        self._pending = ask

    def _answered(self, wait: bool) -> None:
        """Takes the answer to the slab asked for if it has come (with `wait`, once it comes): the
        slab, the samples held meanwhile walked into their rows; or none, the batch going as it
        did."""
        pending, held = self._pending, self._held
        assert pending is not None  # (_bind asked)
        came, slab_id = pending.answer(wait)
        if not came:
            return
        # let go of the asker: it holds the process's slabs, which hold this placer
        self._pending, self._held = None, []
        if slab_id is None:
            self.refused = True
            return
        self.slab_id, self.base = slab_id, self._maps[slab_id][1]
        self._late = [self._walk(sample, row, [0]) for row, sample in enumerate(held)]

    def _walk(self, o: Any, row: int, place: List[int]) -> Any:
        """take()'s walk of one object of sample `row`; place[0] counts the tensors met so far.
        (A method, not a closure: a closure that calls itself is a reference cycle, and would
        keep the rows, so the slab, mapped until the collector runs.)"""
        kind = type(o)
        if kind is self._torch.Tensor:
            at = place[0]
            place[0] += 1
            stacks = self._stacks
            if row == 0:
                stacks.append(None)
                if self._plain(o):
                    shape = (self.samples,) + tuple(o.shape)
                    room = self._room(o.dtype, shape, o.numel() * o.element_size() * self.samples)
                    if room is not None:
                        stacks[at] = (room[0], (room[1], str(o.dtype)[6:], shape))
            stacked = stacks[at] if at < len(stacks) else None
            if stacked is None or o.dtype != stacked[0].dtype or o.shape != stacked[0].shape[1:] or \
                    not self._plain(o):
                return o
            mine = stacked[0][row]
            mine.copy_(o)
            self._rows[id(mine)] = (at, row, mine)
            return mine
        if kind is tuple or kind is list:
            return kind(self._walk(x, row, place) for x in o)
        if kind is dict:
            return {key: self._walk(value, row, place) for key, value in o.items()}
        if isinstance(o, tuple) and hasattr(o, "_fields"):  # a namedtuple
            return kind(*(self._walk(x, row, place) for x in o))
        return o

    def stack(self, batch: Any, *, collate_fn_map: Any = None) -> Any:
        torch = self._torch
        first = self._rows.get(id(batch[0]))
        if first is not None and len(batch) == self.samples:
            at = first[0]
            stacked = self._stacks[at]  # a row's place has its stack
            # (_rows keeps each row alive, so an id found there is that row's)
            if stacked is not None and all(self._rows.get(id(x), (None, None))[:2] == (at, j)
                                           for j, x in enumerate(batch)):
                out, where = stacked
                self.placed[id(out)] = (out, where)
                self.streamed = True
                return out
        elem = batch[0]
        if self._plain(elem) and all(self._plain(x) and x.dtype == elem.dtype and x.shape == elem.shape
                                     for x in batch):
            shape = (len(batch),) + tuple(elem.shape)
            room = self._room(elem.dtype, shape, elem.numel() * len(batch) * elem.element_size())
            if room is not None:
                out, start = room
                torch.stack(batch, 0, out=out)
                self.placed[id(out)] = (out, (start, str(elem.dtype)[6:], shape))
                return out
        return self.fallback(batch, collate_fn_map=collate_fn_map)

    def detach(self) -> None:
        """Moves each placed tensor to memory of its own (the batch holding it sees the move)."""
        for out, _ in self.placed.values():
            out.set_(out.clone())
        self.placed.clear()


def _plain(batch: Any) -> bytes:
    return bytes(ReplyPickler.dumps(batch, pickle.HIGHEST_PROTOCOL))


_STRICT, _MEASURE = 1, 2  # a tensor that does not fit: _NoRoom; counted only


class _NoRoom(Exception):
    """A tensor does not fit the slab."""


class _Foreign(Exception):
    """A tensor no slab takes (on a device, sparse, requiring grad, quantized, a dtype ferry has not)."""


class _Discard:
    def write(self, data: Any) -> int:
        return len(data)


class _SlabPickler(ReplyPickler):
    def __init__(self, file: Any, base: Any, mode: int, placed: Optional[_Placer] = None) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        import torch

        self._torch = torch
        self._base = base
        self._mode = mode
        self._capacity = 0 if base is None else base.numel()
        self._placed = {} if placed is None else placed.placed  # already in the slab: written no more
        self._offset = 0 if placed is None else placed.offset
        self.needed = 0
        self.regions: List[Any] = []  # (offset, dtype, shape) of each tensor written, by persistent id
        self._seen: Dict[int, Any] = {}

    def measure(self, batch: Any) -> int:
        """The bytes the batch's tensors need in a slab (nothing is written or shared)."""
        self.dump(batch)
        return self.needed

    def persistent_id(self, obj: Any) -> Any:
        torch = self._torch
        if type(obj) is not torch.Tensor:
            return None
        known = self._seen.get(id(obj))
        if known is not None:
            return known[1]
        dtype = str(obj.dtype)[6:]  # "torch.float32"
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.requires_grad or obj.is_quantized or \
                dtype not in DTYPES:
            raise _Foreign
        nbytes = obj.numel() * obj.element_size()
        self.needed = _round_up(self.needed, ALIGN) + nbytes
        placed = self._placed.get(id(obj))
        pid: Any
        if placed is not None and placed[0] is obj:
            pid = ("ferry-slab", len(self.regions))
            self.regions.append(placed[1])
        elif self._mode == _MEASURE:
            pid = ("measured", nbytes)
        else:
            start = _round_up(self._offset, ALIGN)
            if start + nbytes > self._capacity:
                raise _NoRoom
            self._base[start:start + nbytes].view(obj.dtype).view(obj.shape).copy_(obj)
            self._offset = start + nbytes
            pid = ("ferry-slab", len(self.regions))
            self.regions.append((start, dtype, tuple(obj.shape)))
        self._seen[id(obj)] = (obj, pid)  # keeps obj alive, so its id is not reused meanwhile
        return pid
