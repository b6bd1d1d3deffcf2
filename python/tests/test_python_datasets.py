"""ferry.DataLoader over Python datasets (map-style and iterable, as torch.utils.data takes them):
the same batches as torch's DataLoader, PyTorch's arguments, errors with their cause, timeouts,
on_error, resume at any worker count, Ctrl-C, and nothing left behind."""

import collections
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.utils.data as tud

import ferry


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
    for a, b in zip(ours, theirs):
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


def thread_count():
    return len(os.listdir("/proc/self/task"))


def fd_count():
    return len(os.listdir("/proc/self/fd"))


# --- the same batches as torch ------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 3])
def test_map_style_batches_equal_torchs(workers):
    ds = Squares(50)
    for drop_last in (False, True):
        ours = ferry.DataLoader(ds, batch_size=8, num_workers=workers, drop_last=drop_last)
        theirs = tud.DataLoader(ds, batch_size=8, drop_last=drop_last)
        assert len(ours) == len(theirs) == (6 if drop_last else 7)
        assert_same(ours, theirs)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_users_sampler_batch_sampler_and_generator_give_torchs_order(workers):
    ds = Squares(40)
    sampler = tud.SubsetRandomSampler(range(0, 40, 3), generator=torch.Generator().manual_seed(5))
    ours = list(ferry.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers))
    sampler.generator.manual_seed(5)
    assert_same(ours, tud.DataLoader(ds, batch_size=4, sampler=sampler))

    batches = [[3, 1], [0], [39, 38, 37]]
    assert_same(ferry.DataLoader(ds, batch_sampler=batches, num_workers=workers),
                tud.DataLoader(ds, batch_sampler=batches))

    ours = list(ferry.DataLoader(ds, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(9),
                                 num_workers=workers))
    assert_same(ours, tud.DataLoader(ds, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(9)))


def test_ferrys_own_shuffle_visits_every_sample_once_for_any_worker_count():
    ds = Squares(37)
    orders = []
    for workers in (0, 1, 4):
        loader = ferry.DataLoader(ds, batch_size=5, shuffle=True, seed=3, num_workers=workers)
        orders.append([int(v) for b in loader for v in b["label"] * 0 + torch.tensor(
            [int(n[1:]) for n in b["name"]])])
    assert orders[0] == orders[1] == orders[2]
    assert sorted(orders[0]) == list(range(37)) and orders[0] != list(range(37))


def test_lists_tensor_datasets_getitems_and_unbatched_samples():
    assert_same(ferry.DataLoader([1, 2, 3, 4, 5], batch_size=2), tud.DataLoader([1, 2, 3, 4, 5], batch_size=2))
    td = tud.TensorDataset(torch.arange(20).view(10, 2), torch.arange(10))
    assert_same(ferry.DataLoader(td, batch_size=3, num_workers=2), tud.DataLoader(td, batch_size=3))
    assert_same(ferry.DataLoader(td, batch_size=None), tud.DataLoader(td, batch_size=None))

    class Batched(Squares):
        calls = []

        def __getitems__(self, indices):
            self.calls.append(list(indices))
            return [self[i] for i in indices]

    ds = Batched(10)
    assert_same(ferry.DataLoader(ds, batch_size=4, num_workers=2), tud.DataLoader(Squares(10), batch_size=4))
    assert sorted(Batched.calls) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # one call a batch


def test_a_collate_fn_returning_a_custom_type():
    Pair = collections.namedtuple("Pair", "xs names")

    def collate(samples):
        return Pair(torch.stack([s["x"] for s in samples]), [s["name"] for s in samples])

    batches = list(ferry.DataLoader(Squares(10), batch_size=4, collate_fn=collate, num_workers=2))
    assert [type(b) for b in batches] == [Pair] * 3
    assert batches[2].names == ["s8", "s9"] and batches[2].xs.shape == (2, 2, 3)


