"""Worker processes for Python datasets: each of the loader's worker threads drives one process.

The engine's worker thread w sends a batch's indices to process w and waits for the collated
batch without the GIL (the pipe read releases it); the process fetches the samples, collates them
and sends the batch back through torch's multiprocessing pickler, whose tensors travel in shared
memory (file descriptors passed over the pipe's socket), not through the pipe; a pinned batch's
tensors are written into a CUDA-registered slab instead (Note [Slabs] in _slabs.py). So the dataset's
Python code runs in parallel whatever it holds, and the engine keeps its ordering, timeouts,
on_error, resume and Ctrl-C.

Processes are forked from the loader's zygote (Note [Zygote] in _zygote.py), or started by the
multiprocessing context the user names (forkserver or spawn; never a bare fork of this process,
which holds ferry's and torch's threads). A process is started ahead (when the loader is made,
or as an epoch's workers are replaced) and seeded at its epoch's start ("start": the epoch's base
seed + its id, then worker_init_fn), as torch seeds a worker it starts then. They ignore SIGINT
(Ctrl-C is the main process's to handle), die with the main process, quietly (Note [Quiet ends]
in _worker.py), and are stopped when the loader is freed or closed, or at exit. A process stuck
past `timeout` is killed when the engine replaces its thread; one that dies is reported with its
signal and started again.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.reduction
import multiprocessing.util
import os
import pickle
import signal
import threading
import time
from typing import Any, Dict, List, Optional

from . import _pickling, _python, _slabs, _worker, _zygote


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (the cause of the re-raised one)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.ferry_remote_traceback = text

    def __str__(self) -> str:
        return self.ferry_remote_traceback


class WorkerDied(RuntimeError):
    """A worker process ended while it made a batch (a crash, the OOM killer, a kill from outside)."""


_context_lock = threading.Lock()
_start_lock = threading.Lock()
_contexts: Dict[str, Any] = {}


def context(name: Any) -> Any:
    """The multiprocessing context the user named (None: the zygote's, Note [Zygote], where this
    system has it; else forkserver, preloading torch and ferry once, or spawn)."""
    if name is None:
        if _zygote.enabled():
            return None
        name = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if not isinstance(name, str):
        return name  # a context object, as torch takes
    if name == "fork":
        raise ValueError("DataLoader: multiprocessing_context='fork' is not taken: this process runs ferry's and "
                         "torch's threads, and a fork copies their locks in whatever state they are; leave it unset "
                         "(ferry's workers are forked from a zygote that runs no threads, as fast to start as "
                         "fork), or use 'forkserver' or 'spawn'")
    with _context_lock:
        if name not in _contexts:
            ctx = multiprocessing.get_context(name)
            if name == "forkserver":
                ctx.set_forkserver_preload(["torch", "ferry"])
            _contexts[name] = ctx
        return _contexts[name]


check_picklable = _pickling.check_picklable  # (a name of this module: tests count its calls)


# The quick fingerprint's limit where no full one was taken (a loader zygote forked from this process).
_QUICK_LIMIT = 1 << 30


class _Slot:
    def __init__(self, proc: Any, conn: Any, generation: int) -> None:
        self.proc, self.conn, self.busy = proc, conn, False
        self.generation = generation
        self.started = False  # sent its epoch's "start" (seeds, worker_init_fn)
        self.starting = False  # that "start"'s reply is read before the first batch
        self.mapped: set = set()  # ids of the slabs this process has mapped


class Pool:
    """The processes of one loader, one a worker thread (slot). A process is kept while it is
    healthy and its generation current: with persistent workers for the loader's life (seeded and
    worker_init_fn run once), without them for one epoch (each epoch's workers are new processes,
    forked from a zygote that holds the dataset as it was at that epoch's iter())."""

    def __init__(self, ctx: Any, payload: tuple, slabs: Optional[_slabs.Slabs] = None) -> None:
        self._ctx = ctx  # None: forked from the loader's zygote
        self.slabs = slabs
        self._payload = payload  # (dataset, fetch mode, finish, worker_init_fn, sample seeding)
        forked = None
        self._fingerprint: Optional[bytes] = None  # the full fingerprint, where this process took one
        # What the loader's zygote holds, as (quick fingerprint, full one as ("bytes", fingerprint)
        # or ("digest", its digest)), either None where not known; None: ask the zygote.
        self._held: Optional[tuple] = None
        self._no_quick = False  # this payload had no quick fingerprint: not asked for one again
        self._told_by: Optional[_zygote.LoaderZygote] = None  # whose baseline says whether the payload pickles
        if ctx is None and _zygote.fork_safe():
            # Note [Loader zygotes forked from the main process] (_zygote.py): nothing is taken
            # here; the child takes the payload's fingerprint itself when asked, the baseline the
            # first epoch's start compares with and the check that the dataset pickles.
            try:
                forked = _zygote.LoaderZygote.forked(payload)
            except OSError:
                pass
        if forked is None:
            self._fingerprint, plain = check_picklable(payload)
            quick = self._quick_fingerprint()
            self._held, self._no_quick = (quick, ("bytes", self._fingerprint)), quick is None
        self._lock = threading.Lock()
        self._start_locks: Dict[int, threading.Lock] = {}
        self._prestarter: Optional[threading.Thread] = None
        self._slots: Dict[int, _Slot] = {}
        self._closed = False
        self.generation = 0
        self.base_seed = 0
        self._epochs = 0
        self._loader_zygote: Optional[_zygote.LoaderZygote] = None
        self._connect_lock = threading.Lock()
        self._connected = False
        self._connect_error: Optional[BaseException] = None
        self._retired: List[_zygote.LoaderZygote] = []  # loader zygotes ended, reaped at close()
        self._forked = forked is not None
        if forked is not None:
            self._loader_zygote, self._connected = forked, True
        elif ctx is None:
            # The dataset is pickled now, as it is; it travels once to this loader's zygote (which
            # loads it while the script goes on) on the prestart thread, which may first wait for
            # a fresh zygote's imports; the workers are forked from it.
            self._first_blob: Optional[bytes] = self._fingerprint if plain else self._dumps()
        elif ctx.get_start_method() == "forkserver":
            # Now, on the loader's construction: the server imports torch once (a second or two),
            # and a worker thread starting its process then waits only for a fork, so that even a
            # loop interrupted as it starts ends at once.
            from multiprocessing import forkserver

            forkserver.ensure_running()

    @property
    def unsettled(self) -> bool:
        """Whether settle() has something to read."""
        return self._told_by is not None

    @property
    def forked(self) -> bool:
        """Whether this loader's zygote was forked from this process (Note [Loader zygotes forked
        from the main process])."""
        return self._forked

    def _zygote_of_loader(self) -> _zygote.LoaderZygote:
        """This loader's zygote, asked for (and sent the dataset) by the first caller; the others
        wait for it."""
        with self._connect_lock:
            if not self._connected:
                try:
                    loader_zygote = _zygote.get().new_loader()
                    blob, self._first_blob = self._first_blob, None
                    assert blob is not None
                    loader_zygote.send_payload(blob)
                    with self._lock:
                        closed = self._closed
                        if not closed:
                            self._loader_zygote = loader_zygote
                    if closed:
                        loader_zygote.close()
                except BaseException as exc:  # noqa: BLE001  (every later caller raises it)
                    self._connect_error = exc
                self._connected = True
        if self._connect_error is not None:
            raise RuntimeError(f"DataLoader: the worker processes' zygote could not be reached: "
                               f"{self._connect_error}") from self._connect_error
        if self._loader_zygote is None:
            raise RuntimeError("DataLoader: the loader's worker processes were stopped")
        return self._loader_zygote

    def _quick_fingerprint(self) -> Optional[bytes]:
        """The payload's quick fingerprint (Note [Datasets by value]), at most four times its full one
        (_QUICK_LIMIT where none was taken)."""
        limit = _QUICK_LIMIT if self._fingerprint is None else 4 * len(self._fingerprint) + (1 << 20)
        return _pickling.quick_fingerprint(self._payload, limit)

    def _dumps(self) -> bytes:
        import torch.multiprocessing  # noqa: F401  (the tensor reductions)

        with _start_lock:  # torch shares a tensor's storage once; two threads pickling it at once broke it
            return _pickling.dumps(self._payload)

    def begin_epoch(self, base_seed: int, renew: bool) -> None:
        """At an epoch's iter(), before its workers start: the epoch's base seed, and with `renew`
        (workers that are not persistent) the epoch's own processes, over the dataset as it is now
        (sent again only if it changed since it was last sent)."""
        self.settle()  # the first epoch ended early
        first = self._epochs == 0
        self._epochs += 1
        self.base_seed = base_seed
        if not renew and not first:
            return
        if first and self._forked and self._fork_again():
            return
        sent = self._changed()
        if sent is not None:
            fingerprint, plain = sent
            if self._ctx is None:
                self._zygote_of_loader().send_payload(fingerprint if plain else self._dumps())
        if sent is not None or (renew and not first):
            with self._lock:
                self.generation += 1

    def _fork_again(self) -> bool:
        """At the first epoch's iter() of a loader whose zygote was forked when it was made: where
        this process may still fork, a new zygote forked now holds the dataset as it is, so nothing
        is compared (Note [Loader zygotes forked from the main process]). The first one's baseline
        is read by settle(), which then ends it."""
        if not _zygote.fork_safe():
            return False
        try:
            again = _zygote.LoaderZygote.forked(self._payload)
        except OSError:
            return False
        with self._lock:
            closed = self._closed
            if not closed:
                self._told_by, self._loader_zygote = self._loader_zygote, again
        if closed:  # closed meanwhile: the caller finds it so
            again.close()
            return False
        return True

    def settle(self, wait: bool = True) -> None:
        """Where the loader zygote forked when the loader was made was replaced by _fork_again():
        its baseline is asked for, and read (`wait`: or only if it has come), and a dataset that
        does not pickle is a TypeError naming what fails, as it is where the dataset is sent. Then
        that zygote is ended (reaped at close()). Called after each of the first epoch's batches
        until it answers (the first asks), and at the epoch's end and the next one's start (Note
        [Loader zygotes forked from the main process])."""
        with self._lock:
            told_by = self._told_by
        if told_by is None:
            return
        told_by.ask(_QUICK_LIMIT)
        with self._lock:
            if self._told_by is not told_by or not (wait or told_by.answered()):
                return
            self._told_by = None
        error = told_by.baseline(_QUICK_LIMIT)[2]
        told_by.close(reap=False)
        self._retired.append(told_by)
        if error is not None:
            raise TypeError(error)

    def _changed(self) -> Optional[tuple]:
        """The payload's full fingerprint and whether it is the payload's pickle, where it differs
        from what the loader's zygote holds (the zygote is asked where this process does not know);
        None where it is the same."""
        held = self._held
        if held is None:  # the zygote takes its fingerprint as this process takes its own
            self._zygote_of_loader().ask(_QUICK_LIMIT)
        quick = None if self._no_quick else self._quick_fingerprint()
        if held is None:
            theirs, full, _ = self._zygote_of_loader().baseline(_QUICK_LIMIT)
            held = (theirs, ("digest", full) if full is not None else None)
        self._no_quick = quick is None
        if quick is not None and quick == held[0]:
            self._held = held
            return None
        fingerprint, plain = check_picklable(self._payload)  # a TypeError naming what does not pickle
        self._fingerprint = fingerprint
        kind, value = held[1] if held[1] is not None else (None, None)
        same = value == (fingerprint if kind == "bytes" else _pickling.digest(fingerprint)) if kind else False
        self._held = (quick, ("bytes", fingerprint))
        return None if same else (fingerprint, plain)

    def prestart(self, workers: int) -> None:
        """Starts the processes now, on a thread of their own, while the script goes on (builds its
        model): the engine's worker threads find them started (start() keeps a live, idle process
        of the current generation). A process that fails to start is left to the worker thread's
        own start(), which says why."""

        def run() -> None:
            for worker in range(workers):
                try:
                    self.start(worker, workers, only_if_none=True)
                except Exception:  # noqa: BLE001
                    return

        self._prestarter = threading.Thread(target=run, name="ferry: start worker processes", daemon=True)
        self._prestarter.start()

    def start(self, worker: int, workers: int, only_if_none: bool = False) -> None:
        """On the engine's worker thread `worker` as its epoch starts: its process, kept if it is
        alive, idle and of this generation, else new (a stuck, dead or older one is stopped first),
        told to start its epoch (seeds, worker_init_fn). `only_if_none` (the prestart thread): only
        where worker `worker` has no process yet, and without the epoch's start."""
        with self._lock:
            lock = self._start_locks.setdefault(worker, threading.Lock())
        with lock:  # the prestart thread and the worker's own thread start one process, not two
            slot = self._start(worker, workers, only_if_none)
            if slot is not None and not only_if_none and not slot.started:
                slot.started = slot.starting = True
                try:
                    slot.conn.send(("start", self.base_seed))
                except OSError:
                    pass  # the process is gone: the first call finds it so and says how it ended

    def _start(self, worker: int, workers: int, only_if_none: bool) -> Optional[_Slot]:
        with self._lock:
            if self._closed:
                raise RuntimeError("DataLoader: the loader's worker processes were stopped")
            old = self._slots.get(worker)
            generation = self.generation
            if old is not None and only_if_none:
                return None
            if old is not None and not old.busy and old.generation == generation and _alive(old.proc):
                return old
            self._slots.pop(worker, None)
        if old is not None:
            _stop([old], wait=0.5 if old.generation != generation and not old.busy else 0)
        proc: Any
        if self._ctx is None:
            parent, proc = self._zygote_of_loader().fork(worker, workers)
        else:
            parent, child = self._ctx.Pipe(duplex=True)
            # The payload goes over the pipe, not as the process's arguments: multiprocessing
            # writes those into a pipe the new process reads only once it runs, so a payload over
            # the pipe's 64 KiB kept start() waiting for the process's whole start.
            blob = self._dumps()
            proc = self._ctx.Process(target=_worker.main, args=(child, worker, workers, os.getpid()), daemon=True,
                                     name=f"ferry worker {worker}")
            proc.start()
            child.close()
            try:
                parent.send_bytes(blob)  # read first by the process; the GIL is released while this waits
            except OSError:
                pass  # the process is gone: the first call finds it so and says how it ended
        slot = _Slot(proc, _zygote.own(parent), generation)
        with self._lock:
            closed = self._closed
            if not closed:
                self._slots[worker] = slot
        if closed:  # the loader was closed while this process started
            _stop([slot], wait=0)
            raise RuntimeError("DataLoader: the loader's worker processes were stopped")
        return slot

    def call(self, worker: int, message: Any) -> Any:
        with self._lock:
            slot = self._slots.get(worker)
            closed = self._closed or multiprocessing.util._exiting  # type: ignore[attr-defined]  # set as Python exits
        if closed:
            raise RuntimeError("DataLoader: the loader's worker processes were stopped")
        # An idle process sends nothing: a readable pipe means it has ended (killed from outside).
        if slot is None or not _alive(slot.proc) or (not slot.starting and slot.conn.poll()):
            info = _python._local.info
            self.start(worker, info.num_workers)
            with self._lock:
                slot = self._slots[worker]
        slot.busy = True
        if slot.starting:
            self._reply(slot, worker, None)  # the epoch's start, or worker_init_fn's exception
            slot.starting = False
        if message[0] != "map":
            slot.conn.send(message)
            value = self._reply(slot, worker, message)
            slot.busy = False
            return value
        slabs = self.slabs
        lease = slabs.lease() if slabs is not None else None
        drops = []
        if slabs is not None:
            retired = slabs.retired
            drops = [i for i in slot.mapped if i in retired]
            slot.mapped.difference_update(drops)
        try:
            self._send_slab(slot, lease)
            slot.conn.send(message + (None if lease is None else lease.id, drops, slabs is not None))
            kind, value = self._reply(slot, worker, message, kinds=True)
            while kind == "need" and slabs is not None:  # no slab, or too small (Note [Slabs])
                lease = None  # back to the pool before another is asked for
                lease = slabs.lease_for(value, worker)
                self._send_slab(slot, lease)
                slot.conn.send(("into", None if lease is None else lease.id))
                kind, value = self._reply(slot, worker, message, kinds=True)
        except BaseException:
            lease = None  # not held by the traceback's frame: the block goes back to the pool now
            raise
        blob, regions, streamed = value
        slot.busy = False
        if slabs is None:
            return Collated(pickle.loads(blob))
        return Collated(slabs.view_batch(blob, lease, regions, streamed))

    @staticmethod
    def _send_slab(slot: _Slot, lease: Any) -> None:
        """The slab's descriptor, to a process that has not mapped it yet."""
        if lease is not None and lease.id not in slot.mapped:
            slot.conn.send(("slab", lease.id, lease.size))
            multiprocessing.reduction.send_handle(slot.conn, lease.fd, slot.proc.pid)
            slot.mapped.add(lease.id)

    def _reply(self, slot: _Slot, worker: int, message: Any, kinds: bool = False) -> Any:
        """The process's reply to `message` (with `kinds`, as (kind, value)), or its exception."""
        try:
            kind, value = slot.conn.recv()  # the GIL is released while the pipe is read
        except (EOFError, OSError):
            slot.proc.join(1.0)
            code = slot.proc.exitcode
            how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 and
                   -code in signal.Signals._value2member_map_ else f"exited with status {code}")
            what = "starting" if message is None else (
                f"making samples {message[1]}" if message[0] in ("map", "one") else "reading its stream")
            hint = "; a new process takes its place"
            if message is None and self._ctx is not None:
                hint = (": with multiprocessing_context (forkserver or spawn) a worker imports the main module "
                        "again: a script that makes a loader at its top level must do so under `if __name__ == "
                        "\"__main__\":`, and the dataset's class must be importable (its traceback is above); leave "
                        "multiprocessing_context unset, or pass worker_type='thread'")
            raise WorkerDied(f"worker process {worker} (pid {slot.proc.pid}) {how} while {what}{hint}") from None
        if kind == "error":
            raise _worker.unwrap(value) from RemoteTraceback(f"in worker process {worker} (pid {slot.proc.pid}):\n"
                                                             f"{value[2]}")
        return (kind, value) if kinds else value

    def close(self, exiting: bool = False) -> None:
        """Stops the processes. At exit a process still making a batch for an abandoned thread is
        left to end with this process (its watch thread sees it go): killing it would wake that
        thread into an interpreter that is finalizing, which ends threads by unwinding them."""
        with self._lock:
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
        if self.slabs is not None:
            self.slabs.close()
        if exiting:
            busy = [s for s in slots if s.busy]
            for slot in busy:  # multiprocessing's own exit handler would terminate it
                multiprocessing.process._children.discard(slot.proc)  # type: ignore[attr-defined]
            slots = [s for s in slots if not s.busy]
        _stop(slots, wait=0.5)
        prestarter = self._prestarter
        if prestarter is not None and prestarter is not threading.current_thread() and not exiting:
            prestarter.join(5.0)  # its process, if any, was stopped above or by its own closed check
        with self._lock:
            loader_zygote, self._loader_zygote = self._loader_zygote, None
            told_by, self._told_by = self._told_by, None
        if loader_zygote is not None and not exiting:
            loader_zygote.close()  # it ends, killing any worker left (a busy one at exit)
        if not exiting:  # at exit they end with this process (their pipes close)
            for retired in [told_by, *self._retired]:
                if retired is not None:
                    retired.close()

    def pids(self) -> List[int]:
        with self._lock:
            return [slot.proc.pid for slot in self._slots.values()]


