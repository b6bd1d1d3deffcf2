"""A worker process's side: the loop that makes batches for one of the loader's worker threads.

Imports nothing of the package's main side (ferry/_procs.py, the loader): a worker process runs
this module, forked from the loader's zygote (Note [Zygote]) or started by a multiprocessing
context. Every way out ends the process with os._exit, so that nothing of the main process's
(atexit handlers, buffered files) runs here, and nothing is printed when the main process is gone
(Note [Quiet ends]).

Note [Quiet ends]
A worker whose loader's process ends, however it ends (a clean exit, os._exit, SIGKILL), leaves
without a word: it waits on a pidfd of the main process and exits at once; a reply that finds the
pipe closed ends the process instead of raising; Ctrl-C is the main process's to handle (SIGINT
is ignored). Only the user's own prints and the tracebacks the loader raises in the main process
are ever seen.
"""

from __future__ import annotations

import ctypes
import multiprocessing.reduction
import os
import pickle
import select
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional, Tuple

from . import _python, _slabs
from ._pickling import ReplyPickler


def _tempdir() -> Optional[str]:
    return multiprocessing.process.current_process()._config.get("tempdir")  # type: ignore[attr-defined]


# The temporary folder this process started with, which is not its own to remove; a folder it
# made later is removed as it exits. `False`: not recorded (not a worker), nothing removed.
_inherited_tempdir: Any = False


