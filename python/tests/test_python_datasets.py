"""ferry.DataLoader over Python datasets (map-style and iterable, as torch.utils.data takes them),
on worker threads and worker processes: the same batches as torch's DataLoader, PyTorch's
arguments, errors with their cause, timeouts, crashes, on_error, resume at any worker count,
Ctrl-C, and nothing left behind."""

import collections
import gc
import io
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref
import warnings

import pytest
import torch
import torch.utils.data as tud

import ferry
from ferry import _slabs
from conftest import alive, interrupt_after


class Squares:
    """A map-style dataset of dicts (a tensor, an int, a string), as user datasets are."""

    def __init__(self, n=50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"x": torch.full((2, 3), float(i * i)), "label": i % 7, "name": f"s{i}"}


def assert_same(ours, theirs):
    ours, theirs = list(ours), list(theirs)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(a, dict):
            assert a.keys() == b.keys()
            assert_same([a[k] for k in a], [b[k] for k in a])
        elif isinstance(a, (list, tuple)):
            assert_same(a, b)
        else:
            assert a == b


# (num_workers, worker_type): no workers, worker threads, worker processes.
KINDS = [(0, "thread"), (2, "thread"), (2, "process")]


def kind_id(kind):
    return "no-workers" if kind[0] == 0 else f"{kind[0]}-{kind[1]}s"


def loader(ds, kind, **kw):
    return ferry.DataLoader(ds, num_workers=kind[0], worker_type=kind[1], **kw)


def wait_gone(pids, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def thread_count():
    return len(os.listdir("/proc/self/task"))


def fd_count():
    return len(os.listdir("/proc/self/fd"))


# --- datasets (at module level: worker processes import them) ----------------------------------

class Batched(Squares):
    calls = []

    def __getitems__(self, indices):
        self.calls.append(list(indices))
        return [self[i] for i in indices]


Pair = collections.namedtuple("Pair", "xs names")


def pair_collate(samples):
    return Pair(torch.stack([s["x"] for s in samples]), [s["name"] for s in samples])


class Shards(tud.IterableDataset):
    """An iterable dataset that reads its worker's share, as torch's documentation shows."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = ferry.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class Who(Squares):
    def __getitem__(self, i):
        info, theirs = ferry.get_worker_info(), tud.get_worker_info()
        return torch.tensor([info.id, info.num_workers, info.seed, -1 if theirs is None else theirs.id, os.getpid()])


class Faulty(Squares):
    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"no sample {i}")
        return i


class Crashing(Squares):
    def __getitem__(self, i):
        if i == 5:
            import ctypes

            ctypes.string_at(0)  # a segfault in "a C extension"
        return i


class Sleepy(Squares):
    def __getitem__(self, i):
        if i == 5:
            time.sleep(60)  # stuck (the process is killed; a thread is abandoned)
        return i


class Augmented(Squares):
    """Random "augmentation" from the global generators, as torchvision's transforms draw."""

    def __getitem__(self, i):
        import random

        return torch.tensor([float(i), random.random(), torch.rand(()).item()])


class OwnSeed(Squares):
    """A dataset that seeds a generator of its own from ferry.sample_seed()."""

    def __getitem__(self, i):
        seed = ferry.sample_seed()
        g = torch.Generator().manual_seed(seed)
        return torch.tensor([i, seed % 2**62, int(torch.randint(0, 2**62, (), generator=g))])


class Mixed(Squares):
    """Tensors of every kind a slab must carry, and some it must leave to torch."""

    def __getitem__(self, i):
        t = torch.arange(12, dtype=torch.float64).view(3, 4) * i
        shared = torch.full((2,), i, dtype=torch.int16)
        return {"strided": t.t(), "bool": torch.tensor([i % 2 == 0, True]), "complex": torch.tensor([1 + 1j * i]),
                "scalar": torch.tensor(i), "empty": torch.empty(0, 5), "twice": [shared, shared],
                "name": f"m{i}"}


def with_a_parameter(samples):
    """default_collate, and a leaf tensor that requires grad (left to torch's own pickling)."""
    return {**tud.default_collate(samples), "grad": torch.ones(2, requires_grad=True)}


class Growing(Squares):
    """Samples that grow past the slabs sized from the first batches."""

    def __getitem__(self, i):
        return torch.full((1 << 18 if i >= 24 else 16,), float(i))  # 4 MiB batches past 1 MiB slabs


# --- the same batches as torch ------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_map_style_batches_equal_torchs(kind):
    ds = Squares(50)
    for drop_last in (False, True):
        ours = loader(ds, kind, batch_size=8, drop_last=drop_last)
        theirs = tud.DataLoader(ds, batch_size=8, drop_last=drop_last)
        assert len(ours) == len(theirs) == (6 if drop_last else 7)
        assert_same(ours, theirs)


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_a_users_sampler_batch_sampler_and_generator_give_torchs_order(kind):
    ds = Squares(40)
    sampler = tud.SubsetRandomSampler(range(0, 40, 3), generator=torch.Generator().manual_seed(5))
    ours = list(loader(ds, kind, batch_size=4, sampler=sampler))
    sampler.generator.manual_seed(5)
    assert_same(ours, tud.DataLoader(ds, batch_size=4, sampler=sampler))
    sampler.generator.manual_seed(5)
    ours = list(loader(ds, kind, batch_size=4, sampler=sampler, drop_last=True))  # 14 indices: 3 batches
    sampler.generator.manual_seed(5)
    assert len(ours) == 3
    assert_same(ours, tud.DataLoader(ds, batch_size=4, sampler=sampler, drop_last=True))

    batches = [[3, 1], [0], [39, 38, 37]]
    assert_same(loader(ds, kind, batch_sampler=batches), tud.DataLoader(ds, batch_sampler=batches))

    ours = list(loader(ds, kind, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(9)))
    assert_same(ours, tud.DataLoader(ds, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(9)))


def test_ferrys_own_shuffle_visits_every_sample_once_for_any_worker_count():
    ds = Squares(37)
    orders = []
    for kind in [(0, "thread"), (1, "thread"), (4, "thread"), (2, "process")]:
        orders.append([int(n[1:]) for b in loader(ds, kind, batch_size=5, shuffle=True, seed=3) for n in b["name"]])
    assert orders[0] == orders[1] == orders[2] == orders[3]
    assert sorted(orders[0]) == list(range(37)) and orders[0] != list(range(37))


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_lists_tensor_datasets_and_unbatched_samples(kind):
    assert_same(loader([1, 2, 3, 4, 5], kind, batch_size=2), tud.DataLoader([1, 2, 3, 4, 5], batch_size=2))
    td = tud.TensorDataset(torch.arange(20).view(10, 2), torch.arange(10))
    assert_same(loader(td, kind, batch_size=3), tud.DataLoader(td, batch_size=3))
    assert_same(loader(td, kind, batch_size=None), tud.DataLoader(td, batch_size=None))


def test_getitems_is_called_once_a_batch():
    Batched.calls.clear()
    assert_same(loader(Batched(10), (2, "thread"), batch_size=4), tud.DataLoader(Squares(10), batch_size=4))
    assert sorted(Batched.calls) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert_same(loader(Batched(10), (2, "process"), batch_size=4), tud.DataLoader(Squares(10), batch_size=4))


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_a_collate_fn_returning_a_custom_type(kind):
    batches = list(loader(Squares(10), kind, batch_size=4, collate_fn=pair_collate))
    assert [type(b) for b in batches] == [Pair] * 3
    assert batches[2].names == ["s8", "s9"] and batches[2].xs.shape == (2, 2, 3)


@pytest.mark.parametrize("kind", KINDS + [(1, "thread"), (3, "process")], ids=kind_id)
def test_an_iterable_dataset_sharded_by_get_worker_info(kind):
    got = [int(v) for b in loader(Shards(23), kind, batch_size=4) for v in b]
    assert sorted(got) == list(range(23))  # each sample once, whatever the worker count
    if kind[0] == 0:
        assert got == list(range(23))
    with pytest.raises(ValueError, match="iterable dataset decides its own order: shuffle"):
        ferry.DataLoader(Shards(3), shuffle=True)


def test_worker_init_fn_and_get_worker_info_on_worker_threads():
    seen = []
    lock = threading.Lock()

    def init(worker_id):
        info = ferry.get_worker_info()
        with lock:
            seen.append((worker_id, info.id, info.num_workers, info.seed, type(info.dataset).__name__))

    rows = [r.tolist() for b in loader(Who(12), (3, "thread"), batch_size=2, worker_init_fn=init, seed=100) for r in b]
    assert sorted(seen) == [(0, 0, 3, 100, "Who"), (1, 1, 3, 101, "Who"), (2, 2, 3, 102, "Who")]
    assert {(r[0], r[1], r[2], r[4]) for r in rows} <= {(w, 3, 100 + w, os.getpid()) for w in range(3)}
    assert ferry.get_worker_info() is None  # not on the main thread
    calls = []
    list(ferry.DataLoader(Squares(4), batch_size=2, worker_init_fn=calls.append))
    assert calls == []  # as torch: no workers, no worker_init_fn


def test_get_worker_info_in_worker_processes_ferrys_and_torchs():
    ds = Who(12)
    rows = [r.tolist() for b in loader(ds, (3, "process"), batch_size=2, seed=100) for r in b]
    pids = {r[4] for r in rows}
    assert os.getpid() not in pids and 1 <= len(pids) <= 3
    for worker, workers, seed, torch_id, _ in rows:
        assert workers == 3 and seed == 100 + worker and torch_id == worker


class Threads(Squares):
    def __getitem__(self, i):
        return torch.get_num_threads()


@pytest.mark.parametrize("kind", [(2, "thread"), (2, "process")], ids=kind_id)
def test_workers_run_torch_on_one_intra_op_thread_and_leave_the_main_threads_alone(kind):
    # As torch's workers and pin thread: a worker's collate and pin_memory copy do not start a
    # team of OpenMP threads as wide as the machine each (all cores spinning beside a training step).
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))  # new threads start from it (a 2-core machine has 1)
    try:
        counts = [int(v) for b in loader(Threads(8), kind, batch_size=2) for v in b]
        assert counts == [1] * 8
        assert torch.get_num_threads() == max(2, before)
    finally:
        torch.set_num_threads(before)