def _alive(proc: Any) -> bool:
    """Whether a worker process runs: a forked one's pidfd says so, zombie or not; a process a
    multiprocessing context started may be a zombie its reaper (the forkserver) has not reported."""
    if isinstance(proc, _zygote.ForkedProcess):
        return proc.is_alive()
    return proc.is_alive() and not _exited(proc.pid)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _stop(slots: List[_Slot], wait: float) -> None:
    """Asks idle processes to leave, gives them `wait` seconds together, then kills the rest."""
    for slot in slots:
        try:
            if wait > 0 and not slot.busy:
                slot.conn.send(None)
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + wait
    for slot in slots:
        slot.proc.join(max(0.0, deadline - time.monotonic()))
        if slot.proc.is_alive():
            slot.proc.kill()
            slot.proc.join(5.0)
        slot.conn.close()
        if isinstance(slot.proc, _zygote.ForkedProcess):
            slot.proc.close()


class Collated:
    """A batch collated in a worker process (what fetch gives the loader's collate step): the
    batch, or a ferry._ferry.TensorBatch where its tensors are in a slab (Note [Slabs])."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch


class RemoteStream:
    """The main-side end of a worker process's iter(dataset): samples a chunk at a time."""

    def __init__(self, pool: Pool, worker: int, chunk: int) -> None:
        self._pool, self._worker, self._chunk = pool, worker, chunk
        self._buffer: List[Any] = []
        self._done = False

    def __iter__(self) -> "RemoteStream":
        return self

    def __next__(self) -> Any:
        if not self._buffer:
            if self._done:
                raise StopIteration
            self._buffer = self._pool.call(self._worker, ("next", self._chunk))
            self._buffer.reverse()
            if len(self._buffer) < self._chunk:
                self._done = True
            if not self._buffer:
                raise StopIteration
        return self._buffer.pop()
