"""Worker processes forked from a zygote: as fast to start as fork, without forking the loader's process.

Note [Zygote]
torch's DataLoader forks its workers from the training process on Linux: they start in
milliseconds and share the dataset copy-on-write, but a fork copies every lock of the threads the
process runs (ferry's, torch's, CUDA's) in whatever state it is in. forkserver and spawn are safe
and slow: each worker imports torch and the user's modules again and unpickles its own copy of the
dataset (9 s to the first batch where torch's fork took 2.4 s, bench/RESULTS.md), and they run
the main script again, so a script without a main guard, or one fed on standard input, fails.

ferry forks a zygote from the main process when ferry is imported, while the process has one
thread, or its other threads are all OpenBLAS's or the CUDA driver's (below; otherwise it starts one as a fresh interpreter,
which imports torch and the rest again; the script's own imports of them took 7.7-9.2 s on an
H200 host, bench/RESULTS.md "A process's first loader"). numpy's OpenBLAS starts a thread a CPU
as numpy is imported, and torch imports numpy, so a script that imports torch before ferry has
them; OpenBLAS shuts them down before a fork (its pthread_atfork handler) and starts them again
when next used, so the fork copies no lock of theirs. A script that put its model on the GPU
before importing ferry runs the CUDA driver's threads (named "cuda-EvtHandlr", "cuda0000...";
after a backward pass, torch's autograd thread for the GPU, "pt_autograd_0"), which sit in their
own waits: the fork copies their locks, which only the driver and autograd take, and
the zygote and every process forked from it must not use CUDA (torch says so: "Cannot
re-initialize CUDA in forked subprocess"), as torch's own fork-started workers must not. ferry's
workers make host memory only, so the zygote is forked there too, as torch forks its workers
(the fresh interpreter took 9.5-11.3 s to a ResNet loader's first batch where torch's fork took
4.6 s; forked, 1.56-1.63 s against 5.06 s: H200 host, bench/RESULTS.md "A process's first loader
with the model on the GPU before ferry's import"); FERRY_ZYGOTE_AFTER_CUDA=0 takes the fresh
interpreter instead. The
user's own threads (a tracker's, faulthandler's watchdog) still do: they may hold any lock.
The zygote imports torch and the installed
packages the main process has imported (torchvision, PIL) at once, in the background of the
script, and those imported since as each loader asks for a loader zygote. A loader asks the
zygote for a loader zygote of its own, sends it the dataset once (Note [Datasets by value]), and the loader
zygote, having imported what the dataset needs, forks the workers: each starts in a few
milliseconds with the dataset already in memory, copy-on-write, and never runs the main script.
Every process here watches the main process (a pidfd) and ends with it, quietly (Note [Quiet
ends] in ferry/_worker.py); a loader zygote ends when its loader closes its pipe, killing any
worker left. The loader zygote reaps its workers only when asked ("status"), so a worker's pid
stays its own until the main process (which holds a pidfd of it) has read how it ended.

Note [Loader zygotes forked from the main process]
A dataset made after ferry's import is not in the zygote: it is pickled and sent, and a million
(path, label) tuples took 0.98 s to reach their first batch that way, where torch's fork took 0.14 s
(8 workers, H200 host; bench/RESULTS.md "A million Python objects: the loader's zygote forked from
the main process"). So a loader made while its process runs one thread (OpenBLAS's and the CUDA driver's aside, as for
the zygote; the loader's own threads start later) forks its loader zygote itself: the dataset is
there as it is, copy-on-write, neither pickled nor sent. The loader starts no worker before its
first iter(). There, where the process still runs one thread (the same threads aside), it forks
another loader zygote, which holds the dataset as it is at that iter(), as torch's fork does:
nothing is compared. Once the first batch is in hand, the first one is asked to take the
dataset's quick fingerprint (Note [Datasets by value]) in its own process, to say whether the
dataset pickles, which a later epoch's workers need where they are not persistent. The first
epoch reads its answer once it has come, at a batch, and at the latest at the epoch's end (or the
next iter()): a dataset that does not pickle is a TypeError naming what fails, as where it is sent
(checked on the dataset as the loader was made), and that zygote ends. Nothing before the first
batch waits for it or shares a core with it: with the answer taken from the loader's making and
awaited at iter(), a million (path, label) tuples reached their first batch in 0.18 s on an H200
host where PyTorch's took 0.15 s, and 0.15 s against 0.13 on two cores. Where the process runs
threads at the first iter(), that zygote stays the loader's, and the dataset's quick fingerprint
in this process is compared with its own, taken at the same time, as at a later epoch's start with
the zygote it was last sent to or forked with. Taken in this process when the loader was made and
again at iter(), the quick fingerprint held the first batch back by 0.2 s (bench/RESULTS.md).
The child holds the main process's memory and files: it freezes the collector (no finalizer of
the main process's objects runs there), closes its copies of ferry's other pipes (registered with
own()) and slab files (a slab is not mapped in a child, MADV_DONTFORK), so that another loader's
processes end when that loader closes them; drops the zygote's handle (a worker's own loaders
start their own); puts the script's signal handlers back to the default (a SIGTERM handler that
saves a checkpoint must not run in it); and the main process flushes its standard streams first,
so no worker writes their buffered text again. It is the main process's child, reaped when its
loader closes it; a main process that ends without its exit handlers has its temporary folder
removed by it, as by the zygote.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import multiprocessing.util
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from typing import Any, NoReturn, Optional, Tuple

_lock = threading.Lock()
_zygote: "Optional[Zygote]" = None
# ferry's own pipes in this process (to its zygotes and workers): a loader zygote forked from this
# process closes its copies (Note [Loader zygotes forked from the main process]).
_owned: "weakref.WeakSet[Any]" = weakref.WeakSet()


def own(obj: Any) -> Any:
    """Notes `obj` (a Connection) as one of ferry's pipes."""
    _owned.add(obj)
    return obj


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# What OpenBLAS builds name their thread count's getter (numpy's wheels carry scipy_openblas64_).
_OPENBLAS_GETTERS = ("openblas_get_num_threads", "openblas_get_num_threads64_", "scipy_openblas_get_num_threads64_",
                     "scipy_openblas_get_num_threads")