def test_the_attributes_pytorch_code_reads():
    ds = Squares(10)
    ours = ferry.DataLoader(ds, batch_size=3, num_workers=2, drop_last=True, timeout=5, prefetch_factor=4,
                            persistent_workers=True)
    for name, value in dict(batch_size=3, num_workers=2, drop_last=True, timeout=5, prefetch_factor=4,
                            persistent_workers=True, pin_memory=False, generator=None,
                            worker_type="process").items():
        assert getattr(ours, name) == value, name
    assert ours.dataset is ds and len(ours) == 3
    assert isinstance(ferry.DataLoader(ds, batch_size=2, sampler=range(10)).batch_sampler, tud.BatchSampler)
    # Unset, they are torch's own default objects, as PyTorch code finds them.
    for kwargs in (dict(batch_size=3), dict(batch_size=3, shuffle=True, num_workers=2), dict(batch_size=None),
                   dict(batch_size=2, sampler=tud.SequentialSampler(ds))):
        ours, theirs = ferry.DataLoader(ds, **kwargs), tud.DataLoader(ds, **kwargs)
        assert ours.collate_fn is theirs.collate_fn, kwargs
        assert type(ours.sampler) is type(theirs.sampler), kwargs
        assert type(ours.batch_sampler) is type(theirs.batch_sampler), kwargs
        if theirs.batch_sampler is not None:
            assert list(ours.batch_sampler) == list(theirs.batch_sampler) or kwargs.get("shuffle")
        if kwargs.get("num_workers"):
            assert ours.prefetch_factor == theirs.prefetch_factor == 2
    assert ferry.DataLoader(ds).prefetch_factor is None  # as torch 2: no workers, no prefetch
    with pytest.warns(UserWarning, match="multiprocessing_context has no effect"):
        ferry.DataLoader(ds, multiprocessing_context="spawn", worker_type="thread", num_workers=1)
    with pytest.raises(ValueError, match="'fork' is not taken"):
        ferry.DataLoader(ds, multiprocessing_context="fork", num_workers=1)
    with pytest.raises(ValueError, match="worker_type must be 'process' or 'thread'"):
        ferry.DataLoader(ds, worker_type="fiber", num_workers=1)
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        ferry.DataLoader(ds, sampler=range(10), shuffle=True)
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        ferry.DataLoader(ds, batch_sampler=[[0]], batch_size=2)
    with pytest.raises(TypeError, match="map-style dataset .*__getitem__ and __len__.* got object"):
        ferry.DataLoader(object())


def _attributes(loader):
    """What PyTorch code reads of a loader's sampling: values, and the samplers' types."""
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    return {"batch_size": loader.batch_size, "drop_last": loader.drop_last, "sampler": type(sampler),
            "batch_sampler": type(batch_sampler),
            "batch_sampler.batch_size": getattr(batch_sampler, "batch_size", None),
            "batch_sampler.drop_last": getattr(batch_sampler, "drop_last", None),
            "batch_sampler.sampler": type(getattr(batch_sampler, "sampler", None))}


def test_the_attributes_are_torch_s_for_every_combination_of_batch_size_sampler_batch_sampler_shuffle():
    ds = Squares(10)
    given_batches = tud.BatchSampler(tud.SequentialSampler(ds), 3, False)
    given_sampler = tud.RandomSampler(ds)
    combos = [dict()]
    for batch_size in (None, 1, 4):
        for drop_last in (False, True) if batch_size is not None else (False,):  # torch refuses None with drop_last
            combos += [dict(batch_size=batch_size, drop_last=drop_last), dict(batch_size=batch_size, drop_last=drop_last, shuffle=True),
                       dict(batch_size=batch_size, drop_last=drop_last, sampler=given_sampler)]
    combos += [dict(batch_sampler=given_batches), dict(batch_sampler=given_batches, batch_size=1)]
    for kwargs in combos:
        ours, theirs = ferry.DataLoader(ds, **kwargs), tud.DataLoader(ds, **kwargs)
        assert _attributes(ours) == _attributes(theirs), kwargs
        if "batch_sampler" in kwargs:
            assert ours.batch_sampler is theirs.batch_sampler is given_batches
        if "sampler" in kwargs:
            assert ours.sampler is theirs.sampler is given_sampler
    for kwargs in (dict(), dict(batch_size=None), dict(batch_size=4, drop_last=True)):  # an iterable dataset
        ours, theirs = ferry.DataLoader(Shards(8), **kwargs), tud.DataLoader(Shards(8), **kwargs)
        assert _attributes(ours) == _attributes(theirs), kwargs


class Holding(Squares):
    """A dataset holding something no process can receive."""

    def __init__(self, n, held):
        super().__init__(n)
        self.files = {"index": [1, 2], "guard": held}


@pytest.mark.parametrize("forks", ["at-iter", "when-made", "never"])
def test_what_cannot_cross_a_process_is_named_and_lambdas_travel(forks, monkeypatch):
    # A lambda (and a class or function of a script's __main__) travels by value. What does not
    # pickle is named by the loader's first epoch's end at the latest: its zygote forked at iter()
    # (the one forked when it was made says, as it can), forked when it was made (this process had
    # threads at iter(): named there), or the dataset sent (named when the loader is made).
    import ferry._zygote

    calls = []
    monkeypatch.setattr(ferry._zygote, "fork_safe",
                        lambda: calls.append(1) or {"at-iter": True, "never": False}.get(forks, len(calls) % 2 == 1))
    assert [b for b in ferry.DataLoader(Squares(4), batch_size=2, num_workers=2, collate_fn=lambda b: len(b))] == [2, 2]
    with open(__file__, "rb") as held, socket.socket() as sock:
        with pytest.raises(TypeError, match=r"dataset.files\['guard'\] \(TypeError: cannot pickle '_io.BufferedReader' "
                                            r"object\).*Make it in the worker.*worker_type='thread'"):
            list(ferry.DataLoader(Holding(4, held), num_workers=2))
        with pytest.raises(TypeError, match=r"worker_init_fn \(closure variable 'sock'\)"):
            list(ferry.DataLoader(Squares(4), num_workers=2, worker_init_fn=lambda w: sock.fileno()))
        assert len(list(ferry.DataLoader(Holding(4, held), num_workers=2, worker_type="thread"))) == 4