def exit_now(code: int = 0) -> None:
    """Ends this process at once, its own output flushed and its own temporary folder removed
    (never the main process's exit handlers)."""
    own = _tempdir()
    if _inherited_tempdir is not False and own is not None and own != _inherited_tempdir:
        shutil.rmtree(own, ignore_errors=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  (a closed or broken stream: nothing more to say)
            pass
    os._exit(code)


def die_with(main_pid: int) -> None:
    """Ends this process when the loader's process ends, however it ends (SIGKILL included), even
    while the dataset is busy: a thread waits on a pidfd of the main process; PR_SET_PDEATHSIG
    also ends it with its parent (the zygote that forked it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    try:
        fd: Optional[int] = os.pidfd_open(main_pid)
    except ProcessLookupError:
        exit_now()
        return
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
    _quiet_after(main_pid, fd)


def _quiet_after(main_pid: int, fd: Optional[int]) -> None:
    """Nothing this process prints of an error met as the loader's process ends: multiprocessing's
    resource sharer (the thread that hands a tensor's shared-memory descriptor to the main
    process, torch's way) reports the main process's half-done handshake through sys.excepthook,
    between the main process's end and this one's. An error is printed as before unless the main
    process ends within half a second of it (its sockets close a moment before its pidfd says so)."""
    original = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        try:
            if fd is not None:
                gone = bool(select.select([fd], [], [], 0.5)[0])
            else:
                time.sleep(0.5)
                os.kill(main_pid, 0)
                gone = False
        except (ProcessLookupError, OSError, ValueError):
            gone = True
        if not gone:
            original(kind, value, tb)

    sys.excepthook = hook


def wrap(exc: BaseException) -> tuple:
    """An exception as it travels to the main process: its name, text, traceback and (if it can be
    rebuilt there) the exception itself."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = bytes(ReplyPickler.dumps(exc))
        pickle.loads(blob)  # an exception that cannot be rebuilt travels as its text alone
    except Exception:  # noqa: BLE001
        blob = None
    return type(exc).__name__, str(exc), text, blob


def unwrap(value: tuple) -> BaseException:
    """The exception wrap() made: rebuilt where it can be, else a RuntimeError of its name and
    text (its traceback's text is value[2])."""
    name, text, _, blob = value
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{name}: {text}")
    return exc


def seed_as_torch(seed: int, worker: int, base_seed: int) -> None:
    """Seeds `random`, torch and numpy as torch's DataLoader seeds its workers: `random` and torch
    with the worker's seed (base seed + id), numpy with torch's own state drawn from (base seed,
    id) where torch has it."""
    numpy_seed: Any = None
    try:
        from torch.utils.data._utils.worker import _generate_state

        numpy_seed = _generate_state(base_seed, worker)
    except (ImportError, AttributeError):
        pass
    _python.reseed(seed, numpy_seed)


def start(worker: int, workers: int, base_seed: int, dataset: Any, init: Any) -> None:
    """What a worker does before its first batch: worker info (ferry's and torch's), seeds, then
    worker_init_fn, in torch's order."""
    seed = base_seed + worker
    info = _python.WorkerInfo(worker, workers, seed, dataset)
    _python._local.info = info
    try:  # torch.utils.data.get_worker_info() answers in ferry's worker processes too
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = torch_worker.WorkerInfo(id=worker, num_workers=workers, seed=seed,
                                                            dataset=dataset)
    except Exception:  # noqa: BLE001  (an older or newer torch without it: ferry's answers)
        pass
    seed_as_torch(seed, worker, base_seed)
    if init is not None:
        init(worker)


def send(conn: Any, reply: Any) -> None:
    """A reply to the loader; a loader that is gone ends this process quietly (Note [Quiet ends])."""
    try:
        conn.send(reply)
    except (OSError, EOFError):  # a broken pipe, a reset connection
        exit_now()


class Asker(_slabs.Asking):
    """Asks the main process for a slab of so many bytes over the process's pipe (Note [Slabs]);
    while a batch is made, only a slab's descriptor and the answer come over it."""

    def __init__(self, conn: Any, slabs: _slabs.ProcessSlabs) -> None:
        self.conn, self.slabs = conn, slabs

    def send(self, needed: int) -> None:
        self.conn.send(("need", needed))

    def answer(self, wait: bool) -> Tuple[bool, Optional[int]]:
        while wait or self.conn.poll():
            message = self.conn.recv()
            if message[0] == "slab":  # a slab this process has not mapped yet; its descriptor follows
                self.slabs.add(message[1], message[2], multiprocessing.reduction.recv_handle(self.conn))
                continue
            return True, message[1]  # ("into", id or None)
        return False, None


def keep_freed_memory() -> bool:
    """Tells glibc's malloc in this worker process to keep what a batch frees for the next one.

    Note [A worker's freed memory kept]
    A worker process holds a batch's samples until they are collated, then frees them all: for
    the ResNet recipe, 256 float images of 600 KB, and the decode's and transforms' intermediates
    on the way. glibc returns the top of its heap to the system once more than its trim threshold
    lies free there (a few MB by default), so each batch faulted the same memory in again (114
    page faults an image, bench/recipe_ceiling.py). With the trim threshold out of reach, and the
    mmap threshold fixed at 32 MB (glibc's largest) so that blocks under it come from the heap,
    the worker reuses its own freed memory: 3.22 against 3.35 ms of CPU an image, 0 page faults,
    on the H200 host (bench/RESULTS.md, "Python datasets: the recipe's ceiling"). A worker so
    holds, between batches, about the memory it holds while making one; blocks of 32 MB and more
    still go back to the system as they are freed. Not where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))


def serve(conn: Any, worker: int, workers: int, payload: Optional[tuple], error: Optional[tuple] = None) -> None:
    """The worker's loop: batches for the loader's worker thread `worker`, until told to stop or
    the pipe closes. `payload` is (dataset, fetch mode, finish, worker_init_fn, sample seeding);
    the first message, ("start", base seed), seeds the process and runs worker_init_fn (a process
    may be started ahead, before its epoch's seed is drawn). `error`: the payload could not be
    loaded (told in reply to "start")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()  # Note [A worker's freed memory kept]
    dataset: Any = None
    default_collate: Any = None
    try:
        if error is None and payload is not None:
            import torch
            import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

            torch.set_num_threads(1)
            import torch.utils.data

            default_collate = torch.utils.data.default_collate
            dataset, fetch_mode, finish, init, seeding = payload
            getitems = getattr(dataset, "__getitems__", None) if fetch_mode == "map" else None
        slabs = _slabs.ProcessSlabs()
    except BaseException as exc:  # told in reply to "start"
        error = wrap(exc)
    iterator: Any = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "slab":  # a slab's descriptor follows (Note [Slabs]); no reply
            try:
                slabs.add(message[1], message[2], multiprocessing.reduction.recv_handle(conn))
            except (EOFError, OSError):
                return
            continue
        try:
            reply: Any
            if message[0] == "start":
                if error is not None:
                    reply = ("error", error)
                else:
                    start(worker, workers, message[1], dataset, init)
                    reply = ("ok", None)
            elif message[0] == "map":  # a batch, collated here and written into its slab
                _, indices, seed, epoch, slab, drops, asks = message
                slabs.drop(drops)
                batch: Any = None
                samples: Any = None
                placer = None
                try:
                    asker = Asker(conn, slabs) if asks else None
                    if finish is default_collate and getitems is None and (slab is not None or asker is not None):
                        # Note [Samples stacked as they come]; with no slab, one is asked for at the first sample
                        placer = slabs.placer(slab, len(indices), asker if slab is None else None)
                    samples = _python.fetch_samples(dataset, getitems, indices, seed, epoch, seeding,
                                                    None if placer is None else placer.take)
                    if placer is not None:
                        samples = placer.settle(samples)
                        slab = placer.slab_id
                        if placer.refused:  # asked already: the batch goes torch's way
                            asker = None
                    if slab is not None and finish is default_collate:  # Note [Collated into the slab]
                        batch = slabs.collate(samples, slab, placer)
                    else:
                        batch = finish(samples)
                    # (the pickle, the tensors' places, whether its samples were stacked as they came)
                    reply = ("ok", slabs.dump(batch, slab, asker) + (placer is not None and placer.streamed,))
                finally:  # the batch may view its slab, which a later message may retire and unmap (slabs.drop)
                    if placer is not None:  # an answer still to come (the batch failed) is taken off the pipe
                        placer.close()
                    batch = samples = placer = asker = None
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
        except Exception as exc:  # noqa: BLE001
            reply = ("error", wrap(exc))
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return
        except Exception as exc:  # noqa: BLE001  (the batch would not pickle)
            send(conn, ("error", wrap(exc)))


def main(conn: Any, worker: int, workers: int, main_pid: int) -> None:
    """A worker started by a multiprocessing context (multiprocessing_context=...): the payload
    comes first over the pipe."""
    global _inherited_tempdir
    _inherited_tempdir = _tempdir()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with(main_pid)
    payload, error = None, None
    try:
        import torch.multiprocessing  # noqa: F401

        payload = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        exit_now()
    except BaseException as exc:  # noqa: BLE001
        error = wrap(exc)
    serve(conn, worker, workers, payload, error)
    exit_now()