class Shards(tud.IterableDataset):
    """An iterable dataset that reads its worker's share, as torch's documentation shows."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = ferry.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_an_iterable_dataset_sharded_by_get_worker_info(workers):
    got = [int(v) for b in ferry.DataLoader(Shards(23), batch_size=4, num_workers=workers) for v in b]
    assert sorted(got) == list(range(23))  # each sample once, whatever the worker count
    if workers == 0:
        assert got == list(range(23))
    with pytest.raises(ValueError, match="iterable dataset decides its own order: shuffle"):
        ferry.DataLoader(Shards(3), shuffle=True)


def test_worker_init_fn_and_get_worker_info_run_on_each_worker():
    seen = []
    lock = threading.Lock()

    def init(worker_id):
        info = ferry.get_worker_info()
        with lock:
            seen.append((worker_id, info.id, info.num_workers, info.seed, type(info.dataset).__name__))

    class Who(Squares):
        def __getitem__(self, i):
            return ferry.get_worker_info().id

    loader = ferry.DataLoader(Who(12), batch_size=2, num_workers=3, worker_init_fn=init, seed=100)
    ids = {int(v) for b in loader for v in b}
    assert sorted(seen) == [(0, 0, 3, 100, "Who"), (1, 1, 3, 101, "Who"), (2, 2, 3, 102, "Who")]
    assert ids <= {0, 1, 2}
    assert ferry.get_worker_info() is None  # not on the main thread
    calls = []
    list(ferry.DataLoader(Squares(4), batch_size=2, worker_init_fn=calls.append))
    assert calls == []  # as torch: no workers, no worker_init_fn


def test_the_attributes_pytorch_code_reads():
    ds = Squares(10)
    loader = ferry.DataLoader(ds, batch_size=3, num_workers=2, drop_last=True, timeout=5, prefetch_factor=4,
                              persistent_workers=True)
    for name, value in dict(dataset=ds, batch_size=3, num_workers=2, drop_last=True, timeout=5, prefetch_factor=4,
                            persistent_workers=True, pin_memory=False, collate_fn=None, generator=None).items():
        assert getattr(loader, name) == value if name != "dataset" else getattr(loader, name) is ds
    assert len(loader) == 3
    assert isinstance(ferry.DataLoader(ds, batch_size=2, sampler=range(10)).batch_sampler, tud.BatchSampler)
    with pytest.warns(UserWarning, match="multiprocessing_context has no effect"):
        ferry.DataLoader(ds, multiprocessing_context="spawn")
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        ferry.DataLoader(ds, sampler=range(10), shuffle=True)
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        ferry.DataLoader(ds, batch_sampler=[[0]], batch_size=2)
    with pytest.raises(TypeError, match="map-style dataset .*__getitem__ and __len__.* got object"):
        ferry.DataLoader(object())


# --- errors ----------------------------------------------------------------------------------------

class Faulty(Squares):
    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"no sample {i}")
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_an_exception_in_the_dataset_arrives_at_its_batch_with_its_cause_and_traceback(workers):
    loader = ferry.DataLoader(Faulty(20), batch_size=4, num_workers=workers)
    it = iter(loader)
    assert [int(v) for v in next(it)] == [0, 1, 2, 3]
    assert next(it).tolist() == [4, 5, 6, 7]
    assert next(it).tolist() == [8, 9, 10, 11]
    with pytest.raises(ferry.WorkerError) as caught:
        next(it)
    err = caught.value
    assert isinstance(err.__cause__, KeyError) and err.__cause__.args == ("no sample 13",)
    assert err.batch == 3
    assert "KeyError: 'no sample 13'" in str(err) and "test_python_datasets.py" in str(err)  # the traceback's text
    assert err.__cause__.__traceback__ is not None
    assert next(it).tolist() == [16, 17, 18, 19]  # the loop may go on


def test_on_error_skip_and_replace_cost_only_the_bad_sample():
    rows = [int(v) for b in ferry.DataLoader(Faulty(20), batch_size=4, num_workers=2, on_error="skip") for v in b]
    assert rows == [i for i in range(20) if i != 13]
    batches = list(ferry.DataLoader(Faulty(20), batch_size=4, num_workers=2, on_error="replace"))
    assert [len(b) for b in batches] == [4] * 5 and 13 not in [int(v) for b in batches for v in b]


def test_a_sample_stuck_past_timeout_is_a_timeout_error_and_the_loop_goes_on():
    release = threading.Event()

    class Stuck(Squares):
        def __getitem__(self, i):
            if i == 5:
                release.wait(60)  # stuck until the test ends
            return i

    try:
        loader = ferry.DataLoader(Stuck(12), batch_size=2, num_workers=2, timeout=0.3)
        it = iter(loader)
        assert next(it).tolist() == [0, 1] and next(it).tolist() == [2, 3]
        start = time.monotonic()
        with pytest.raises(ferry.TimeoutError, match="timed out"):
            next(it)
        assert time.monotonic() - start < 10
        assert next(it).tolist() == [6, 7]
        assert loader.stats()["abandoned_workers"] == 1
    finally:
        release.set()


# --- resume ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("before,after", [(0, 3), (2, 0)])
def test_state_dict_resumes_mid_epoch_at_another_worker_count(before, after):
    ds = Squares(30)
    whole = [b["label"].tolist() + [b["name"]] for b in ferry.DataLoader(ds, batch_size=4, shuffle=True, seed=11)]
    loader = ferry.DataLoader(ds, batch_size=4, shuffle=True, seed=11, num_workers=before)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it, loader
    resumed = ferry.DataLoader(ds, batch_size=4, shuffle=True, seed=11, num_workers=after)
    resumed.load_state_dict(state)
    assert [b["label"].tolist() + [b["name"]] for b in resumed] == whole[3:]


# --- Ctrl-C and cleanup -----------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_ctrl_c_during_a_30_second_python_sample_ends_the_loop_within_1_s(workers):
    script = f"""
        import sys, time, ferry
        class Slow:
            def __len__(self): return 100
            def __getitem__(self, i):
                time.sleep(30)
                return i
        loader = ferry.DataLoader(Slow(), batch_size=2, num_workers={workers})
        print("ready", flush=True)
        try:
            for batch in loader:
                pass
        except KeyboardInterrupt:
            print("interrupted %.3f" % time.monotonic(), flush=True)
            sys.exit(0)
        print("finished", flush=True)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.7)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        exited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.startswith("interrupted"), (out, err)
    assert float(out.split()[1]) - sent < 1.0, out
    assert exited < 5.0
    assert "leaked" not in err, err