class Guarded(Squares):
    """A dataset holding locks, a logger with a handler on the standard error and the standard
    output itself, as datasets do (module level: worker processes import it)."""

    def __init__(self, n, held):
        super().__init__(n)
        self.lock, self.rlock = threading.Lock(), threading.RLock()
        self.log = logging.getLogger("ferry-test-guarded")
        self.handler, self.out = logging.StreamHandler(sys.stderr), sys.stdout
        if held:
            self.lock.acquire()  # held here as the loader is made: a fork would copy it held

    def __getitem__(self, i):
        with self.rlock:
            got = self.lock.acquire(timeout=10)
        self.lock.release()
        return torch.tensor([int(got), int(self.out is sys.stdout), super().__getitem__(i)["label"]])


@pytest.mark.parametrize("forks", ["at-iter", "never"])
def test_a_dataset_holding_locks_loggers_and_the_standard_streams_works_in_worker_processes(forks, monkeypatch):
    # Note [What a fork would have shared]: sent by value, each lock arrives a new one, unlocked,
    # and the standard streams as the worker's own; forked, as the fork gives them.
    import ferry._zygote

    monkeypatch.setattr(ferry._zygote, "fork_safe", lambda: forks == "at-iter")
    sent = forks == "never"
    ds = Guarded(6, held=sent)
    for _ in range(2):  # a second epoch: nothing counted as a change, nothing refused
        rows = [r for b in ferry.DataLoader(ds, batch_size=3, num_workers=2) for r in b.tolist()]
        assert rows == [[1, 1, i % 7] for i in range(6)]
    assert ds.lock.locked() == sent  # the main process's own, untouched


@pytest.mark.parametrize("forked", [True, False], ids=["loader-zygote-forked", "dataset-sent"])
def test_the_dataset_travels_once_a_loader_with_its_tensors_shared(forked, monkeypatch):
    # The loader's zygote is forked from this process with the dataset in it; or the dataset is
    # pickled once and sent to the loader's zygote, its tensors by shared memory (the workers map
    # the same storage). Either way an in-place change reaches the next epoch's workers.
    import ferry._zygote

    monkeypatch.setattr(ferry._zygote, "fork_safe", lambda: forked)
    big = tud.TensorDataset(torch.zeros(256, 1 << 12, dtype=torch.uint8), torch.arange(256))
    ours = ferry.DataLoader(big, num_workers=2, batch_size=64)
    assert ours._pool.forked == forked
    assert [b[1].tolist() for b in ours][0] == list(range(64))
    assert big.tensors[0].is_shared() != forked
    big.tensors[0][0, 0] = 7  # in place: the next epoch's workers see it
    assert int(next(iter(ours))[0][0, 0]) == 7


# --- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_an_exception_in_the_dataset_arrives_at_its_batch_with_its_cause_and_traceback(kind):
    it = iter(loader(Faulty(20), kind, batch_size=4))
    assert [next(it).tolist() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ferry.WorkerError) as caught:
        next(it)
    err = caught.value
    assert isinstance(err.__cause__, KeyError) and err.__cause__.args == ("no sample 13",)
    assert err.batch == 3
    assert "KeyError: 'no sample 13'" in str(err) and "test_python_datasets.py" in str(err)  # the traceback's text
    assert err.__cause__.__traceback__ is not None
    if kind[1] == "process":
        assert "in worker process" in str(err.__cause__.__cause__)
    assert next(it).tolist() == [16, 17, 18, 19]  # the loop may go on


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_on_error_skip_and_replace_cost_only_the_bad_sample(kind):
    rows = [int(v) for b in loader(Faulty(20), kind, batch_size=4, on_error="skip") for v in b]
    assert rows == [i for i in range(20) if i != 13]
    batches = list(loader(Faulty(20), kind, batch_size=4, on_error="replace"))
    assert [len(b) for b in batches] == [4] * 5 and 13 not in [int(v) for b in batches for v in b]


@pytest.mark.parametrize("kind", [(2, "thread"), (2, "process")], ids=kind_id)
def test_a_sample_stuck_past_timeout_is_a_timeout_error_and_the_loop_goes_on(kind):
    # (A process's start counts in its first batch's time: 2 s leave room for a busy machine.)
    ours = loader(Sleepy(12), kind, batch_size=2, timeout=0.5 if kind[1] == "thread" else 2.0)
    it = iter(ours)
    assert next(it).tolist() == [0, 1] and next(it).tolist() == [2, 3]
    start = time.monotonic()
    with pytest.raises(ferry.TimeoutError, match="timed out"):
        next(it)
    assert time.monotonic() - start < 10
    assert next(it).tolist() == [6, 7]
    assert ours.stats()["abandoned_workers"] == 1
    if kind[1] == "process":
        pids = ours._pool.pids()
        del it, ours
        gc.collect()
        assert wait_gone(pids) == []


def test_a_worker_process_that_crashes_or_is_killed_is_an_error_and_is_replaced():
    ours = loader(Crashing(12), (2, "process"), batch_size=2)
    it = iter(ours)
    assert next(it).tolist() == [0, 1] and next(it).tolist() == [2, 3]
    with pytest.raises(ferry.WorkerError, match="killed by SIGSEGV while making samples \\[4, 5\\]"):
        next(it)
    assert [next(it).tolist() for _ in range(3)] == [[6, 7], [8, 9], [10, 11]]  # a new process took its place

    # (Not persistent: persistent workers would already be making the next epoch's batches, and a
    # process killed while it makes one fails that batch, as above.)
    healthy = loader(Squares(8), (2, "process"), batch_size=2)
    assert [b["label"].tolist() for b in healthy] == [[0, 1], [2, 3], [4, 5], [6, 0]]
    pids = healthy._pool.pids()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # from outside, while idle: the next epoch starts new processes
    assert wait_gone(pids) == []
    assert [b["label"].tolist() for b in healthy] == [[0, 1], [2, 3], [4, 5], [6, 0]]
    assert set(healthy._pool.pids()).isdisjoint(pids)


# --- resume ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("before,after", [((0, "thread"), (3, "thread")), ((2, "thread"), (0, "thread")),
                                          ((2, "process"), (1, "thread"))], ids=["0-3", "2-0", "procs-threads"])
def test_state_dict_resumes_mid_epoch_at_another_worker_count(before, after):
    ds = Squares(30)
    whole = [b["label"].tolist() + [b["name"]] for b in ferry.DataLoader(ds, batch_size=4, shuffle=True, seed=11)]
    first = loader(ds, before, batch_size=4, shuffle=True, seed=11)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    del it, first
    resumed = loader(ds, after, batch_size=4, shuffle=True, seed=11)
    resumed.load_state_dict(state)
    assert [b["label"].tolist() + [b["name"]] for b in resumed] == whole[3:]


# --- Ctrl-C, exits and cleanup -------------------------------------------------------------------------

SCRIPT_HEAD = """
import os, sys, threading, time, ferry

def loop_in_a_daemon_thread(loader):
    # Keeps every batch: a torch tensor freed on a daemon thread while the interpreter finalizes
    # aborts the process inside torch itself (its dealloc releases the GIL; pytorch/pytorch#38228),
    # whatever made the tensor. What is tested is the loader's own calls.
    kept = []
    threading.Thread(target=lambda: [kept.append(batch) for batch in loader], daemon=True).start()

class Slow:
    def __len__(self): return 100
    def __getitem__(self, i):
        if os.environ.get("FERRY_TEST_STARTED"):
            open(os.environ["FERRY_TEST_STARTED"], "a").close()  # a sample is being fetched
        time.sleep(30)
        return i
"""


