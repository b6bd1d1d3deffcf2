"""A Python dataset's loader as a PyTorch user knows it: torch's seeds per generator and per epoch,
torch.manual_seed governing a run, fresh workers each epoch unless persistent (the dataset as it
is at iter(), worker_init_fn once an epoch), __getitems__ only with automatic batching, resumed
seeds, scripts and notebooks without a main guard, and quiet ends (Note [PyTorch's seeds],
Note [Zygote], Note [Quiet ends]). Checked against torch's own DataLoader where PyTorch defines
the behaviour."""

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import ferry
from conftest import alive

PYTHON_PATH = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(ferry.__file__)),
                                          os.environ.get("PYTHONPATH", "")] if p)


class Draws(tud.Dataset):
    """Each sample: its index, the worker's id and seed, and one draw from each global generator."""

    def __init__(self, n=12, scale=1):
        self.n, self.scale = n, scale

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = tud.get_worker_info()
        wid, seed = (-1, 0) if info is None else (info.id, info.seed % 2**31)
        return torch.tensor([i * self.scale, wid, seed, int(torch.randint(0, 2**31, ())),
                             random.randrange(2**31), int(np.random.randint(0, 2**31))])


def rows(batches):
    return [r.tolist() for b in batches for r in b]


def epochs(make, n=2, seed=None):
    """n epochs of one loader, `seed` given to torch.manual_seed first."""
    if seed is not None:
        torch.manual_seed(seed)
    loader = make()
    return [rows(loader) for _ in range(n)]


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
@pytest.mark.parametrize("generator", [None, 5, 7], ids=["default-generator", "generator-5", "generator-7"])
def test_seeds_and_order_are_torchs_for_each_generator_and_epoch(persistent, generator):
    def make(loader_type):
        g = None if generator is None else torch.Generator().manual_seed(generator)
        return lambda: loader_type(Draws(12), batch_size=3, shuffle=True, num_workers=2, generator=g,
                                   persistent_workers=persistent)

    ours = epochs(make(ferry.DataLoader), seed=1)
    theirs = epochs(make(tud.DataLoader), seed=1)
    assert ours == theirs
    assert ours[0] != ours[1] or persistent  # each epoch draws its order (and, not persistent, its seeds)
    assert sorted(r[0] for r in ours[0]) == list(range(12))


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_the_loop_drawing_between_epochs_moves_the_next_epochs_order_as_torchs(persistent):
    # torch draws an epoch's order at its iter(): what the loop draws from the same generator
    # before it (torch.randn on the CPU) moves it. Persistent workers make nothing of the next
    # epoch ahead here, where the order is not known until then.
    def run(loader_type):
        torch.manual_seed(0)
        loader = loader_type(Draws(16), batch_size=2, shuffle=True, num_workers=2, persistent_workers=persistent)
        out = []
        for _ in range(3):
            out.append(rows(loader))
            torch.randn(3)
        return out

    ours, theirs = run(ferry.DataLoader), run(tud.DataLoader)
    assert ours == theirs
    assert [r[0] for r in ours[1]] != [r[0] for r in ours[2]]


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_a_distributed_samplers_set_epoch_reaches_each_epoch_as_in_torch(persistent):
    # The data-parallel recipe: sampler.set_epoch(e) before each epoch's iter(). A sampler is asked
    # for its order in its epoch's turn, never ahead of it.
    def run(loader_type):
        data = Draws(32)
        sampler = tud.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
        loader = loader_type(data, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=persistent)
        out = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            out.append([r[0] for r in rows(loader)])
        return out

    ours, theirs = run(ferry.DataLoader), run(tud.DataLoader)
    assert ours == theirs
    assert ours[0] != ours[1] != ours[2]