def test_a_module_level_loader_exits_cleanly():
    # The loader (through its dataset's class and the module's globals) is in a cycle the collector
    # cannot see into; it is released at exit, with no leak report and no hang.
    script = """
        import ferry
        class Data:
            def __len__(self): return 10
            def __getitem__(self, i): return i
        loader = ferry.DataLoader(Data(), batch_size=3, num_workers=2, persistent_workers=True)
        print(sum(len(b) for b in loader), flush=True)
        it = iter(loader); next(it)   # exit mid-epoch
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "10", proc
    assert proc.stderr == "", proc.stderr


def test_create_iterate_break_destroy_leaves_no_thread_or_descriptor():
    def cycle():
        loader = ferry.DataLoader(Squares(40), batch_size=4, num_workers=3, prefetch_factor=2)
        for i, _ in enumerate(loader):
            if i == 2:
                break
        del loader

    cycle()
    gc.collect()
    threads, fds = thread_count(), fd_count()
    for _ in range(30):
        cycle()
    gc.collect()
    assert thread_count() == threads
    assert fd_count() == fds


def test_pin_memory_without_cuda_warns_and_delivers_pageable_batches():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: test_gpu.py checks pinned batches")
    with pytest.warns(UserWarning, match="pin_memory=True but torch sees no CUDA device"):
        loader = ferry.DataLoader(Squares(4), batch_size=2, pin_memory=True)
    assert [b["x"].is_pinned() for b in loader] == [False, False]