def script(tmp_path, body):
    """The command that runs SCRIPT_HEAD + body as a file (worker processes import it again)."""
    path = tmp_path / "script.py"
    path.write_text(SCRIPT_HEAD + textwrap.dedent(body))
    return [sys.executable, str(path)]


def run_script(tmp_path, body):
    return subprocess.Popen(script(tmp_path, body), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_ctrl_c_during_a_30_second_python_sample_ends_the_loop_before_the_sample_ends(tmp_path, kind):
    argv = script(tmp_path, f"""
        if __name__ == "__main__":
            loader = ferry.DataLoader(Slow(), batch_size=2, num_workers={kind[0]}, worker_type="{kind[1]}")
            print("ready", flush=True)
            try:
                for batch in loader:
                    pass
            except KeyboardInterrupt:
                print("interrupted %.3f" % time.monotonic(), flush=True)
                sys.exit(0)
            print("finished", flush=True)
    """)
    # SIGINT once a sample is being fetched (a thread still starting its process is waited for,
    # which on a host whose torch imports slowly is longer than the bound).
    waited, exited, out, err = interrupt_after(argv, wait=0.2, started=tmp_path / "started")
    # Bounds well under the sample's 30 s (its latency is bench/ctrl_c_latency.py's).
    assert waited < 10.0, out
    assert exited < 15.0
    assert "leaked" not in err, err


@pytest.mark.parametrize("kind", [(2, "thread"), (2, "process")], ids=kind_id)
def test_a_module_level_loader_exits_cleanly(tmp_path, kind):
    # The loader (through its dataset's class and the module's globals) is in a cycle the collector
    # cannot see into; it is released at exit, with no leak report and no hang.
    proc = run_script(tmp_path, f"""
        class Data:
            def __len__(self): return 10
            def __getitem__(self, i): return i
        if __name__ == "__main__":
            loader = ferry.DataLoader(Data(), batch_size=3, num_workers={kind[0]}, worker_type="{kind[1]}",
                                      persistent_workers=True)
            print(sum(len(b) for b in loader), flush=True)
            it = iter(loader); next(it)   # exit mid-epoch
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "10", (out, err)
    assert err == "", err


def test_a_worker_back_in_python_while_the_program_exits_ends_without_a_fatal_error(tmp_path):
    # A worker abandoned inside the dataset whose sample comes back into Python once the interpreter
    # is finalizing: Python ends its thread, which ferry parks (Note [Threads Python ends at exit]
    # in module.cpp) instead of unwinding it into "Fatal Python error: PyGILState_Release".
    proc = run_script(tmp_path, """
        class Stuck:
            def __len__(self): return 12
            def __getitem__(self, i):
                if i == 5:
                    while not sys.is_finalizing():  # each sleep gives up the GIL, each wake asks for it
                        time.sleep(0.001)
                return i
        if __name__ == "__main__":
            loader = ferry.DataLoader(Stuck(), batch_size=2, num_workers=2, worker_type="thread", timeout=0.3)
            it = iter(loader)
            print(next(it).tolist(), next(it).tolist(), flush=True)
            try:
                next(it)
            except ferry.TimeoutError:
                print("timed out", flush=True)
            print(next(it).tolist(), flush=True)
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert out.splitlines() == ["[0, 1] [2, 3]", "timed out", "[6, 7]"], (out, err)
    assert "Fatal" not in err and "leaked" not in err, err


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_a_daemon_thread_iterating_a_loader_when_the_program_exits_ends_cleanly(tmp_path, kind):
    # The main thread returns while a daemon thread is inside the loop (its worker processes, if
    # any, started): the program exits with status 0, without a fatal error or a leak report, and
    # leaves no worker process behind.
    proc = run_script(tmp_path, f"""
        class Quick:
            def __len__(self): return 100000
            def __getitem__(self, i):
                time.sleep(0.002)
                return i

        if __name__ == "__main__":
            loader = ferry.DataLoader(Quick(), batch_size=4, num_workers={kind[0]}, worker_type="{kind[1]}")
            loop_in_a_daemon_thread(loader)
            pool = getattr(loader, "_pool", None)
            deadline = time.monotonic() + 60  # a forkserver process may take seconds to start
            while pool is not None and len(pool.pids()) < {kind[0]} and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            print(" ".join(str(p) for p in (pool.pids() if pool is not None else [])), flush=True)
    """)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, (out, err)
    assert "Fatal" not in err and "leaked" not in err and "Traceback" not in err, err
    pids = [int(p) for p in out.split()]
    assert len(pids) == (kind[0] if kind[1] == "process" else 0)
    assert wait_gone(pids) == []


def test_a_daemon_thread_inside_a_long_sample_when_the_program_exits_ends_cleanly(tmp_path):
    # Without workers the dataset runs on the daemon thread: release() at exit waits a second for it
    # to leave the loader, then leaves the loader to it (it parks as Python ends it).
    proc = run_script(tmp_path, """
        class Long:
            def __len__(self): return 100
            def __getitem__(self, i):
                if i == 2:
                    print("inside", flush=True)
                    time.sleep(5)
                return i

        if __name__ == "__main__":
            loader = ferry.DataLoader(Long(), batch_size=2, num_workers=0)
            loop_in_a_daemon_thread(loader)
            time.sleep(0.5)
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert out.splitlines() == ["inside"], (out, err)
    assert "terminate" not in err and "Fatal" not in err and "leaked" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("workers", [0, 2])
def test_a_daemon_thread_in_a_native_loader_when_the_program_exits_ends_cleanly(tmp_path, workers):
    # The daemon thread waits in the loader's call without the GIL; Python ends it as it takes the
    # GIL back, and ferry parks it (Note [Threads Python ends at exit] in module.cpp) where the
    # unwind used to abort the process ("terminate called without an active exception").
    proc = run_script(tmp_path, f"""
        import ferry.datasets

        if __name__ == "__main__":
            data = ferry.datasets.synthetic(n=10 ** 7, shape=(3, 4, 4))  # small: the thread keeps every batch
            loader = ferry.DataLoader(data, batch_size=64, num_workers={workers})
            loop_in_a_daemon_thread(loader)
            time.sleep(0.5)
            print("exiting", flush=True)
    """)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, (out, err)
    assert out.splitlines() == ["exiting"], (out, err)
    assert "terminate" not in err and "Fatal" not in err and "leaked" not in err, err


def test_worker_processes_die_with_a_sigkilled_main_process(tmp_path):
    proc = run_script(tmp_path, """
        if __name__ == "__main__":
            loader = ferry.DataLoader(Slow(), batch_size=2, num_workers=2)
            it = iter(loader)
            deadline = time.monotonic() + 60  # a forkserver process may take seconds to start
            while len(loader._pool.pids()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            print(" ".join(str(p) for p in loader._pool.pids()), flush=True)
            next(it)
    """)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.kill()
        proc.wait()
        assert wait_gone(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", [(3, "thread"), (3, "thread-through"), (2, "process"), (2, "process-slabs")],
                         ids=kind_id)
def test_create_iterate_break_destroy_leaves_no_thread_process_or_descriptor(kind, monkeypatch):
    if kind[1] in ("process-slabs", "thread-through"):  # the pinned paths, without CUDA
        import ferry._slabs

        monkeypatch.setattr(ferry._slabs, "FOR_PAGEABLE", True)
        kind = (kind[0], kind[1].split("-")[0])
    pids = []

    def cycle():
        ours = loader(Squares(40), kind, batch_size=4, prefetch_factor=2)
        for i, _ in enumerate(ours):
            if i == 2:
                break
        if ours._pool is not None:
            pids.extend(ours._pool.pids())
        del ours

    cycle()
    gc.collect()
    threads, fds, shm = thread_count(), fd_count(), sorted(os.listdir("/dev/shm"))
    for _ in range(100):
        cycle()
    gc.collect()
    assert thread_count() <= threads  # a thread of an earlier test may end meanwhile; none is added
    assert fd_count() == fds
    assert wait_gone(pids) == []
    assert sorted(os.listdir("/dev/shm")) == shm  # slabs are memfd segments; torch's own are unlinked


def test_pin_memory_without_cuda_warns_and_delivers_pageable_batches():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: test_gpu.py checks pinned batches")
    with pytest.warns(UserWarning, match="pin_memory=True but torch sees no CUDA device"):
        ours = ferry.DataLoader(Squares(4), batch_size=2, pin_memory=True)
    assert [b["x"].is_pinned() for b in ours] == [False, False]


# --- per-sample seeds ---------------------------------------------------------------------------

def rows_of(batches):
    return [tuple(r.tolist()) for b in batches for r in b]


@pytest.mark.parametrize("kind", KINDS + [(3, "process")], ids=kind_id)
def test_sample_seed_is_keyed_by_seed_epoch_and_index_for_any_workers(kind):
    ds = OwnSeed(10)
    reference = rows_of(loader(ds, (0, "thread"), batch_size=3, shuffle=True, seed=5))
    theirs = loader(ds, kind, batch_size=3, shuffle=True, seed=5)
    assert rows_of(theirs) == reference
    second = rows_of(theirs)  # the next epoch: other seeds for the same indices
    assert sorted(r[0] for r in second) == list(range(10))
    assert {r[0]: r[1] for r in second} != {r[0]: r[1] for r in reference}
    assert ferry.sample_seed() is None  # outside a fetch
    other = rows_of(loader(ds, kind, batch_size=3, shuffle=True, seed=6))
    assert {r[0]: r[1] for r in other} != {r[0]: r[1] for r in reference}


def test_sample_seed_names_any_index_of_the_batch_in_getitems():
    class Both(Squares):
        def __getitems__(self, indices):
            assert ferry.sample_seed() is None  # no single sample here
            return [torch.tensor([i, ferry.sample_seed(i) % 2**62]) for i in indices]

    per_item = rows_of(loader(OwnSeed(6), (0, "thread"), batch_size=3))
    assert [r[:2] for r in rows_of(loader(Both(6), (0, "thread"), batch_size=3))] == [r[:2] for r in per_item]


@pytest.mark.parametrize("kind", [(2, "process"), (3, "process"), (1, "thread")], ids=kind_id)
def test_sample_seeding_makes_random_transforms_the_same_for_any_worker_count(kind):
    reference = rows_of(loader(Augmented(12), (0, "thread"), batch_size=4, shuffle=True, sample_seeding=True))
    assert rows_of(loader(Augmented(12), kind, batch_size=4, shuffle=True, sample_seeding=True)) == reference
    # Resumed mid-epoch onto another worker count: the rest of the epoch, the same draws.
    first = loader(Augmented(12), kind, batch_size=4, shuffle=True, sample_seeding=True)
    it = iter(first)
    head = rows_of([next(it)])
    state = first.state_dict()
    first.close()  # its workers stop prefetching (a worker thread would draw from the same generators)
    del it
    resumed = loader(Augmented(12), (0, "thread"), batch_size=4, shuffle=True, sample_seeding=True)
    resumed.load_state_dict(state)
    assert head + rows_of(resumed) == reference


def test_sample_seeding_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="worker threads share"):
        ferry.DataLoader(Augmented(4), num_workers=2, worker_type="thread", sample_seeding=True)
    with pytest.raises(ValueError, match="map-style"):
        ferry.DataLoader(Shards(4), sample_seeding=True)
    with pytest.raises(TypeError, match="for Python datasets"):
        ferry.DataLoader(ferry.datasets.synthetic(n=4, shape=[2]), sample_seeding=True)


def test_worker_type_defaults_to_threads_only_without_a_gil(monkeypatch):
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    assert ferry.DataLoader(Squares(4), num_workers=1).worker_type == ("process" if gil else "thread")
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    assert ferry.DataLoader(Squares(4), num_workers=1).worker_type == "thread"
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)
    assert ferry.DataLoader(Squares(4), num_workers=1).worker_type == "process"


# --- shared-memory slabs (Note [Slabs] in ferry/_slabs.py) ---------------------------------------
# Slabs serve pinned batches; these tests run them for pageable ones (no CUDA here), and
# test_gpu.py runs them registered.

@pytest.fixture
def slabs_on(monkeypatch):
    import ferry._slabs

    monkeypatch.setattr(ferry._slabs, "FOR_PAGEABLE", True)


def test_worker_processes_send_batches_through_slabs_equal_to_torchs(slabs_on):
    ours = loader(Squares(64), (2, "process"), batch_size=4)
    for a, b in zip(ours, tud.DataLoader(Squares(64), batch_size=4), strict=True):  # each batch freed before the next
        assert_same([a], [b])
    stats = ours.stats()
    # Each process's first batch asks for a slab once it knows its bytes: every batch travels in
    # one, and no more slabs are made than batches were held at once (each freed before the next).
    assert stats["slab_misses"] == 0 and stats["slab_batches"] == 16
    assert stats["slab_streamed"] == 16  # each stacked as its samples came (Note [Samples stacked as they come])
    assert stats["slab_bytes"] > 0 and 1 <= stats["slabs_made"] <= 2 + 2 * 2


LeftRight = collections.namedtuple("LeftRight", "left right")


class Carried(Squares):
    """Tensors of every kind a slab carries, in containers torch's collate keeps."""

    def __getitem__(self, i):
        t = torch.arange(12, dtype=torch.float64).view(3, 4) * i
        shared = torch.full((2,), i, dtype=torch.int16)
        return {"strided": t.t(), "bool": torch.tensor([i % 2 == 0, True]), "scalar": torch.tensor(i),
                "empty": torch.empty(0, 5), "twice": [shared, shared], "name": f"m{i}",
                "half": torch.full((3,), i / 3, dtype=torch.bfloat16), "pair": LeftRight(torch.tensor(i), i)}


def test_slabs_carry_every_kind_of_tensor_ferry_has_and_the_batch_is_rebuilt_as_torchs(slabs_on):
    ours = loader(Carried(12), (2, "process"), batch_size=3)
    got = list(ours)
    theirs = list(tud.DataLoader(Carried(12), batch_size=3))
    for a, b in zip(got, theirs, strict=True):
        assert type(a["pair"]) is type(b["pair"]) and a["bool"].dtype == torch.bool
        assert_same([a], [b])
    assert len(got) == 4 and ours.stats()["slab_batches"] == 4 and ours.stats()["slab_misses"] == 0


@pytest.mark.parametrize("kind", [(2, "process"), (2, "thread")], ids=kind_id)
def test_a_batch_with_a_tensor_the_pipeline_does_not_take_travels_torchs_way_whole(kind, slabs_on, monkeypatch):
    # A complex tensor (a dtype ferry has not) and one that requires grad: a process's batch goes
    # as torch pickles it, none of its tensors in a slab; a thread's is left to torch's pin_memory
    # (Note [Thread batches through the pipeline]).
    made = counting_host_batches(monkeypatch)
    ours = loader(Mixed(12), kind, batch_size=3, collate_fn=with_a_parameter)
    got = list(ours)
    theirs = list(tud.DataLoader(Mixed(12), batch_size=3, collate_fn=with_a_parameter))
    for a, b in zip(got, theirs, strict=True):
        grad_a, grad_b = a.pop("grad"), b.pop("grad")
        assert grad_a.requires_grad and torch.equal(grad_a, grad_b)
        assert_same([a], [b])
    if kind[1] == "process":
        assert ours.stats()["slab_batches"] == 0 and ours.stats()["slab_misses"] == 4
    else:
        assert made == [False] * 4


# --- worker threads' batches through the pipeline (Note [Thread batches through the pipeline]) ---

SENTINEL = object()


def with_an_object(samples):
    """default_collate, and an object torch's pin_memory keeps as it is (not copied)."""
    return {**tud.default_collate(samples), "meta": SENTINEL}


def counting_host_batches(monkeypatch):
    import ferry._bridge

    made = []
    real = ferry._bridge.host_batch

    def counted(batch):
        out = real(batch)
        made.append(out is not None)
        return out

    monkeypatch.setattr(ferry._bridge, "host_batch", counted)
    return made


@pytest.mark.parametrize("kind", [(0, "thread"), (2, "thread")], ids=kind_id)
def test_worker_threads_send_batches_through_the_pipeline_rebuilt_as_torchs(kind, slabs_on, monkeypatch):
    made = counting_host_batches(monkeypatch)
    ours = loader(Carried(12), kind, batch_size=3)
    got = list(ours)
    theirs = list(tud.DataLoader(Carried(12), batch_size=3))
    for a, b in zip(got, theirs, strict=True):
        assert type(a["pair"]) is type(b["pair"]) and a["bool"].dtype == torch.bool
        assert a["twice"][0] is not a["twice"][1]  # each occurrence its own tensor, as torch's pin_memory makes
        assert_same([a], [b])
    assert len(got) == 4 and made == [True] * 4
    # The batch's other objects are kept as they are (torch's pin_memory does not copy them).
    kept = list(loader(Squares(6), kind, batch_size=3, collate_fn=with_an_object))
    assert [b["meta"] is SENTINEL for b in kept] == [True, True]


def test_a_thread_batch_is_rebuilt_with_the_dtype_it_had():
    from ferry import _python

    # The Place keeps the dtype: a tensor delivered as uint8 comes back as the bool it was.
    structure = {"flags": _python.Place(0, torch.bool), "n": [_python.Place(1, torch.int16), 3]}
    back = _python.rebuild_host(structure, [torch.tensor([1, 0], dtype=torch.uint8), torch.ones(2, dtype=torch.int16)],
                                False)
    assert back["flags"].dtype == torch.bool and back["flags"].tolist() == [True, False]
    assert back["n"][0].dtype == torch.int16 and back["n"][1] == 3
    with pytest.raises(ValueError, match="tensor 1 has dtype 'complex64', which ferry does not carry"):
        _python._ferry.TensorBatch.of_host({}, [], [(8, "uint8", (4,)), (8, "complex64", (2,))])
    with pytest.raises(ValueError, match="tensor 0: a negative dimension"):
        _python._ferry.TensorBatch.of_host({}, [], [(8, "uint8", (-1,))])


def test_a_tensor_batch_outside_its_block_or_of_an_unknown_dtype_is_refused_by_name():
    from ferry import _ferry

    blocks = _ferry.SharedBlocks(False, 1 << 20)
    block = blocks.lease(4096, True, 4)
    assert block is not None and block.size == 4096 and blocks.holds(block.address)
    _ferry.TensorBatch(b"", block, [(0, "float32", (1024,))])  # exactly the block
    with pytest.raises(ValueError, match="tensor 1 .*dtype 'complex64'"):
        _ferry.TensorBatch(b"", block, [(0, "uint8", (4,)), (256, "complex64", (2,))])
    with pytest.raises(ValueError, match=r"tensor 0 \(4100 bytes at 0\) lies outside its block of 4096 bytes"):
        _ferry.TensorBatch(b"", block, [(0, "uint8", (4100,))])
    with pytest.raises(ValueError, match="outside its block"):
        _ferry.TensorBatch(b"", block, [(4096, "uint8", (1,))])
    assert blocks.lease(4096, True, 1) is None  # one block held, at most one: none made, none free


def process_slab(size):
    """A block leased from a pool of this process, mapped as a worker process maps its slab."""
    from ferry import _ferry, _slabs

    blocks = _ferry.SharedBlocks(False, 1 << 24)
    block = blocks.lease(size, True, 4)
    side = _slabs.ProcessSlabs()
    side.add(block.id, block.size, os.dup(block.fd))
    return blocks, block, side


def counting_slab_copies(monkeypatch):
    """The shapes of the tensors dump() copies into a slab (those not already placed there)."""
    copies = []
    real = _slabs._SlabPickler.persistent_id

    def counted(self, obj):
        if type(obj) is torch.Tensor and id(obj) not in self._placed:
            copies.append(tuple(obj.shape))
        return real(self, obj)

    monkeypatch.setattr(_slabs._SlabPickler, "persistent_id", counted)
    return copies


def test_default_collate_stacks_into_the_slab_and_dump_writes_those_tensors_no_more(monkeypatch):
    # Note [Collated into the slab]: each tensor torch's default_collate stacks is made in the
    # slab, where dump() finds it (no copy); the other tensors (the labels' tensor) are laid after.
    from ferry import _slabs

    samples = [(torch.arange(12, dtype=torch.float32).view(3, 4) + i, i, {"m": torch.full((2,), i, dtype=torch.int16)})
               for i in range(5)]
    blocks, block, side = process_slab(1 << 16)
    batch = side.collate(samples, block.id)
    base = side._maps[block.id][1]
    assert batch[0].data_ptr() == base.data_ptr()  # stacked where the slab begins
    assert batch[2]["m"].data_ptr() == base.data_ptr() + 256
    copies = counting_slab_copies(monkeypatch)
    blob, regions = side.dump(batch, block.id)
    assert copies == [(5,)]  # the labels alone were copied in
    assert [r[0] for r in regions] == [0, 512, 256] and regions[1][1:] == ("int64", (5,))
    tensors = []
    for offset, dtype, shape in regions:
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        tensors.append(base[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(shape))
    rebuilt = _slabs._Rebuilder(io.BytesIO(blob), tensors).load()
    assert_same([rebuilt], [tud.default_collate(samples)])


def taken_as_they_come(side, slab_id, samples):
    """Samples through a placer as a worker process takes them, then collated with it."""
    placer = side.placer(slab_id, len(samples))
    return side.collate([placer.take(sample) for sample in samples], slab_id, placer)


def test_samples_stacked_into_the_slab_as_they_come_are_torchs_batch(monkeypatch):
    # Note [Samples stacked as they come]: each sample's tensors are copied into their rows as the
    # sample is taken; collate returns the stacked tensors where they lie, and dump() adds only the
    # labels. The dataset's own tensors are neither changed nor kept.

    cached = torch.arange(6, dtype=torch.int16)
    samples = [{"image": torch.arange(12, dtype=torch.float32).view(3, 4).t() + i, "label": i,
                "pair": LeftRight(cached, [torch.tensor(i), "x"])} for i in range(5)]
    blocks, block, side = process_slab(1 << 16)
    base = side._maps[block.id][1]
    placer = side.placer(block.id, 5)
    taken = [placer.take(sample) for sample in samples]
    for i, t in enumerate(taken):  # each tensor is its row of the slab now, its containers rebuilt
        assert t["image"].data_ptr() == base.data_ptr() + i * 48
        assert type(t["pair"]) is LeftRight and t["pair"].left.data_ptr() != cached.data_ptr()
        assert base.data_ptr() <= t["pair"].right[0].data_ptr() < base.data_ptr() + base.numel()
    batch = side.collate(taken, block.id, placer)
    assert batch["image"].data_ptr() == base.data_ptr() and batch["image"].is_contiguous()
    copies = counting_slab_copies(monkeypatch)
    blob, regions = side.dump(batch, block.id)
    assert copies == [(5,)]  # the labels alone were copied in
    assert_same([batch], [tud.default_collate(samples)])
    assert torch.equal(cached, torch.arange(6, dtype=torch.int16)) and samples[0]["image"][0, 0] == 0
    # Once the batch and its samples are let go, nothing views the slab any more, without waiting
    # for the collector (a reference cycle would keep the rows until it ran, past the slab's unmap).
    gc.disable()
    try:
        placed = weakref.ref(placer)
        del batch, taken, placer, t
        assert placed() is None
    finally:
        gc.enable()


def test_a_request_without_a_slab_asks_for_one_at_its_first_sample_for_the_whole_batch():
    # The first sample announces the batch's bytes (its tensors stacked, a number a sample as a
    # tensor's element), asked for once; the batch is then stacked into the slab given, and dump()
    # finds it fits. No slab given: the samples stay as they are, and nothing is asked again.
    import math

    import numpy

    samples = [(torch.full((3, 5), float(i)), i, Custom(w=numpy.float32(i), s="x")) for i in range(4)]
    blocks, block, side = process_slab(1 << 16)
    asker = Answers(block.id)
    placer = side.placer(None, 4, asker)
    taken = placer.settle([placer.take(sample) for sample in samples])
    assert placer.slab_id == block.id and not placer.refused
    batch = side.collate(taken, block.id, placer)
    base = side._maps[block.id][1]
    assert batch[0].data_ptr() == base.data_ptr() and placer.streamed
    blob, regions = side.dump(batch, block.id, asker)
    assert len(asker.asked) == 1 and regions is not None  # it fit: nothing asked again
    sizes = {"float32": 4, "int64": 8}
    used = max(offset + sizes[dtype] * math.prod(shape) for offset, dtype, shape in regions)
    assert [r[1:] for r in regions] == [("float32", (4, 3, 5)), ("int64", (4,)), ("float32", (4,))]
    assert used <= asker.asked[0] <= 2 * used  # what the batch takes, give or take the alignment
    assert_same([batch], [tud.default_collate(samples)])
    refuser = Answers(None)
    refused = side.placer(None, 4, refuser)
    assert [refused.take(sample) is sample for sample in samples] == [True] * 4
    assert refused.settle(list(samples)) == samples
    assert refused.refused and refused.slab_id is None and len(refuser.asked) == 1 and refuser.looks == 1
    # A sample that holds itself is counted once (collate then fails as torch's does, not here).
    looped = [torch.zeros(4)]
    looped.append(looped)
    counter = Answers(None)
    side.placer(None, 4, counter).take(looped)
    assert counter.asked == [4 * 16]


class Answers(_slabs.Asking):
    """The main process's answers to a worker's ask for a slab, in a test: `slab_id` (or None),
    come once the answer has been looked for more than `after` times (None: only when waited for)."""

    def __init__(self, slab_id, after=0):
        self.slab_id, self.after = slab_id, after
        self.asked, self.looks, self.waits = [], 0, 0

    def send(self, needed):
        self.asked.append(needed)

    def answer(self, wait):
        self.looks += 1
        self.waits += bool(wait)
        if wait or (self.after is not None and self.looks > self.after):
            return True, self.slab_id
        return False, None


def test_samples_taken_before_the_slab_is_answered_go_to_their_rows_once_it_is():
    # The samples go on while the main process makes the slab asked for: those taken before the
    # answer came are held as they are, then copied into their rows, and settle() puts them,
    # rebuilt, in the batch's list. An answer not come by the batch's end is waited for there; a
    # batch that fails waits for it too (the pipe must not keep it), and keeps nothing.
    samples = [{"x": torch.full((3,), float(i)), "y": (i, torch.tensor([i, -i]))} for i in range(5)]
    want = tud.default_collate(samples)
    for after, held in ((2, 2), (None, 5), (0, 0)):
        blocks, block, side = process_slab(1 << 16)
        base = side._maps[block.id][1]
        asker = Answers(block.id, after)
        placer = side.placer(None, 5, asker)
        taken = [placer.take(sample) for sample in samples]
        assert [t is s for t, s in zip(taken, samples, strict=True)] == [True] * held + [False] * (5 - held)
        taken = placer.settle(taken)
        assert not any(t is s for t, s in zip(taken, samples, strict=True))
        assert [t["x"].data_ptr() - base.data_ptr() for t in taken] == [12 * i for i in range(5)]
        assert asker.waits == (after is None) and len(asker.asked) == 1
        batch = side.collate(taken, block.id, placer)
        assert placer.streamed and batch["x"].data_ptr() == base.data_ptr()
        assert_same([batch], [want])
    failed = Answers(block.id, None)
    placer = side.placer(None, 5, failed)
    held = weakref.ref(samples[0]["x"])
    placer.take(samples[0])
    placer.close()
    assert failed.waits == 1 and placer.slab_id is None
    del samples
    assert held() is None  # nothing of the failed batch kept


class FreedBefore(Squares):
    """Each sample says whether the tensor of the sample made before it in its process was already
    freed: a worker that stacks samples as they come keeps only their rows in the slab."""

    def __init__(self, n=50, sleep=0.0):
        super().__init__(n)
        self.sleep = sleep

    def __getitem__(self, i):
        time.sleep(self.sleep)
        x = torch.full((64,), float(i))
        freed = getattr(self, "_last", None) is None or self._last() is None
        self._last = weakref.ref(x)
        return x, freed


def test_worker_processes_stack_each_sample_into_the_slab_as_it_comes(slabs_on):
    # Through the loader: batches equal torch's, and each sample's tensor made once its batch has a
    # slab is let go as the next is made (a held batch keeps them all to the end), a request
    # without a slab asking for one at its first sample: no more slabs are made for that than
    # batches are held.
    ours = loader(FreedBefore(48, sleep=0.005), (2, "process"), batch_size=8)
    got = list(ours)
    theirs = list(tud.DataLoader(FreedBefore(48), batch_size=8))
    for (x, _), (y, _) in zip(got, theirs, strict=True):
        assert_same([x], [y])
    assert not any(freed[1:].any() for _, freed in theirs)
    # Samples made while the slab was being answered are held (Note [Samples stacked as they
    # come]), the later ones let go as they come: in each batch, none freed, then all.
    runs = [freed[1:].tolist() for _, freed in got]
    assert all(run == sorted(run) for run in runs) and any(any(run) for run in runs)
    stats = ours.stats()
    assert stats["slab_batches"] == 6 and stats["slab_streamed"] == 6 and stats["slab_misses"] == 0
    assert stats["slabs_made"] <= 6


class FaultyRows(Squares):
    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"no sample {i}")
        return torch.full((4,), float(i))


@pytest.mark.parametrize("on_error", [None, "skip"])
def test_a_batch_that_fails_while_its_slab_is_being_asked_for_leaves_its_process_ready(slabs_on, on_error):
    # Sample 13 fails after its batch's first sample asked for a slab: the answer is taken off the
    # pipe before the error goes back, and the process's next batches are right (one worker: the
    # same process makes them all), in this epoch and the next.
    ours = loader(FaultyRows(20), (1, "process"), batch_size=4, **({"on_error": on_error} if on_error else {}))
    want = [[float(i) for i in range(b, b + 4) if i != 13] for b in range(0, 20, 4)]
    for _ in range(2):
        it = iter(ours)
        got = [next(it)[:, 0].tolist() for _ in range(3)]
        if on_error is None:
            with pytest.raises(ferry.WorkerError, match="no sample 13"):
                next(it)
        else:
            got.append(next(it)[:, 0].tolist())
        got.append(next(it)[:, 0].tolist())
        assert got == (want if on_error else want[:3] + want[4:])
        assert next(it, None) is None
    assert ours.stats()["slab_misses"] == 0


class Custom(collections.abc.Mapping):
    """A Mapping of the user's own: collate rebuilds it (as a dict), the placer leaves it as it is."""

    def __init__(self, **items):
        self._items = items

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_samples_that_do_not_match_the_first_are_stacked_by_torch_from_what_they_hold():
    # A later sample with another dtype or shape at a place, or a subclass there: the rows taken so
    # far stay in their samples and collate stacks the list as torch does, with the same values
    # (or fails as torch fails); a container the placer does not rebuild is left as it is.
    class Sub(torch.Tensor):
        pass

    def make(i, odd):
        x = torch.full((2,), float(i))
        if i == 2 and odd == "dtype":
            x = x.double()
        if i == 3 and odd == "subclass":
            x = x.as_subclass(Sub)
        return (x, Custom(m=torch.full((3,), i)))

    for odd in ("dtype", "subclass", None):
        samples = [make(i, odd) for i in range(4)]
        blocks, block, side = process_slab(1 << 16)
        try:
            want = tud.default_collate(samples)
        except RuntimeError as exc:
            with pytest.raises(RuntimeError, match=str(exc)[:30]):
                taken_as_they_come(side, block.id, samples)
            continue
        got = taken_as_they_come(side, block.id, samples)
        assert type(got[0]) is type(want[0]) and got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
        assert_same([got[1]], [want[1]])
    blocks, block, side = process_slab(1 << 16)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        taken_as_they_come(side, block.id, [torch.zeros(2), torch.zeros(2), torch.zeros(3)])


def test_tensors_stacked_into_a_slab_the_batch_then_leaves_are_moved_out_first():
    # A slab with room for the images but not the labels: the batch asks for another slab (the main
    # process gives this one back to the pool) or goes torch's way; either way its images must no
    # longer be read from the slab given back.
    samples = [(torch.full((64,), float(i)), i) for i in range(4)]
    blocks, block, side = process_slab(1024)  # 1 KiB: the 4 x 64 floats fill it
    batch = side.collate(samples, block.id)
    base = side._maps[block.id][1]
    assert batch[0].data_ptr() == base.data_ptr()
    blob, regions = side.dump(batch, block.id, lambda needed: None)  # no larger slab: torch's way
    assert regions is None
    base.fill_(7)  # the slab, reused by another batch
    assert_same([pickle.loads(blob)], [tud.default_collate(samples)])
    assert_same([batch], [tud.default_collate(samples)])


def test_what_default_collate_does_not_stack_plainly_goes_to_torchs_collate_tensor_fn():
    # Mixed shapes fail as torch's fail; a tensor subclass and mixed dtypes are stacked by torch.
    class Sub(torch.Tensor):
        pass

    blocks, block, side = process_slab(1 << 16)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        side.collate([torch.zeros(2), torch.zeros(3)], block.id)
    for samples in ([torch.zeros(2).as_subclass(Sub), torch.ones(2).as_subclass(Sub)],
                    [torch.zeros(2), torch.ones(2, dtype=torch.float64)]):
        try:
            want = tud.default_collate(samples)
        except RuntimeError as exc:
            with pytest.raises(RuntimeError, match=str(exc)[:30]):
                side.collate(samples, block.id)
            continue
        got = side.collate(samples, block.id)
        base = side._maps[block.id][1]
        assert type(got) is type(want) and got.dtype == want.dtype and torch.equal(got, want)
        assert not (base.data_ptr() <= got.data_ptr() < base.data_ptr() + base.numel())


def test_a_process_forked_from_the_main_one_closes_its_copies_of_the_blocks(slabs_on):
    from ferry import _ferry

    def blocks_open():
        fds = os.listdir("/proc/self/fd")
        return sum("ferry-block" in os.readlink(f"/proc/self/fd/{fd}") for fd in fds
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    ours = loader(Squares(16), (2, "process"), batch_size=4)
    held = list(ours)  # the slabs stay leased while their batches live
    assert blocks_open() > 0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _ferry.forget_shared_blocks()
            os.write(write, str(blocks_open()).encode())
        finally:
            os._exit(0)
    os.close(write)
    left = int(os.read(read, 16))
    os.close(read)
    os.waitpid(pid, 0)
    assert left == 0
    del held


def test_a_batch_larger_than_the_slabs_gets_a_larger_slab_and_the_small_ones_retire(slabs_on):
    ours = loader(Growing(40), (2, "process"), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing travels the slow way, so nothing to warn of
        got = [b.clone() for b in ours]
    assert_same(got, tud.DataLoader(Growing(40), batch_size=4))
    stats = ours.stats()
    assert stats["slab_misses"] == 0 and stats["slab_batches"] == 10
    slabs = ours._pool.slabs
    assert slabs.size >= 4 * (1 << 20)
    assert slabs.retired  # the 1 MiB slabs of the first batches, given back and unmapped in the processes
    again = [b.clone() for b in ours]  # the second epoch: the grown slabs hold every batch
    assert_same(again, got)
    assert ours.stats()["slab_misses"] == 0 and slabs.blocks.stats()["blocks"] <= slabs.max_count


def test_slabs_are_made_one_at_a_time_the_lowest_worker_first():
    from ferry import _slabs

    order, at_once, gate = [], [0, 0], threading.Event()
    slabs = _slabs.Slabs(pinned=False, max_count=8, limit=None)

    class Slow:  # the first slab made holds its turn until the others queue
        def __init__(self, blocks):
            self.blocks = blocks

        def lease(self, nbytes, may_allocate, max_blocks):
            if not may_allocate:
                return None  # none free: each thread makes one
            at_once[0] += 1
            at_once[1] = max(at_once)
            order.append(threading.current_thread().name)
            if len(order) == 1:
                gate.wait(10)
            at_once[0] -= 1
            return self.blocks.lease(nbytes, may_allocate, max_blocks)

    real = slabs.blocks
    slabs.blocks = Slow(real)
    got = []
    threads = [threading.Thread(target=lambda w=w: got.append(slabs.lease_for(4096, w)), name=str(w))
               for w in (5, 3, 4, 1)]
    threads[0].start()
    deadline = time.monotonic() + 10
    while not order and time.monotonic() < deadline:
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
    while len(slabs._queue) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(10)
    assert order == ["5", "1", "3", "4"] and at_once[1] == 1
    assert len(got) == 4 and all(s is not None and s.size >= 4096 for s in got)
    assert len({s.id for s in got}) == 4 and real.stats()["blocks"] == 4
    got.clear()  # the leases go back: the pool keeps the blocks, free
    assert real.stats()["bytes_in_use"] == 0
    slabs.close()
    assert slabs.lease_for(4096, 0) is None  # closed: no slab is leased after


def test_batches_held_past_the_slabs_and_past_the_loader_stay_right_and_are_freed(slabs_on):
    gc.collect()
    fds = fd_count()
    ours = loader(Squares(160), (2, "process"), batch_size=4)
    held = list(ours)  # 40 batches, more than the 2 x 2 + 4 slabs: the rest travel the torch way
    assert_same(held, tud.DataLoader(Squares(160), batch_size=4))
    stats = ours.stats()
    assert stats["slab_batches"] == 8 and stats["slab_misses"] == 32 and stats["slabs_made"] == 8
    pids = ours._pool.pids()
    del ours
    gc.collect()
    assert_same(held, tud.DataLoader(Squares(160), batch_size=4))  # still readable: the slabs outlive the loader
    del held
    gc.collect()
    assert wait_gone(pids) == []
    assert fd_count() == fds


def test_worker_processes_start_when_the_loader_is_made_and_serve_its_batches():
    # A process that runs a thread of its own (a tracker's, say) as the loader is made sends the
    # dataset to a loader zygote, whose workers start at once (Note [Zygote]); one of a single
    # thread, OpenBLAS's aside, forks its loader zygote itself and the workers start at iter().
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait)
    busy.start()
    try:
        ours = loader(Who(12), (2, "process"), batch_size=2)
    finally:
        stop.set()
        busy.join()
    assert not ours._pool.forked
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(ours._pool.pids()) < 2:
        time.sleep(0.02)
    started = sorted(ours._pool.pids())
    assert len(started) == 2  # before any iteration
    used = {int(row[4]) for b in ours for row in b}
    assert used <= set(started) and sorted(ours._pool.pids()) == started  # the same processes, none replaced


def test_pageable_batches_keep_torchs_zero_copy_shared_memory():
    ours = loader(Squares(16), (2, "process"), batch_size=4)
    assert_same(ours, tud.DataLoader(Squares(16), batch_size=4))
    assert ours._pool.slabs is None and "slab_batches" not in ours.stats()


_FREED_KEPT = r"""
import ctypes, sys
from ferry import _worker
tuned = sys.argv[1] == "tuned" and _worker.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

blocks = [libc.malloc(1 << 20) for _ in range(64)]  # a batch's samples: 64 MB in 1 MB blocks
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
held = rss()
for b in blocks:
    libc.free(b)
print(tuned, held - rss())
"""


def test_a_worker_process_keeps_the_memory_a_batch_frees_for_the_next():
    # Note [A worker's freed memory kept]: glibc gives 1 MB blocks back as they are freed by
    # default; in a worker process they stay for the next batch (no page faults to take them again).
    out = {}
    for how in ("default", "tuned"):
        run = subprocess.run([sys.executable, "-c", _FREED_KEPT, how], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert run.returncode == 0, run.stderr
        tuned, given_back = run.stdout.split()
        out[how] = (tuned == "True", int(given_back))
    assert out["default"][0] is False and out["default"][1] >= 48 << 20
    assert out["tuned"][0] is True and out["tuned"][1] < 8 << 20