def _openblas_threads() -> int:
    """Threads the OpenBLAS libraries loaded in this process run besides the caller's (a library
    set to n threads starts n - 1). Only libraries already loaded are asked; 0 when none is. Each
    OpenBLAS counts once, by its getter's address: Debian's libblas.so.3 and liblapack.so.3 are
    linked to the one libopenblas, and a lookup in any of them finds its getter. A library whose
    threads are down (`blas_server_avail` 0: OpenBLAS stops them before a fork and starts them at
    its next threaded call) runs none, so another thread is never taken for one of them."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return 0
    import ctypes

    total = 0
    asked = set()  # the getters' addresses
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        for name in _OPENBLAS_GETTERS:
            getter = getattr(lib, name, None)
            if getter is not None:
                address = ctypes.cast(getter, ctypes.c_void_p).value
                if address not in asked:
                    asked.add(address)
                    try:
                        running = ctypes.c_int.in_dll(lib, "blas_server_avail").value != 0
                    except ValueError:  # a build that does not export it: its threads taken as up
                        running = True
                    total += max(int(getter()) - 1, 0) if running else 0
                break
    return total


def fork_safe() -> bool:
    """Whether a loader zygote may be forked from this process now (Note [Loader zygotes forked
    from the main process])."""
    return enabled() and _fork_safe()


# How the CUDA driver names its threads ("cuda-EvtHandlr", "cuda00001400006"), and torch its
# autograd engine's device threads ("pt_autograd_0", started by a backward pass on the GPU).
_CUDA_THREADS = ("cuda", "pt_autograd_")


def _cuda_driver_threads() -> int:
    """Threads of this process the CUDA driver, or torch's autograd for a GPU, started (named as
    _CUDA_THREADS; Note [Zygote]); 0 where FERRY_ZYGOTE_AFTER_CUDA=0."""
    if os.environ.get("FERRY_ZYGOTE_AFTER_CUDA", "1") == "0":
        return 0
    me = threading.get_native_id()
    n = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            if int(tid) == me:
                continue
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    n += f.read().startswith(_CUDA_THREADS)
            except OSError:  # a thread that ended meanwhile
                pass
    except OSError:
        return 0
    return n


def _fork_safe() -> bool:
    """Whether the zygote may be forked from this process (Note [Zygote]): it runs one thread, or
    its others are all OpenBLAS's, which OpenBLAS shuts down before a fork, or the CUDA driver's."""
    n = _threads()
    return n == 1 or n == 1 + _openblas_threads() + _cuda_driver_threads()


def _fork() -> int:
    """os.fork() from a process _fork_safe() let fork. Python 3.12 warns of any fork from a process
    of several threads (a DeprecationWarning, an error under -W error, raised in the parent after
    the child exists); OpenBLAS's threads count there, though OpenBLAS parks them for the fork."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
        return os.fork()