@pytest.mark.parametrize("generator", [None, 5], ids=["default-generator", "generator-5"])
def test_a_random_samplers_order_is_drawn_as_torch_draws_it_without_iterating_it(generator, monkeypatch):
    # The order is drawn by randperm as torch's RandomSampler draws it (checked once a process on a
    # small one), and reaches the engine as an int64 buffer; the generator is left where torch's
    # sampler leaves it.
    from ferry import _bridge

    def iterate(self):
        raise AssertionError("the sampler was iterated")

    torch.manual_seed(3)
    g = None if generator is None else torch.Generator().manual_seed(generator)
    loader = ferry.DataLoader(range(1000), batch_size=64, shuffle=True, generator=g, drop_last=True)
    assert _bridge._torch_draws is True
    monkeypatch.setattr(tud.RandomSampler, "__iter__", iterate)
    ours = [b.tolist() for b in loader]
    after = (g or torch.default_generator).get_state()
    monkeypatch.undo()
    torch.manual_seed(3)
    g = None if generator is None else torch.Generator().manual_seed(generator)
    assert ours == [b.tolist() for b in tud.DataLoader(range(1000), batch_size=64, shuffle=True, generator=g, drop_last=True)]
    assert torch.equal(after, (g or torch.default_generator).get_state())


def test_two_generators_give_two_runs_and_manual_seed_governs_the_default():
    def run(g=None, seed=None):
        return epochs(lambda: ferry.DataLoader(Draws(8), batch_size=2, num_workers=2, generator=g), n=1, seed=seed)

    assert run(torch.Generator().manual_seed(1)) != run(torch.Generator().manual_seed(2))
    assert run(torch.Generator().manual_seed(1)) == run(torch.Generator().manual_seed(1))
    assert run(seed=3) == run(seed=3) != run(seed=4)


def test_a_seed_keeps_ferrys_rule_reproducible_without_manual_seed():
    def run():
        torch.manual_seed(random.randrange(2**31))  # ignored: seed= decides
        loader = ferry.DataLoader(Draws(8), batch_size=2, shuffle=True, num_workers=2, seed=40)
        return [rows(loader) for _ in range(2)]

    first, second = run(), run()
    assert first == second
    for epoch, got in enumerate(first):  # worker seeds: seed + epoch * num_workers + id
        assert {(r[1], r[2]) for r in got} == {(w, 40 + epoch * 2 + w) for w in range(2)}


class Mutable(tud.Dataset):
    def __init__(self):
        self.value = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.value


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_a_dataset_changed_between_epochs_reaches_fresh_workers_only(persistent):
    seen = {}
    for name, loader_type in (("ferry", ferry.DataLoader), ("torch", tud.DataLoader)):
        ds = Mutable()
        loader = loader_type(ds, batch_size=2, num_workers=2, persistent_workers=persistent)
        got = []
        for epoch in range(3):
            ds.value = epoch * 10  # set_epoch()-style change, in the main process
            got.append(rows(loader))
        seen[name] = got
    assert seen["ferry"] == seen["torch"]
    assert seen["ferry"][2] == ([0, 0, 0, 0] if persistent else [20, 20, 20, 20])


class Cyclic(Mutable):
    """A dataset that refers to itself, and to one list from two places."""

    def __init__(self):
        super().__init__()
        self.me = self
        self.shared = [0]
        self.also = self.shared

    def __getitem__(self, i):
        return self.value + self.also[0]


@pytest.fixture(params=["forked", "sent"], ids=["loader-zygote-forked", "dataset-sent"])
def zygote_path(request, monkeypatch):
    """Each loader's zygote forked from this process with the dataset in it, or asked of the
    zygote and sent the dataset (Note [Loader zygotes forked from the main process])."""
    import ferry._zygote

    monkeypatch.setattr(ferry._zygote, "fork_safe", lambda: request.param == "forked")
    return request.param


