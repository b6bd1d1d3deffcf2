"""Worker processes for Python datasets: each of the loader's worker threads drives one process.

The engine's worker thread w sends a batch's indices to process w and waits for the collated
batch without the GIL (the pipe read releases it); the process fetches the samples, collates them
and sends the batch back through torch's multiprocessing pickler, whose tensors travel in shared
memory (file descriptors passed over the pipe's socket), not through the pipe; a pinned batch's
tensors are written into a CUDA-registered slab instead (Note [Slabs] in _slabs.py). So the dataset's
Python code runs in parallel whatever it holds, and the engine keeps its ordering, timeouts,
on_error, resume and Ctrl-C.

Processes are started with forkserver (spawn where there is none), never a bare fork of this
process, which holds ferry's and torch's threads. They ignore SIGINT (Ctrl-C is the main
process's to handle), die with their parent (PR_SET_PDEATHSIG, and EOF on the pipe), and are
stopped when the loader is freed or closed, or at exit. A process stuck past `timeout` is killed
when the engine replaces its thread; one that dies is reported with its signal and started again.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.reduction
import multiprocessing.util
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

from . import _python, _slabs


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


def context(name: Optional[str]) -> Any:
    """The multiprocessing context (forkserver by default, preloading torch and ferry once)."""
    if name is None:
        name = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if not isinstance(name, str):
        return name  # a context object, as torch takes
    if name == "fork":
        raise ValueError("DataLoader: multiprocessing_context='fork' is not taken: this process runs ferry's and "
                         "torch's threads, and a fork copies their locks in whatever state they are; use "
                         "'forkserver' (the default) or 'spawn'")
    with _context_lock:
        if name not in _contexts:
            ctx = multiprocessing.get_context(name)
            if name == "forkserver":
                ctx.set_forkserver_preload(["torch", "ferry"])
            _contexts[name] = ctx
        return _contexts[name]


def _die_with(main_pid: int) -> None:
    """Ends this process when the loader's process ends, however it ends (SIGKILL included), even
    while the dataset is busy. The worker's parent is the forkserver, which outlives the main
    process while any worker holds its fd, so PR_SET_PDEATHSIG alone would not do: a thread
    waits on a pidfd of the main process."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the forkserver's death, too
    except (OSError, AttributeError):
        pass
    try:
        fd = os.pidfd_open(main_pid)
    except ProcessLookupError:
        os._exit(0)
    except (OSError, AttributeError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                time.sleep(0.5)
                try:
                    os.kill(main_pid, 0)
                except ProcessLookupError:
                    break
        os._exit(0)

    threading.Thread(target=watch, name="ferry: watch the loader's process", daemon=True).start()


def _wrap(exc: BaseException) -> tuple:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = bytes(multiprocessing.reduction.ForkingPickler.dumps(exc))
        pickle.loads(blob)  # an exception that cannot be rebuilt travels as its text alone
    except Exception:
        blob = None
    return type(exc).__name__, str(exc), text, blob


def _main(conn: Any, worker: int, workers: int, seed: int, main_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(main_pid)
    import torch
    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

    torch.set_num_threads(1)
    try:
        dataset, fetch_mode, finish, init, seeding = pickle.loads(conn.recv_bytes())  # Pool.start sends it
        slabs = _slabs.ProcessSlabs()
        info = _python.WorkerInfo(worker, workers, seed + worker, dataset)
        _python._local.info = info
        try:  # torch.utils.data.get_worker_info() answers in ferry's worker processes too
            from torch.utils.data._utils import worker as torch_worker

            torch_worker._worker_info = torch_worker.WorkerInfo(id=worker, num_workers=workers, seed=seed + worker,
                                                                dataset=dataset)
        except Exception:
            pass
        _python.reseed(seed + worker)  # as torch seeds its workers
        if init is not None:
            init(worker)
        getitems = getattr(dataset, "__getitems__", None) if fetch_mode == "map" else None
        iterator: Any = None
        conn.send(("ready", None))
    except BaseException as exc:  # everything goes back to the loader
        conn.send(("error", _wrap(exc)))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "slab":  # a slab's descriptor follows (Note [Slabs]); no reply
            slabs.add(message[1], message[2], multiprocessing.reduction.recv_handle(conn))
            continue
        try:
            reply: Any
            if message[0] == "map":  # a batch, collated here and written into its slab
                _, indices, seed, epoch, slab, drops = message
                slabs.drop(drops)
                batch = finish(_python.fetch_samples(dataset, getitems, indices, seed, epoch, seeding))
                reply = ("ok", slabs.dump(batch, slab))
            elif message[0] == "one":  # one sample, as it is (the loader collates what on_error kept)
                _, index, seed, epoch = message
                reply = ("ok", _python.fetch_samples(dataset, None, [index], seed, epoch, seeding)[0])
            elif message[0] == "open":
                iterator = iter(dataset)
                reply = ("ok", None)
            else:  # "next": up to n samples of the stream, collated by the loader's thread
                samples = []
                for _ in range(message[1]):
                    try:
                        samples.append(next(iterator))
                    except StopIteration:
                        break
                reply = ("ok", samples)
        except Exception as exc:
            reply = ("error", _wrap(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # the batch would not pickle
            conn.send(("error", _wrap(exc)))


class _Discard:
    def write(self, data: Any) -> int:
        return len(data)


class _CheckPickler(pickle.Pickler):
    """Pickles to nowhere, to find what cannot be pickled, without the bytes of arrays: tensors and
    numpy arrays always pickle (multiprocessing moves tensors by shared memory), and serializing a
    dataset's gigabytes here would cost the loader's construction a second a gigabyte."""

    def __init__(self, file: Any, protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        # Found once, not for each object pickled: the array types of the modules already imported.
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        self._tensors = tuple(k for k in (getattr(torch, n, None) for n in ("Tensor", "UntypedStorage", "TypedStorage")) if k)
        self._ndarray = getattr(np, "ndarray", None)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, self._tensors) or (type(obj) is self._ndarray and obj.dtype != object):
            return id(obj)
        return None


class _Slot:
    def __init__(self, proc: Any, conn: Any) -> None:
        self.proc, self.conn, self.busy = proc, conn, False
        self.starting = True  # its "ready" (or worker_init_fn's error) is read before the first batch
        self.mapped: set = set()  # ids of the slabs this process has mapped


class Pool:
    """The processes of one loader, one a worker thread (slot), started when the thread starts and
    kept while they are healthy (for the loader's life: worker_init_fn runs once a process)."""

    def __init__(self, ctx: Any, payload: tuple, slabs: Optional[_slabs.Slabs] = None) -> None:
        self._ctx = ctx
        self.slabs = slabs
        self._payload = payload  # pickled anew for each process by multiprocessing (tensors by shared memory)
        try:
            _CheckPickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
        except Exception as exc:
            raise TypeError(
                f"DataLoader: worker processes need the dataset, collate_fn and worker_init_fn to pickle, and "
                f"{type(exc).__name__}: {exc}. Define them at a module's top level (no lambdas or local classes), "
                "or pass worker_type='thread'") from exc
        self._lock = threading.Lock()
        self._start_locks: Dict[int, threading.Lock] = {}
        self._prestarter: Optional[threading.Thread] = None
        self._slots: Dict[int, _Slot] = {}
        self._closed = False
        if ctx.get_start_method() == "forkserver":
            # Now, on the loader's construction: the server imports torch once (a second or two),
            # and a worker thread starting its process then waits only for a fork, so that even a
            # loop interrupted as it starts ends at once.
            from multiprocessing import forkserver

            forkserver.ensure_running()

    def prestart(self, workers: int, seed: int) -> None:
        """Starts the processes now, on a thread of their own: they import and unpickle the dataset
        while the script goes on (builds its model), and the engine's worker threads find them
        started (start() keeps a live, idle process). A process that fails to start is left to the
        worker thread's own start(), which says why."""

        def run() -> None:
            for worker in range(workers):
                try:
                    self.start(worker, workers, seed, only_if_none=True)
                except Exception:
                    return

        self._prestarter = threading.Thread(target=run, name="ferry: start worker processes", daemon=True)
        self._prestarter.start()

    def start(self, worker: int, workers: int, seed: int, only_if_none: bool = False) -> None:
        """On the engine's worker thread `worker`: its process, kept if it is alive and idle, else
        new (a stuck or dead one is killed first). `only_if_none` (the prestart thread): only
        where worker `worker` has no process yet, whatever its state."""
        with self._lock:
            lock = self._start_locks.setdefault(worker, threading.Lock())
        with lock:  # the prestart thread and the worker's own thread start one process, not two
            self._start(worker, workers, seed, only_if_none)

    def _start(self, worker: int, workers: int, seed: int, only_if_none: bool) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("DataLoader: the loader's worker processes were stopped")
            old = self._slots.get(worker)
            if old is not None and only_if_none:
                return
            if old is not None and not old.busy and old.proc.is_alive() and not _exited(old.proc.pid):
                return
            self._slots.pop(worker, None)
        if old is not None:
            _stop([old], wait=0)
        parent, child = self._ctx.Pipe(duplex=True)
        # The payload goes over the pipe, not as the process's arguments: multiprocessing writes
        # those into a pipe the new process reads only once it runs, so a payload over the pipe's
        # 64 KiB kept start() waiting for the process's whole start (its imports: 7 s a process on
        # one host), and one thread after another. Now the processes start together.
        # (The constructor checked that the payload pickles, so it needs no process to inherit.)
        with _start_lock:  # torch shares a tensor's storage once; two threads pickling it at once broke it
            blob = multiprocessing.reduction.ForkingPickler.dumps(self._payload, pickle.HIGHEST_PROTOCOL)
        proc = self._ctx.Process(target=_main, args=(child, worker, workers, seed, os.getpid()), daemon=True,
                                 name=f"ferry worker {worker}")
        proc.start()
        child.close()
        try:
            parent.send_bytes(blob)  # read first by the process; the GIL is released while this waits
        except OSError:
            pass  # the process is gone: the first call finds it so and says how it ended
        slot = _Slot(proc, parent)
        with self._lock:
            closed = self._closed
            if not closed:
                self._slots[worker] = slot
        if closed:  # the loader was closed while this process started
            _stop([slot], wait=0)

    def call(self, worker: int, message: Any) -> Any:
        with self._lock:
            slot = self._slots.get(worker)
            closed = self._closed or multiprocessing.util._exiting  # type: ignore[attr-defined]  # set as Python exits
        if closed:
            raise RuntimeError("DataLoader: the loader's worker processes were stopped")
        # An idle process sends nothing: a readable pipe means it has ended (killed from outside);
        # so does a zombie (its reaper, the forkserver, may not have reported it yet).
        if (slot is None or not slot.proc.is_alive() or (not slot.starting and slot.conn.poll())
                or _exited(slot.proc.pid)):
            info = _python._local.info
            self.start(worker, info.num_workers, info.seed - worker)
            with self._lock:
                slot = self._slots[worker]
        slot.busy = True
        if slot.starting:
            self._reply(slot, worker, None)  # "ready", or worker_init_fn's exception
            slot.starting = False
        if message[0] != "map":
            slot.conn.send(message)
            value = self._reply(slot, worker, message)
            slot.busy = False
            return value
        slabs = self.slabs
        lease = slabs.lease() if slabs is not None else None
        try:
            drops = []
            if slabs is not None:
                drops = [i for i in slot.mapped if i in slabs.retired]
                slot.mapped.difference_update(drops)
            if lease is not None and lease.id not in slot.mapped:
                slot.conn.send(("slab", lease.id, lease.size))
                multiprocessing.reduction.send_handle(slot.conn, lease.fd, slot.proc.pid)
                slot.mapped.add(lease.id)
            slot.conn.send(message + (None if lease is None else lease.id, drops))
            blob, needed, placed, missed = self._reply(slot, worker, message)
        except BaseException:
            if lease is not None and slabs is not None:
                slabs.give_back(lease)
            raise
        slot.busy = False
        if slabs is None:
            return pickle.loads(blob)
        return slabs.view_batch(blob, lease, needed, placed, missed)

    def _reply(self, slot: _Slot, worker: int, message: Any) -> Any:
        try:
            kind, value = slot.conn.recv()  # the GIL is released while the pipe is read
        except (EOFError, OSError):
            slot.proc.join(1.0)
            code = slot.proc.exitcode
            how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 and
                   -code in signal.Signals._value2member_map_ else f"exited with status {code}")
            what = "starting" if message is None else (
                f"making samples {message[1]}" if message[0] in ("map", "one") else "reading its stream")
            hint = ("; a new process takes its place" if message is not None else
                    ": worker processes start with forkserver (or spawn), which imports the main module again: a "
                    "script that makes a loader at its top level must do so under `if __name__ == \"__main__\":`, "
                    "and the dataset's class must be importable (its traceback is above); or pass "
                    "worker_type='thread'")
            raise WorkerDied(f"worker process {worker} (pid {slot.proc.pid}) {how} while {what}{hint}") from None
        if kind == "error":
            name, text, tb, blob = value
            exc = None
            if blob is not None:
                try:
                    exc = pickle.loads(blob)
                except Exception:
                    exc = None
            if not isinstance(exc, BaseException):
                exc = RuntimeError(f"{name}: {text}")
            raise exc from RemoteTraceback(f"in worker process {worker} (pid {slot.proc.pid}):\n{tb}")
        return value

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

    def pids(self) -> List[int]:
        with self._lock:
            return [slot.proc.pid for slot in self._slots.values()]


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
        except Exception:
            pass
    deadline = time.monotonic() + wait
    for slot in slots:
        slot.proc.join(max(0.0, deadline - time.monotonic()))
        if slot.proc.is_alive():
            slot.proc.kill()
            slot.proc.join(5.0)
        slot.conn.close()


class Collated:
    """A batch collated in a worker process (what fetch gives the loader's collate step)."""

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