# Set for a fresh zygote's own import of ferry, which must not start a zygote of its own.
_IN_ZYGOTE = "FERRY_ZYGOTE_PROCESS"


def enabled() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and os.environ.get("FERRY_ZYGOTE", "1") != "0"


def at_import() -> None:
    """Starts the zygote now (ferry's import, Note [Zygote]): forked if this process runs one
    thread (OpenBLAS's aside), else a fresh interpreter (which imports torch while the script goes
    on)."""
    global _zygote
    if not enabled() or os.environ.get(_IN_ZYGOTE):
        return
    with _lock:
        if _zygote is None:
            try:
                _zygote = Zygote.fork() if _fork_safe() else Zygote.fresh()
            except OSError:
                pass  # get() starts one when a loader needs it


def get() -> "Zygote":
    """The zygote, started as a fresh interpreter if there is none (or it has died)."""
    global _zygote
    with _lock:
        if _zygote is None or not _zygote.alive():
            if _zygote is not None:
                _zygote.close()
            _zygote = Zygote.fresh()
        return _zygote


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _forget_partial_modules() -> None:
    """In a zygote forked at ferry's import: the modules that were being imported then (the one
    that imports ferry, its importers) stopped half run here; they are dropped, so that a dataset
    naming one imports it whole. ferry itself is whole (its import forks last)."""
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if name != "ferry" and name != "__main__" and getattr(spec, "_initializing", False):
            del sys.modules[name]


def _import(names: list) -> None:
    for name in names:
        if name not in sys.modules:
            try:
                __import__(name)
            except BaseException:  # noqa: BLE001  (the loader zygote imports what the dataset needs, and says why not)
                pass


def _main_modules() -> list:
    """The installed top-level packages this process has imported (torchvision, PIL, numpy: what
    a dataset's classes may need), not the script's own modules, whose imports may act."""
    out = []
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None) or ""
        if "." not in name and not name.startswith("_") and ("site-packages" in where or "dist-packages" in where):
            out.append(name)
    return sorted(out)


def _preload() -> None:
    try:
        import torch
        import torch.multiprocessing  # noqa: F401  (the tensor reductions)

        import ferry._worker  # noqa: F401
    except Exception:  # noqa: BLE001  (a loader zygote imports again and reports what fails)
        pass