@pytest.mark.parametrize("kind", [Mutable, Cyclic], ids=["plain", "cyclic"])
def test_a_dataset_is_sent_again_only_when_its_values_changed(kind, monkeypatch, zygote_path):
    import ferry._procs
    import ferry._zygote

    sent = []
    real = ferry._zygote.LoaderZygote.send_payload
    monkeypatch.setattr(ferry._zygote.LoaderZygote, "send_payload", lambda self, blob: sent.append(1) or real(self, blob))
    full = []
    check = ferry._procs.check_picklable
    monkeypatch.setattr(ferry._procs, "check_picklable", lambda payload: full.append(1) or check(payload))
    ds = kind()
    loader = ferry.DataLoader(ds, batch_size=2, num_workers=2)
    got = []
    for epoch in range(4):
        if epoch == 2:
            ds.value = 10
        if epoch == 3 and kind is Cyclic:
            ds.shared[0] = 5  # changed through the other reference
        got.append(rows(loader))
    assert got == [[0] * 4, [0] * 4, [10] * 4, [15 if kind is Cyclic else 10] * 4]
    forked = zygote_path == "forked"
    assert [p.forked for p in [loader._pool]] == [forked]
    # Sent when made (not to a loader zygote forked with it), then at each epoch whose values changed.
    assert len(sent) == (2 if kind is Cyclic else 1) + (not forked)
    # The full fingerprint is taken in this process when the loader is made where its zygote is not
    # forked (one forked takes its own), at no first epoch whose zygote was forked at its iter(),
    # and at a later epoch where the quick one saw a change (a cyclic dataset has no quick one:
    # every later epoch asks).
    assert len(full) == (3 + 2 * (not forked) if kind is Cyclic else 1 + (not forked))


@pytest.mark.parametrize("changed", [False, True], ids=["unchanged", "changed"])
def test_a_loader_zygote_forked_when_made_is_compared_at_iter_where_it_cannot_fork_again(changed, monkeypatch):
    # Note [Loader zygotes forked from the main process]: the loader's zygote is forked when it is
    # made; where this process cannot fork at the first iter() (threads started), that zygote's own
    # fingerprint is what the dataset is compared with, and a change is sent.
    import ferry._procs
    import ferry._zygote

    safe = iter([True, False])
    monkeypatch.setattr(ferry._zygote, "fork_safe", lambda: next(safe))
    sent, full = [], []
    real = ferry._zygote.LoaderZygote.send_payload
    monkeypatch.setattr(ferry._zygote.LoaderZygote, "send_payload", lambda self, blob: sent.append(1) or real(self, blob))
    check = ferry._procs.check_picklable
    monkeypatch.setattr(ferry._procs, "check_picklable", lambda payload: full.append(1) or check(payload))
    ds = Mutable()
    loader = ferry.DataLoader(ds, batch_size=2, num_workers=2)
    zygote = loader._pool._loader_zygote
    if changed:
        ds.value = 3
    assert rows(loader) == [3 if changed else 0] * 4
    assert loader._pool.forked and loader._pool._loader_zygote is zygote  # not forked again
    assert (len(sent), len(full)) == ((1, 1) if changed else (0, 0))


def test_a_change_in_what_a_lambda_holds_reaches_fresh_workers(zygote_path):
    # A lambda of an importable module travels by value (cloudpickle), so the quick fingerprint
    # takes its closure too: a change there between epochs is sent to the next epoch's workers.
    box = [0]
    loader = ferry.DataLoader(Mutable(), batch_size=2, num_workers=2, collate_fn=lambda b: [x + box[0] for x in b])
    first = list(loader)
    box[0] = 5
    assert (first, list(loader)) == ([[0, 0], [0, 0]], [[5, 5], [5, 5]])


def test_the_fingerprints_digest_sees_any_change_however_the_stream_is_cut():
    # Note [A fingerprint's digest] (python/src/digest.cpp).
    from ferry import _ferry

    def digest(*parts):
        d = _ferry.Digest()
        for p in parts:
            d.update(p)
        return d.digest()

    data = bytes(range(256)) * 41 + b"tail"
    whole = digest(data)
    assert len(whole) == 16
    assert all(digest(data[:i], memoryview(data)[i:j], data[j:]) == whole for i, j in [(0, 0), (1, 9), (7, 8), (13, 5000)])
    changed = {digest(data[:i] + bytes([data[i] ^ 1 << b]) + data[i + 1:]) for i in (0, 7, 8, 5000, len(data) - 1)
               for b in (0, 7)}
    assert len(changed) == 10 and whole not in changed  # each one-bit change, a digest of its own
    assert len({digest(b""), digest(b"\0"), digest(b"\0" * 8), digest(b"\0" * 9)}) == 4  # trailing zeros count
    with pytest.raises(TypeError):
        _ferry.Digest().update("text")  # not a buffer
    limited = _ferry.Digest(limit=10)  # as the file a quick fingerprint's pickle is written to
    assert limited.write(b"12345") == 5
    with pytest.raises(ValueError, match="limit"):
        limited.write(b"123456")  # past the limit: nothing added
    assert limited.write(memoryview(b"12345")) == 5 and limited.digest() == digest(b"1234512345")