def _name_process(name: str) -> None:
    """The name `ps -e`, `top` and /proc/PID/comm show for this process (PR_SET_NAME, at most 15
    bytes): ferry's own processes say what they are, not "python"."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _serve(conn: Any, main_pid: int, modules: Optional[list] = None) -> None:
    """The zygote: forks a loader zygote for each loader that asks, until the main process ends.
    `modules`: installed packages to import first (a fresh zygote: what the main process had)."""
    _name_process("ferry-zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        main = os.pidfd_open(main_pid)
    except OSError:
        os._exit(0)
    _preload()
    _import(modules or [])
    tempdir: Optional[str] = None  # the main process's temporary folder, which its workers use
    while True:
        ready, _, _ = select.select([conn.fileno(), main], [], [], 1.0)
        _reap()
        if main in ready:
            _main_gone(main, tempdir)
        if conn.fileno() not in ready:
            continue
        try:
            message = conn.recv()
            fd = multiprocessing.reduction.recv_handle(conn)
        except (EOFError, OSError):
            # A process's pipes close as it ends, before its pidfd says it has: the main process
            # may be gone without its exit handlers here too.
            _main_gone(main, tempdir)
        if message[0] != "loader":
            os._exit(0)
        _import(message[1])  # what the main process has imported, once here for every later loader
        tempdir = message[2]
        pid = os.fork()
        if pid == 0:
            try:
                os.close(main)
                conn.close()
                _serve_loader(multiprocessing.connection.Connection(fd), main_pid, message[2])
            finally:
                os._exit(0)
        os.close(fd)
        try:
            conn.send(("pid", pid))
        except OSError:
            os._exit(0)


def _main_gone(main: int, tempdir: Optional[str]) -> NoReturn:
    """Ends the zygote, whose main process has ended or closed its pipe. A main process gone
    without its exit handlers (os._exit, a signal) leaves its temporary folder, which they would
    have removed: it is removed here once the main process's pidfd says it has ended (a main
    process that closed the pipe and lives on removes its own as it exits)."""
    if tempdir is not None and select.select([main], [], [], 2.0)[0]:
        shutil.rmtree(tempdir, ignore_errors=True)
    os._exit(0)


def _serve_loader(conn: Any, main_pid: int, tempdir: str, payload: Optional[tuple] = None) -> None:
    """A loader's zygote: holds the loader's dataset and forks its workers (Note [Zygote]).
    `tempdir`: the main process's temporary folder, which the workers use as their own. `payload`:
    the dataset already here (forked from the main process), else sent as a pickle."""
    from . import _worker

    _name_process("ferry-loader")
    multiprocessing.process.current_process()._config["tempdir"] = tempdir  # type: ignore[attr-defined]

    try:
        main = os.pidfd_open(main_pid)
    except OSError:
        return
    error: Optional[tuple] = None
    children: set = set()

    def end(closed: bool = True) -> NoReturn:
        """Ends this process and its workers. `closed`: the loader said so; else the main process
        has ended or is ending (its pipe closed unasked), and its temporary folder is removed as
        the zygote's _main_gone() does (a loader zygote forked from the main process has no zygote
        that knows the folder)."""
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
        if closed:
            os._exit(0)
        _main_gone(main, tempdir)

    while True:
        ready, _, _ = select.select([conn.fileno(), main], [], [])
        if main in ready:
            end(closed=False)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            end(closed=False)
        kind = message[0]
        if kind == "payload":
            try:
                import torch.multiprocessing  # noqa: F401

                payload, error = pickle.loads(message[1]), None
            except BaseException as exc:  # noqa: BLE001  (told to the loader at the next fork)
                payload, error = None, _worker.wrap(exc)
            continue
        reply: Any
        if kind == "fork":
            _, worker, workers = message
            try:
                fd = multiprocessing.reduction.recv_handle(conn)
            except (EOFError, OSError):
                end(closed=False)
            if payload is None:
                os.close(fd)
                reply = ("error", error or ("RuntimeError", "no dataset was sent", "", None))
            else:
                pid = os.fork()
                if pid == 0:
                    try:
                        os.close(main)
                        conn.close()
                        _name_process(f"ferry-worker-{worker}")
                        _worker.die_with(main_pid)
                        _worker.serve(multiprocessing.connection.Connection(fd), worker, workers, payload)
                    finally:
                        _worker.exit_now()
                os.close(fd)
                children.add(pid)
                reply = ("pid", pid)
        elif kind == "baseline":  # what the main process compares the dataset with (_pickling.baseline)
            from . import _pickling

            reply = ("baseline",) + (_pickling.baseline(payload, message[1]) if payload is not None else (None, None, None))
        elif kind == "status":  # how a worker ended (it has, or is about to: its pipe closed)
            _, pid, wait = message
            code = None
            deadline = time.monotonic() + wait
            while True:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 0
                if done:
                    children.discard(pid)
                    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                    break
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
            reply = ("status", code)
        else:  # "close"
            end()
        try:
            conn.send(reply)
        except OSError:  # a reply not waited for (a baseline asked for) finds the loader closed
            end(closed=_said_close(conn))


def _said_close(conn: Any) -> bool:
    """Whether the pipe, closed by the loader, holds its "close" (sent before it closed the pipe)."""
    try:
        while conn.poll():
            if conn.recv()[0] == "close":
                return True
    except (EOFError, OSError):
        pass
    return False


def _rebuild_error(value: tuple) -> BaseException:
    from . import _worker

    exc = _worker.unwrap(value)
    if value[2]:
        exc.__cause__ = RuntimeError(f"while the loader's zygote loaded the dataset:\n{value[2]}")
    return exc


class Zygote:
    """The main side of the zygote."""

    def __init__(self, conn: Any, pid: int, popen: Optional[subprocess.Popen] = None) -> None:
        self.conn, self.pid, self._popen = own(conn), pid, popen
        self._lock = threading.Lock()
        self._pidfd: Optional[int] = os.pidfd_open(pid)

    @classmethod
    def fork(cls) -> "Zygote":
        parent, child = multiprocessing.Pipe(duplex=True)
        main_pid = os.getpid()
        pid = _fork()
        if pid == 0:
            try:
                parent.close()
                _forget_partial_modules()
                _serve(child, main_pid)
            finally:
                os._exit(0)
        child.close()
        return cls(parent, pid)

    @classmethod
    def fresh(cls) -> "Zygote":
        parent, child = multiprocessing.Pipe(duplex=True)
        fd = child.fileno()
        code = (f"import sys; sys.path[:0] = {sys.path!r}; from ferry import _zygote; "
                f"_zygote._serve_fresh({fd}, {os.getpid()})")
        popen = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd], stdin=subprocess.DEVNULL,
                                 env=dict(os.environ, **{_IN_ZYGOTE: "1"}))
        child.close()
        # multiprocessing's key (torch's tensors travel through its resource sharer, which checks
        # it), over the pipe: a command line can be read by anyone on the machine.
        parent.send_bytes(bytes(multiprocessing.current_process().authkey))
        parent.send(_main_modules())  # imported at once, while the script goes on
        return cls(parent, popen.pid, popen)

    def alive(self) -> bool:
        fd = self._pidfd
        return fd is not None and not select.select([fd], [], [], 0)[0]

    def new_loader(self) -> "LoaderZygote":
        parent, child = multiprocessing.Pipe(duplex=True)
        try:
            with self._lock:
                # The workers' temporary files (the listener torch's tensors are shared through)
                # go in this process's folder, which it removes as it exits: a worker ends with
                # os._exit or SIGKILL and would leave a folder of its own behind.
                self.conn.send(("loader", _main_modules(), multiprocessing.util.get_temp_dir()))
                multiprocessing.reduction.send_handle(self.conn, child.fileno(), self.pid)
                _, pid = self.conn.recv()
        finally:
            child.close()
        return LoaderZygote(parent, pid)

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._popen is not None:
            try:
                self._popen.wait(5.0)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
        else:
            try:
                os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _serve_fresh(fd: int, main_pid: int) -> None:
    """The zygote as a fresh interpreter (the main process had threads when it needed one)."""
    os.environ.pop(_IN_ZYGOTE, None)  # ferry is imported: the workers' own loaders may start zygotes
    try:
        os.setpgid(0, 0)  # Ctrl-C at the terminal is the main process's to handle
    except OSError:
        pass
    try:
        conn = multiprocessing.connection.Connection(fd)
        multiprocessing.current_process().authkey = conn.recv_bytes()
        _serve(conn, main_pid, conn.recv())
    finally:
        os._exit(0)


def _forked_from_main() -> None:
    """In a loader zygote just forked from the main process: what it has of the main process's
    that is not the loader's own is let go (Note [Loader zygotes forked from the main process])."""
    global _zygote
    gc.freeze()  # the main process's objects are never collected here (no finalizer of theirs runs)
    # What multiprocessing runs in a child it forks: its resource sharer (which torch's tensors
    # travel through) forgets the main process's listener and starts its own when asked.
    getattr(multiprocessing.util, "_run_after_forkers", lambda: None)()
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):  # a handler of the script's (a SIGTERM checkpoint)
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    for obj in list(_owned):
        try:
            obj.close()  # this process's copy of the pipe
        except OSError:
            pass
    from . import _ferry

    # The shared blocks' mappings were not copied (MADV_DONTFORK); their files are closed here.
    _ferry.forget_shared_blocks()
    _zygote = None  # a worker's own loaders start a zygote of their own
    _owned.clear()


class LoaderZygote:
    """The main side of one loader's zygote."""

    def __init__(self, conn: Any, pid: int, child: bool = False) -> None:
        self.conn, self.pid = own(conn), pid
        self._child = child  # forked from this process, which reaps it
        self._lock = threading.Lock()
        self._asked = False  # its baseline asked for by ask(), not yet read
        self._baseline: Optional[tuple] = None

    @classmethod
    def forked(cls, payload: tuple) -> "LoaderZygote":
        """A loader zygote forked from this process, holding `payload` as it is now (Note [Loader
        zygotes forked from the main process]). Only where fork_safe()."""
        parent, child = multiprocessing.Pipe(duplex=True)
        main_pid = os.getpid()
        tempdir = multiprocessing.util.get_temp_dir()
        for stream in (sys.stdout, sys.stderr):  # what they hold is written once, not again by a worker
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        pid = _fork()
        if pid == 0:
            try:
                parent.close()
                _forked_from_main()
                _serve_loader(child, main_pid, tempdir, payload)
            finally:
                os._exit(0)
        child.close()
        return cls(parent, pid, child=True)

    def _read_answer(self) -> None:
        """Reads the baseline ask() asked for (under the lock, before any other reply)."""
        if self._asked:
            self._asked = False
            self._baseline = tuple(self.conn.recv()[1:])

    def ask(self, limit: int) -> None:
        """Asks for baseline(limit) without waiting for it: it is taken while this process goes on."""
        try:
            with self._lock:
                if not self._asked and self._baseline is None:
                    self.conn.send(("baseline", limit))
                    self._asked = True
        except OSError:
            pass  # it has ended: baseline() says it cannot tell

    def answered(self) -> bool:
        """Whether baseline() will not wait for what ask() asked for."""
        try:
            return not self._asked or self.conn.poll()
        except OSError:
            return True  # its pipe is closed: baseline() says it cannot tell

    def baseline(self, limit: int) -> Tuple[Optional[bytes], Optional[bytes], Optional[str]]:
        """Its payload's quick fingerprint, or the digest of its full one, or why it does not
        pickle (_pickling.baseline); (None, None, None) where it cannot say (it has ended)."""
        self.ask(limit)
        try:
            with self._lock:
                self._read_answer()
        except (EOFError, OSError):
            return None, None, None
        return self._baseline or (None, None, None)  # type: ignore[return-value]

    def send_payload(self, blob: bytes) -> None:
        with self._lock:
            self._read_answer()
            self._baseline = None  # the main process knows the new one's
            self.conn.send(("payload", blob))

    def fork(self, worker: int, workers: int) -> Tuple[Any, "ForkedProcess"]:
        """A new worker process: its pipe (main side) and its handle."""
        parent, child = multiprocessing.Pipe(duplex=True)
        try:
            with self._lock:
                self._read_answer()
                self.conn.send(("fork", worker, workers))
                multiprocessing.reduction.send_handle(self.conn, child.fileno(), self.pid)
                kind, value = self.conn.recv()
        except (EOFError, OSError):
            parent.close()
            raise RuntimeError("DataLoader: the loader's zygote process ended") from None
        finally:
            child.close()
        if kind == "error":
            parent.close()
            raise _rebuild_error(value)
        return parent, ForkedProcess(self, value)

    def status(self, pid: int, wait: float) -> Optional[int]:
        try:
            with self._lock:
                self._read_answer()
                self.conn.send(("status", pid, wait))
                _, code = self.conn.recv()
        except (EOFError, OSError):
            return None
        return code

    def close(self, reap: bool = True) -> None:
        """Ends it. `reap`: waits for it to end (a forked one); else a later close() does."""
        if self._lock.acquire(blocking=False):  # else a call is in flight: the pipe's end says it
            try:
                self.conn.send(("close",))
            except OSError:
                pass
            finally:
                self._lock.release()
        try:
            self.conn.close()
        except OSError:
            pass
        if self._child and reap:  # it ends as its pipe closes (its workers killed first): reaped here
            self._child = False
            try:
                fd = os.pidfd_open(self.pid)
                try:
                    if not select.select([fd], [], [], 5.0)[0]:  # stuck: it goes now, so the wait below ends
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
                os.waitpid(self.pid, 0)
            except (OSError, ChildProcessError):
                pass


class ForkedProcess:
    """A worker forked by a loader zygote, with multiprocessing.Process's methods the pool uses."""

    def __init__(self, owner: LoaderZygote, pid: int) -> None:
        self._owner, self.pid = owner, pid
        self._code: Optional[int] = None
        try:
            self._fd: Optional[int] = os.pidfd_open(pid)
        except OSError:  # it has ended and been reaped already
            self._fd = None

    def is_alive(self) -> bool:
        fd = self._fd
        return fd is not None and not select.select([fd], [], [], 0)[0]

    def join(self, timeout: Optional[float] = None) -> None:
        fd = self._fd
        if fd is not None:
            select.select([fd], [], [], timeout)

    @property
    def exitcode(self) -> Optional[int]:
        if self._code is None and not self.is_alive():
            self._code = self._owner.status(self.pid, 1.0)
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        return self._code

    def kill(self) -> None:
        fd = self._fd
        if fd is not None:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except (OSError, AttributeError):
                pass

    def close(self) -> None:
        if self._fd is not None and not self.is_alive():
            self.exitcode  # noqa: B018  (reaps it)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