class Counted(tud.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.getpid()


def test_worker_init_fn_runs_once_an_epoch_in_new_processes_unless_persistent(tmp_path):
    def init(worker_id):
        with open(tmp_path / f"{os.getpid()}-{worker_id}", "w"):
            pass

    for persistent, calls in ((False, 6), (True, 2)):
        for name in os.listdir(tmp_path):
            os.unlink(tmp_path / name)
        loader = ferry.DataLoader(Counted(), batch_size=2, num_workers=2, worker_init_fn=init,
                                  persistent_workers=persistent)
        pids = [set(rows_or_ints(loader)) for _ in range(3)]
        assert len(os.listdir(tmp_path)) == calls, persistent
        if not persistent:
            assert pids[0].isdisjoint(pids[1]) and pids[1].isdisjoint(pids[2])  # new processes each epoch
        else:
            assert pids[0] == pids[1] == pids[2]


def rows_or_ints(batches):
    return [int(v) for b in batches for v in b]


class WithGetitems(tud.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return ("one", i)

    def __getitems__(self, indices):
        return [("many", i) for i in indices]


@pytest.mark.parametrize("workers", [0, 2])
def test_getitems_only_with_automatic_batching(workers):
    batched = list(ferry.DataLoader(WithGetitems(), batch_size=2, num_workers=workers))
    assert batched[0][0] == ("many", "many")
    unbatched = list(ferry.DataLoader(WithGetitems(), batch_size=None, num_workers=workers))
    assert [tuple(u) for u in unbatched] == [("one", torch.tensor(i)) for i in range(4)]


def test_resume_restores_the_epochs_seeds():
    def make():
        return ferry.DataLoader(Draws(16), batch_size=2, shuffle=True, num_workers=2)

    torch.manual_seed(8)
    whole = rows(make())
    torch.manual_seed(8)
    first = make()
    it = iter(first)
    head = rows([next(it) for _ in range(3)])
    state = first.state_dict()
    del it, first
    torch.manual_seed(999)  # another run: the saved epoch keeps its own seeds and order
    resumed = make()
    resumed.load_state_dict(state)
    # The same order, on the same workers, with the same seeds. (Each worker's generators start
    # again from its seed: draws that must survive a resume key on ferry.sample_seed() or
    # sample_seeding=True.)
    assert [r[:3] for r in head + rows(resumed)] == [r[:3] for r in whole]


# --- scripts and notebooks -------------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import torch, ferry

    class Squares(torch.utils.data.Dataset):      # defined in __main__, no main guard
        def __len__(self):
            return 6
        def __getitem__(self, i):
            return i * i

    loader = ferry.DataLoader(Squares(), batch_size=2, num_workers=2)
    print([b.tolist() for b in loader])
""")


def run_python(args, stdin=None, timeout=120, **env_vars):
    env = dict(os.environ, PYTHONPATH=PYTHON_PATH, **env_vars)
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env,
                          timeout=timeout)


MUTATED = textwrap.dedent("""
    import sys, torch, ferry, ferry._procs, ferry._zygote

    if sys.argv[1] == "sent":
        ferry._zygote.fork_safe = lambda: False
    full = []
    check = ferry._procs.check_picklable
    ferry._procs.check_picklable = lambda payload: full.append(1) or check(payload)

    SHIFT = 0

    class Scaled(torch.utils.data.Dataset):       # defined in __main__: it travels by value
        offset = 0
        def __init__(self):
            self.scale = 1
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return i * self.scale + self.offset + SHIFT

    ds = Scaled()
    loader = ferry.DataLoader(ds, batch_size=2, num_workers=2)
    got = []
    for epoch in range(6):
        if epoch == 2:
            ds.scale = 10
        if epoch == 4:
            Scaled.offset = 1                     # the class's own attribute
        if epoch == 5:
            SHIFT = 100                           # a global its method reads
        got.append([b.tolist() for b in loader])
    print(got, len(full), loader._pool.forked)
""")


@pytest.mark.parametrize("path", ["forked", "sent"])
def test_a_scripts_dataset_changed_between_epochs_is_seen_and_an_unchanged_one_not_pickled_again(tmp_path, path):
    script = tmp_path / "mutate.py"
    script.write_text(MUTATED)
    done = run_python([str(script), path])
    assert done.returncode == 0, done.stderr
    # The full fingerprint at the epochs that changed the dataset, and when the loader is made
    # where its zygote is not forked from this process (a fresh one is: one thread).
    assert done.stdout.strip() == ("[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 10], [20, 30]], [[0, 10], [20, 30]], "
                                   "[[1, 11], [21, 31]], [[101, 111], [121, 131]]] "
                                   + ("3 True" if path == "forked" else "4 False"))


FORKED = textwrap.dedent("""
    import os, signal, sys, time, torch, ferry

    print("made before")                          # left in this process's buffer (a pipe)
    signal.signal(signal.SIGTERM, lambda *a: print("the script's handler ran", flush=True))

    class Items(torch.utils.data.Dataset):
        def __init__(self):
            self.items = [(f"/data/{i}.jpg", i) for i in range(5000)]
        def __len__(self):
            return 8
        def __getitem__(self, i):
            if i == 0:
                print("a worker writes", flush=True)
            return self.items[i][1]

    def sockets(pid):
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
        return {s for s in out if s.startswith("socket:")}

    def children():
        return set(open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split())

    ds = Items()
    a = ferry.DataLoader(ds, batch_size=4, num_workers=2)
    made = a._pool._loader_zygote                 # forked when a was made, replaced at its iter()
    ds.items[1] = ("/data/changed.jpg", 100)      # after the loader is made: its first epoch sees it
    first = [b.tolist() for b in a]
    za = a._pool._loader_zygote
    b = ferry.DataLoader(Items(), batch_size=4, num_workers=2)
    assert len(list(b)) == 2                      # b's zygote has forked its workers: it let go of a's pipes before
    zb = b._pool._loader_zygote                   # forked at b's iter(), as a's
    mine = {f"socket:[{os.fstat(c.fileno()).st_ino}]" for c in (za.conn,)}
    kept = mine & sockets(zb.pid)                 # a's pipe, held by b's zygote
    child = str(za.pid) in children()
    os.kill(zb.pid, signal.SIGTERM)               # b's zygote ends by it, quietly
    time.sleep(0.5)
    a._pool.close()
    print(first, a._pool.forked, b._pool.forked, child, len(kept), os.path.exists(f"/proc/{za.pid}"),
          za is not made, os.path.exists(f"/proc/{made.pid}"))
""")


def test_a_loader_zygote_forked_from_the_main_process(tmp_path):
    # Note [Loader zygotes forked from the main process]: a process of one thread forks each
    # loader's zygote itself, with the dataset in it.
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    done = run_python([str(script)])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # The first epoch sees the dataset as it was at iter(), in a loader zygote forked then (the one
    # forked when the loader was made is reaped when it closes, as that one); the main process's
    # buffered output is written once; the loader zygote is this process's child, holds no pipe
    # of another loader's; the script's SIGTERM handler does not run in it.
    assert lines.count("made before") == 1, done.stdout
    assert lines[-1] == "[[0, 100, 2, 3], [4, 5, 6, 7]] True True True 0 False True False", done.stdout
    assert "the script's handler ran" not in done.stdout


def test_a_script_without_a_main_guard_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = run_python([str(script)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0, 1], [4, 9], [16, 25]]"
    assert done.stderr == ""


def test_a_script_on_standard_input_runs():
    done = run_python(["-"], stdin=SCRIPT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0, 1], [4, 9], [16, 25]]" and done.stderr == ""


def test_a_class_made_by_exec_in_main_runs():  # a notebook cell's class
    code = "import __main__\nexec(compile(" + repr(SCRIPT) + ", '<cell>', 'exec'), __main__.__dict__)\n"
    done = run_python(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0, 1], [4, 9], [16, 25]]" and done.stderr == ""


def test_a_loader_made_after_threads_started_runs_from_a_fresh_zygote(tmp_path):
    # ferry imported by a process already running threads: no fork then; the zygote is started as
    # a fresh interpreter when the first loader needs it.
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(3,), daemon=True).start()\n" + SCRIPT
    done = run_python(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0, 1], [4, 9], [16, 25]]" and done.stderr == ""


def test_a_fresh_zygote_starts_no_zygote_of_its_own():
    # The fresh interpreter imports ferry to serve; that import must not start another zygote.
    code = ("import threading, time\nthreading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
            "import os, time, ferry\nz = ferry._zygote._zygote\ntime.sleep(1.0)\n"
            "print(z._popen is not None, len(open(f'/proc/{z.pid}/task/{z.pid}/children').read().split()))\n")
    done = run_python(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "0"]


def test_the_zygote_is_forked_where_the_other_threads_are_openblas_s(monkeypatch):
    # Note [Zygote]: OpenBLAS shuts its threads down before a fork; any other thread means a fresh
    # interpreter.
    z = ferry._zygote
    monkeypatch.setattr(z, "_threads", lambda: 3)
    monkeypatch.setattr(z, "_openblas_threads", lambda: 2)
    monkeypatch.setattr(z, "_cuda_driver_threads", lambda: 0)  # a GPU host's test process runs CUDA's
    assert z._fork_safe()
    monkeypatch.setattr(z, "_openblas_threads", lambda: 1)  # a thread that is not OpenBLAS's
    assert not z._fork_safe()
    monkeypatch.setattr(z, "_threads", lambda: 1)
    monkeypatch.setattr(z, "_openblas_threads", lambda: 0)
    assert z._fork_safe()


def test_forking_beside_openblas_threads_raises_no_warning_even_as_an_error(monkeypatch):
    # Python 3.12 warns of a fork from a process of several threads, OpenBLAS's counted: where
    # ferry forks beside them only, the warning is false, and under -W error it would raise in
    # the parent after the child exists. (Python's own fork is stood in for: 3.11 has no warning.)
    import warnings

    z = ferry._zygote

    def fork():
        warnings.warn(f"This process (pid={os.getpid()}) is multi-threaded, use of fork() may lead to deadlocks "
                      "in the child.", DeprecationWarning, stacklevel=2)
        return 12345

    monkeypatch.setattr(z.os, "fork", fork)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert z._fork() == 12345
        with pytest.raises(DeprecationWarning):  # the filter is the fork's alone
            fork()


BLAS_IN_WORKERS = textwrap.dedent("""
    import os, numpy, torch, ferry

    class Blas(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            a = numpy.full((300, 300), float(i))
            return torch.tensor(float((a @ a)[0, 0]))  # a product OpenBLAS splits across its threads

    z = ferry._zygote._zygote
    print(z._popen is None, [b.tolist() for b in ferry.DataLoader(Blas(), batch_size=4, num_workers=2)])
""")


def test_numpy_s_openblas_threads_leave_the_zygote_forked_and_its_workers_use_blas():
    # torch imports numpy, whose OpenBLAS starts a thread a CPU: ferry imported after torch still
    # forks its zygote, and BLAS works in the workers forked from it.
    # Whether numpy's BLAS runs threads here is read from the process itself (its threads after
    # numpy's import), not from the function under test: scripts/install-deps.sh installs Debian's
    # OpenBLAS, so on a machine of 2 CPUs or more this runs.
    probe = run_python(["-c", "import os, numpy\nprint(len(os.listdir('/proc/self/task')))"])
    assert probe.returncode == 0, probe.stderr
    if int(probe.stdout.split()[-1]) == 1:
        pytest.skip("this numpy's BLAS runs no threads of its own (not OpenBLAS, or one CPU)")
    done = run_python(["-c", BLAS_IN_WORKERS], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 1)[0] == "True"
    assert done.stdout.split(" ", 1)[1].strip() == str([[300.0 * i * i for i in range(4)], [300.0 * i * i for i in range(4, 8)]])
    assert "multi-threaded" not in done.stderr  # no fork warning: OpenBLAS's threads were down as it forked


# --- quiet ends ------------------------------------------------------------------------------------

def run_in_scratch(tmp_path, script_text, arg):
    """Runs a script with a temporary directory of its own (TMPDIR): its result and that directory."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    return run_python([str(script), arg], TMPDIR=str(scratch)), scratch


ENDING = textwrap.dedent("""
    import os, signal, sys, time, torch, ferry

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 10000
        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.zeros(4)

    loader = ferry.DataLoader(Slow(), batch_size=4, num_workers=3)
    it = iter(loader)
    next(it)
    pids = loader._pool.pids() + [loader._pool._loader_zygote.pid, ferry._zygote._zygote.pid]
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(0.2)  # the workers are busy making batches
    if sys.argv[1] == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_the_main_process_ending_mid_epoch_leaves_nothing_and_prints_nothing(tmp_path, how):
    shm_before = set(os.listdir("/dev/shm"))
    done, scratch = run_in_scratch(tmp_path, ENDING, how)  # once every process holding its output has ended
    assert done.returncode == (0 if how == "exit" else -signal.SIGKILL), done.stderr
    assert done.stderr == ""
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 5
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert os.listdir(scratch) == []  # the main process's temporary folder: removed by the zygote


EXIT_AT_FIRST_BATCH = textwrap.dedent("""
    import os, torch, ferry

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return torch.full((4,), i)

    for batch in ferry.DataLoader(Items(), batch_size=4, num_workers=2):
        os._exit(0)  # while the workers hand over their next batches
""")


def test_os_exit_at_the_first_batch_prints_nothing_20_times_in_20(tmp_path):
    # A worker handing over a batch torch's way (its tensors' shared memory through
    # multiprocessing's resource sharer) met the main process's end mid-handshake and printed the
    # sharer's traceback, after the main process had gone, in about 1 run of 10.
    script = tmp_path / "exit.py"
    script.write_text(EXIT_AT_FIRST_BATCH)
    noisy = []
    for run in range(20):
        done = run_python([str(script)])  # returns once every process holding its output has ended
        assert done.returncode == 0, done.stderr
        if done.stderr:
            noisy.append((run, done.stderr[-2000:]))
    assert noisy == []


TEMPORARY = textwrap.dedent("""
    import sys, torch, ferry

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 12
        def __getitem__(self, i):
            return torch.full((3,), i)

    if __name__ == "__main__":  # forkserver's workers import this script
        context = None if sys.argv[1] == "zygote" else sys.argv[1]
        loader = ferry.DataLoader(Rows(), batch_size=None, num_workers=2, multiprocessing_context=context)
        for epoch in range(2):  # workers that are not persistent: each epoch's own processes
            assert sorted(int(row[0]) for row in loader) == list(range(12))
        print("ok")
""")


@pytest.mark.parametrize("context", ["zygote", "forkserver"])
def test_worker_processes_leave_no_temporary_folder(tmp_path, context):
    # Samples without automatic batching travel torch's way (a tensor's storage handed over
    # through multiprocessing's resource sharer, whose listener lives in a temporary folder); a
    # worker ends with os._exit, so a folder of its own would outlive it.
    done, scratch = run_in_scratch(tmp_path, TEMPORARY, context)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n"
    assert sorted(os.listdir(scratch)) == []


def test_a_named_multiprocessing_context_gives_the_same_batches_and_seeds():
    # multiprocessing_context="forkserver" starts each worker that way (it imports the test
    # module again) instead of forking it from the zygote; what the user sees is the same.
    def run(**kw):
        return epochs(lambda: ferry.DataLoader(Draws(8), batch_size=2, shuffle=True, num_workers=2, **kw), seed=5)

    assert run(multiprocessing_context="forkserver") == run()


def test_a_dataset_in_a_module_that_imports_ferry_loads_in_the_workers(tmp_path):
    # The zygote is forked while ferry is imported, so the module importing it is half run there:
    # the zygote forgets such modules, and the dataset's module is imported whole for the workers.
    (tmp_path / "mydata.py").write_text(textwrap.dedent("""
        import torch, ferry

        class Cubes(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return i ** 3

        LOADED = True
    """))
    code = ("import sys; sys.path.insert(0, %r)\nimport mydata, ferry\n"
            "print([b.tolist() for b in ferry.DataLoader(mydata.Cubes(), batch_size=2, num_workers=2)])\n"
            % str(tmp_path))
    done = run_python(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0, 1], [8, 27]]" and done.stderr == ""


# --- a script's own classes in samples and batches (Note [Replies by the main process's names]) --

SCRIPT_CLASSES = textwrap.dedent("""
    import collections, faulthandler, sys, threading

    HOW, CONTEXT = sys.argv[1], (None if sys.argv[2] == "default" else sys.argv[2])
    if HOW == "faulthandler":     # the watchdog thread runs before ferry's import
        faulthandler.dump_traceback_later(600)
    elif HOW == "thread":         # a tracker's thread
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()

    import torch

    Pair = collections.namedtuple("Pair", "a b")

    class Batch:                  # what a collate_fn of the script returns
        def __init__(self, items):
            self.ids = torch.tensor([i for i, _ in items])

    def collate(items):
        return Batch(items)

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return (i, Pair(i, float(i)))

    def main():
        import ferry              # imported inside main(), after the thread started
        for collate_fn in (None, collate):
            loader = ferry.DataLoader(Items(), batch_size=4, num_workers=2, collate_fn=collate_fn,
                                      multiprocessing_context=CONTEXT)
            for b in loader:
                if collate_fn is None:
                    assert type(b[1]) is Pair, type(b[1])  # the script's own class, as torch's workers give
                    print(b[1].a.tolist(), end=" ")
                else:
                    assert type(b) is Batch, type(b)
                    print(b.ids.tolist(), end=" ")
        print()
        if HOW == "faulthandler":
            faulthandler.cancel_dump_traceback_later()

    if __name__ == "__main__":
        main()
""")


@pytest.mark.parametrize("how,context", [("faulthandler", "default"), ("thread", "default"), ("none", "default"),
                                         ("thread", "spawn"), ("thread", "forkserver")])
def test_a_scripts_namedtuple_and_batch_class_come_back_as_the_scripts_own(tmp_path, how, context):
    script = tmp_path / "classes.py"
    script.write_text(SCRIPT_CLASSES)
    done = run_python([str(script), how, context], timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[0,", "1,", "2,", "3]", "[4,", "5,", "6,", "7]"] * 2


def test_a_class_the_main_process_does_not_have_is_named_in_the_error():
    from ferry import _pickling

    with pytest.raises(pickle.UnpicklingError, match="__main__.NoSuchClass, which this process's __main__ does not define"):
        _pickling.main_attr("NoSuchClass")


NAMES = textwrap.dedent("""
    import os, torch, ferry

    def comm(pid):
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return torch.tensor([os.getpid()])

    loader = ferry.DataLoader(Items(), batch_size=2, num_workers=2, persistent_workers=True)
    workers = sorted({int(v) for b in loader for v in b})
    zygote = ferry._zygote._zygote
    print(comm(zygote.pid), comm(loader._pool._loader_zygote.pid), *sorted(comm(p) for p in workers))
""")


def test_ferrys_processes_say_what_they_are():
    # ps -e and top show PR_SET_NAME's name: the zygote, the loader's zygote and its workers.
    done = run_python(["-c", NAMES])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ferry-zygote", "ferry-loader", "ferry-worker-0", "ferry-worker-1"]


AFTER_CUDA = textwrap.dedent("""
    import ctypes, os, sys, threading

    # Threads as the CUDA driver starts them once a model is on the GPU (named "cuda-EvtHandlr"
    # and the like), here stood in for on a machine without one; or a thread of the script's own.
    ready, stop = threading.Event(), threading.Event()

    def driver():
        if sys.argv[1] == "cuda":
            ctypes.CDLL(None).prctl(15, b"cuda-EvtHandlr", 0, 0, 0)
        ready.set()
        stop.wait()

    threading.Thread(target=driver, daemon=True).start()
    ready.wait()
    import torch, ferry
    from ferry import _zygote

    print(_zygote._fork_safe(), _zygote._zygote._popen is None)
""")


@pytest.mark.parametrize("thread", ["cuda", "own"])
def test_the_zygote_is_forked_beside_the_cuda_drivers_threads_not_beside_the_scripts_own(thread):
    done = run_python(["-c", AFTER_CUDA, thread])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["True", "True"] if thread == "cuda" else ["False", "False"])
    off = run_python(["-c", AFTER_CUDA, thread], FERRY_ZYGOTE_AFTER_CUDA="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "False"]
