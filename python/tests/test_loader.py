"""ferry.DataLoader from Python on the CPU: the same batches as the C++ loader, handed to torch
without a copy, errors as Python exceptions, Ctrl-C, and cleanup."""

import gc
import os
import re
import shutil
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import ferry
from conftest import interrupt_after
from ferry import _ferry


def reference(dataset, epoch=0, **kw):
    """The batches a plain C++ DataLoader makes with these options, as lists of bytes per field."""
    opts = dict(batch_size=1, shuffle=False, num_workers=0, pin_memory=False, drop_last=False, timeout=0.0,
                prefetch_factor=2, persistent_workers=False, seed=0, device=None, in_order=True, on_error="raise",
                max_errors=0, max_error_fraction=0.1, gather="auto", pinned_memory_limit=None, stream=0,
                trace_batches=0)
    opts.update(kw)
    return _ferry.reference_batches(dataset, _ferry.make_options(**opts), epoch)


def as_bytes(batch):
    return [t.contiguous().numpy().tobytes() for t in batch]


def thread_count():
    return len(os.listdir("/proc/self/task"))


# --- same batches -------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 3])
@pytest.mark.parametrize("epoch", [0, 2])
def test_batches_equal_the_cpp_loaders(rows_npy, workers, epoch):
    path, _ = rows_npy
    ds = ferry.datasets.npy(path)
    loader = ferry.DataLoader(ds, batch_size=64, shuffle=True, num_workers=workers, seed=11)
    loader.set_epoch(epoch)
    got = [as_bytes(b) for b in loader]
    want = reference(ds, epoch, batch_size=64, shuffle=True, num_workers=1, seed=11)
    assert len(got) == len(want) == 16
    assert got == [[bytes(f) for f in b] for b in want]
    # ...and another epoch is another order: the comparison can fail.
    loader.set_epoch(epoch + 1)
    assert [as_bytes(b) for b in loader] != got


def test_persistent_workers_make_the_next_epoch_ahead_with_the_same_batches(image_root):
    # With persistent workers the next epoch's first batches are made while an epoch ends; the
    # batches of three epochs are those of a loader without persistent workers.
    ds = ferry.datasets.image_folder(str(image_root), size=16, random_crop=True, float=True)
    kept = ferry.DataLoader(ds, batch_size=2, shuffle=True, num_workers=2, seed=8, persistent_workers=True)
    fresh = ferry.DataLoader(ds, batch_size=2, shuffle=True, num_workers=2, seed=8)
    epochs = [[as_bytes(b) for b in kept] for _ in range(3)]
    assert epochs == [[as_bytes(b) for b in fresh] for _ in range(3)]
    assert epochs[0] != epochs[1]


def test_an_image_folder_names_its_classes_as_torchvision_does(image_root):
    ds = ferry.datasets.image_folder(str(image_root), size=16)
    assert ds.classes == sorted(os.listdir(image_root)) == ["a", "b", "c"]
    assert ds.class_to_idx == {"a": 0, "b": 1, "c": 2}
    labels = torch.cat([y for _, y in ferry.DataLoader(ds, batch_size=8)])
    assert [ds.classes[i] for i in labels.tolist()] == ["a"] * 8 + ["b"] * 8 + ["c"] * 8
    assert ferry.datasets.synthetic(n=4, shape=(2,)).classes == []


def test_image_batches_equal_the_cpp_loaders(image_root):
    ds = ferry.datasets.image_folder(str(image_root), size=16, random_crop=True, mean=[0.5, 0.4, 0.3], std=0.2)
    loader = ferry.DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, seed=4)
    got = [as_bytes(b) for b in loader]
    want = reference(ds, 0, batch_size=5, shuffle=True, num_workers=0, seed=4)
    assert got == [[bytes(f) for f in b] for b in want]
    images, labels = next(iter(loader))
    assert images.shape == (5, 3, 16, 16) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and set(labels.tolist()) <= {0, 1, 2}


def test_rows_are_the_arrays_rows(rows_npy):
    path, array = rows_npy
    loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=100, num_workers=2)
    for i, (rows,) in enumerate(loader):
        assert rows.dtype == torch.uint8 and rows.shape == (100, 3, 8, 8)
        assert np.array_equal(rows.numpy(), array[100 * i:100 * (i + 1)])
    shuffled = torch.cat([b[0] for b in ferry.DataLoader(ferry.datasets.npy(path), batch_size=100, shuffle=True)])
    assert not np.array_equal(shuffled.numpy(), array)
    assert sorted(map(bytes, shuffled.numpy())) == sorted(map(bytes, array))  # a permutation


def test_tar_stream(tar_dir):
    ds = ferry.datasets.tar(dir=str(tar_dir), size=16, shuffle=False)
    loader = ferry.DataLoader(ds, batch_size=4, num_workers=2)
    labels = torch.cat([y for _, y in loader])
    assert sorted(labels.tolist()) == sorted([r % 3 for r in range(6)] * 2)
    with pytest.raises(TypeError, match="stream"):
        len(loader)
    # decode="gpu" as a stream (index=False): the device decodes, so a loader without one is refused.
    gpu = ferry.datasets.tar(dir=str(tar_dir), size=16, decode="gpu", index=False)
    with pytest.raises(TypeError, match="stream"):
        len(gpu)
    with pytest.raises(ferry.Error, match="decodes its images on the GPU.*device= in Python"):
        ferry.DataLoader(gpu, batch_size=4)


@pytest.mark.parametrize("workers", [0, 2, 3, 8])
def test_tar_stream_fills_batches_across_workers(tar_dir, workers):
    # The stream deals its records to the workers in one order: 12 records in 2 shards make batches
    # of 5, 5 and 2 for any number of workers, and with the shard order kept they are the indexed
    # dataset's batches, normalized and randomly cropped alike (generators keyed by the position).
    kw = dict(size=16, random_crop=True, float=True, mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3])
    stream = list(ferry.DataLoader(ferry.datasets.tar(dir=str(tar_dir), shuffle=False, **kw), batch_size=5,
                                   num_workers=workers, seed=7))
    indexed = list(ferry.DataLoader(ferry.datasets.tar(dir=str(tar_dir), index=True, **kw), batch_size=5, seed=7))
    assert [len(y) for _, y in stream] == [5, 5, 2]
    assert stream[0][0].dtype == torch.float32 and stream[0][0].shape == indexed[0][0].shape
    for (x, y), (ix, iy) in zip(stream, indexed, strict=True):
        assert torch.equal(y, iy) and torch.equal(x, ix)
    dropped = list(ferry.DataLoader(ferry.datasets.tar(dir=str(tar_dir), **kw), batch_size=5, num_workers=workers,
                                    drop_last=True))
    assert [len(y) for _, y in dropped] == [5, 5]  # 2 of 12 unseen, not a remainder a worker


def test_paths_with_commas_equals_and_colons(tar_dir, tmp_path):
    # Option values travel as typed items, nothing escaped or split: a shard or folder name may hold
    # ",", "=", ":" and backslashes.
    odd = tmp_path / "run,a=b"
    odd.mkdir()
    shutil.copy(tar_dir / "shard-0.tar", odd / "2024-01-01T00:00:00,k=v\\x.tar")
    for ds in (ferry.datasets.tar(shards=[str(p) for p in odd.iterdir()], size=16),
               ferry.datasets.tar(dir=str(odd), size=16, index=True)):
        assert sum(len(y) for _, y in ferry.DataLoader(ds, batch_size=4)) == 6


def test_tar_indexed(tar_dir):
    # The same shards indexed: a map-style dataset, shuffled across shards by the loader.
    ds = ferry.datasets.tar(dir=str(tar_dir), size=16, index=True, float=True)
    loader = ferry.DataLoader(ds, batch_size=4, num_workers=2, shuffle=True, seed=3)
    assert len(ds) == 12 and len(loader) == 3
    batches = list(loader)
    assert batches[0][0].dtype == torch.float32 and batches[0][0].shape == (4, 3, 16, 16)
    assert sorted(torch.cat([y for _, y in batches]).tolist()) == sorted([r % 3 for r in range(6)] * 2)
    again = [y.tolist() for _, y in ferry.DataLoader(ds, batch_size=4, num_workers=0, shuffle=True, seed=3)]
    assert again == [y.tolist() for _, y in batches]  # the same order with any number of workers
    with pytest.raises(ferry.Error, match="decodes its images on the GPU.*device= in Python"):
        ferry.DataLoader(ferry.datasets.tar(dir=str(tar_dir), size=16, random_crop=True, decode="gpu"), batch_size=4)


def test_plugin_dataset():
    plugin = os.path.join(os.environ.get("FERRY_PLUGIN_DIR", ""), "libferry_ramp_plugin.so")
    if not os.path.exists(plugin):
        pytest.skip("the ramp plugin is not built (FERRY_PLUGIN_DIR)")
    assert "ramp" in ferry.load_plugin(plugin)
    loader = ferry.DataLoader(ferry.datasets.registry("ramp", n=100, dim=4), batch_size=10, num_workers=2)
    assert len(loader) == 10 and sum(1 for _ in loader) == 10


# --- zero copy, lifetime -------------------------------------------------------------------------

def test_tensors_share_ferrys_buffers(rows_npy):
    path, _ = rows_npy
    loader = ferry.DataLoader(ferry.datasets.synthetic(n=64, shape=(4, 4)), batch_size=16, num_workers=1)
    for samples, labels in loader:
        assert [samples.data_ptr(), labels.data_ptr()] == loader._loader.last_pointers()


def test_a_batch_outlives_its_loader(rows_npy):
    path, array = rows_npy
    loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=50, num_workers=2)
    it = iter(loader)
    kept = [next(it)[0] for _ in range(3)]
    del it, loader
    gc.collect()
    junk = [np.full((50, 3, 8, 8), 255 - i, np.uint8) for i in range(20)]  # reuse freed memory
    for i, rows in enumerate(kept):
        assert np.array_equal(rows.numpy(), array[50 * i:50 * (i + 1)])
    del junk


def test_a_loader_freed_mid_epoch_joins_its_threads(rows_npy):
    path, _ = rows_npy
    before = thread_count()
    loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=10, num_workers=4, prefetch_factor=4)
    it = iter(loader)
    next(it), next(it)
    assert thread_count() >= before + 4
    del it, loader
    gc.collect()
    deadline = time.monotonic() + 10
    while thread_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread_count() == before


def test_a_new_iteration_restarts_the_epoch(rows_npy):
    path, _ = rows_npy
    loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=100, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    assert loader.epoch == 1
    assert sum(1 for _ in loader) == 10  # the second iter() ends the first epoch and runs epoch 1
    assert loader.epoch == 2


# --- state, stats, options ------------------------------------------------------------------------

def test_state_dict_resumes_mid_epoch(rows_npy):
    path, _ = rows_npy
    ds = ferry.datasets.npy(path)
    full = [as_bytes(b) for b in ferry.DataLoader(ds, batch_size=64, shuffle=True, seed=5)]
    first = ferry.DataLoader(ds, batch_size=64, shuffle=True, seed=5, num_workers=2)
    it = iter(first)
    head = [as_bytes(next(it)) for _ in range(6)]
    state = first.state_dict()
    del it, first
    resumed = ferry.DataLoader(ds, batch_size=64, shuffle=True, seed=5, num_workers=3)
    resumed.load_state_dict(state)
    assert head + [as_bytes(b) for b in resumed] == full
    with pytest.raises(KeyError):
        resumed.load_state_dict({})
    other = ferry.DataLoader(ds, batch_size=32, shuffle=True, seed=5)
    with pytest.raises(ferry.Error, match="batch"):
        other.load_state_dict(state)


def test_len_stats_and_report(rows_npy, tmp_path):
    path, _ = rows_npy
    loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=300, drop_last=True, num_workers=2,
                              trace_batches=2)
    assert len(loader) == 3
    assert sum(1 for _ in loader) == 3
    stats = loader.stats()
    assert stats["batches"] == 3 and stats["workers"] == 2
    assert "bottleneck" in str(stats) and str(stats) == stats["report"]
    loader.write_trace(str(tmp_path / "trace.json"))
    assert b"traceEvents" in (tmp_path / "trace.json").read_bytes()
    with pytest.raises(ferry.Error, match="trace_batches"):
        ferry.DataLoader(ferry.datasets.npy(path)).write_trace(str(tmp_path / "none.json"))


def test_pytorch_arguments_ferry_does_not_take():
    ds = ferry.datasets.synthetic(n=10, shape=(2,))
    with pytest.raises(TypeError, match="collate_fn= is not for a ferry dataset: ferry collates in C\\+\\+"):
        ferry.DataLoader(ds, collate_fn=lambda b: b)
    with pytest.raises(TypeError, match="sampler= is not for a ferry dataset"):
        ferry.DataLoader(ds, sampler=[0, 1])
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        ferry.DataLoader(ds, batchsize=4)
    with pytest.raises(TypeError, match="must be a ferry dataset, a map-style dataset .* got int"):
        ferry.DataLoader(42)
    with pytest.raises(ferry.Error, match="on_error"):
        ferry.DataLoader(ds, on_error="ignore")
    with pytest.raises(ferry.Error, match=r"gpu_decode_threads must be >= 0 \(0: chosen from the hardware\), got -1"):
        ferry.DataLoader(ds, gpu_decode_threads=-1)
    with pytest.raises(ferry.Error, match="prefetch_factor"):
        ferry.DataLoader(ds, num_workers=1, prefetch_factor=0)
    with pytest.raises(ValueError, match="device"):
        ferry.DataLoader(ds, device="tpu")


# --- errors ---------------------------------------------------------------------------------------

def test_dataset_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ferry.Error, match="unknown dataset|no dataset|not registered"):
        ferry.datasets.registry("no_such_dataset")
    with pytest.raises(ferry.Error, match="bogus"):
        ferry.datasets.registry("synthetic", bogus=1)
    with pytest.raises(ferry.Error):
        ferry.datasets.idx(str(tmp_path / "missing-images"), str(tmp_path / "missing-labels"))
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00garbage")
    with pytest.raises(ferry.DataError) as e:
        ferry.datasets.npy(str(bad))
    assert e.value.file == str(bad)


def test_a_failing_sample_raises_at_its_batch_and_iteration_goes_on():
    ds = ferry.datasets.synthetic(n=40, shape=(2,), throw_rate=0.1, fault_seed=3)
    loader = ferry.DataLoader(ds, batch_size=4, num_workers=2)
    it = iter(loader)
    good, errors = 0, []
    while True:
        try:
            next(it)
            good += 1
        except StopIteration:
            break
        except ferry.Error as e:
            errors.append(e)
    assert errors and good + len(errors) == 10
    # A damaged sample is a DataError (not wrapped), naming the sample, worker and batch.
    assert all(isinstance(e, ferry.DataError) and isinstance(e, RuntimeError) for e in errors)
    assert all("is damaged" in str(e) and "of batch" in str(e) for e in errors)
    # skip: no batch lost, the bad samples dropped
    rows = sum(len(b[1]) for b in ferry.DataLoader(ds, batch_size=4, num_workers=2, on_error="skip"))
    assert 0 < rows < 40


def test_a_damaged_image_is_a_data_error_naming_the_file(image_root, tmp_path):
    root = tmp_path / "imgs"
    (root / "x").mkdir(parents=True)
    for i in range(6):
        (root / "x" / f"{i}.png").write_bytes((image_root / "a" / f"{i:02d}.png").read_bytes())
    (root / "x" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)  # damaged
    loader = ferry.DataLoader(ferry.datasets.image_folder(str(root), size=8), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    with pytest.raises(ferry.DataError) as e:
        next(it)
    assert e.value.file.endswith("3.png") and "3.png" in str(e.value)
    assert next(it)[0].shape == (2, 8, 8, 3)  # the next batch is intact (uint8: HWC, as decoded)
    replaced = ferry.DataLoader(ferry.datasets.image_folder(str(root), size=8), batch_size=2, on_error="replace",
                                max_error_fraction=0.5)
    assert sum(len(y) for _, y in replaced) == 6


def test_a_stuck_sample_is_a_timeout_error():
    ds = ferry.datasets.synthetic(n=8, shape=(2,), delay_rate=1.0, delay_ms=3000)
    loader = ferry.DataLoader(ds, batch_size=2, num_workers=1, timeout=0.2)
    with pytest.raises(ferry.TimeoutError, match="timed out"):
        next(iter(loader))


# --- Ctrl-C -------------------------------------------------------------------------------------

def _loop_script(workers: int, delay_ms: int, n: int) -> str:
    """A program that iterates a loader whose every sample takes delay_ms and prints the time of
    the KeyboardInterrupt it catches."""
    return f"""
        import sys, time, ferry
        ds = ferry.datasets.synthetic(n={n}, shape=(2,), delay_rate=1.0, delay_ms={delay_ms})
        loader = ferry.DataLoader(ds, batch_size=2, num_workers={workers})
        print("ready", flush=True)
        try:
            for batch in loader:
                pass
        except KeyboardInterrupt:
            print("interrupted %.3f" % time.monotonic(), flush=True)
            sys.exit(0)
        print("finished", flush=True)
    """


def test_keyboard_interrupt_ends_iteration_promptly():
    # The loop waits in ferry for a batch (every sample takes 200 ms).
    waited, _, out = _interrupt_after(_loop_script(2, 200, 1000), wait=0.5)
    # A bound, not a timing: the loop would run 100 s more; its latency is bench/ctrl_c_latency.py's.
    assert waited < 10.0, out


def _interrupt_after(script: str, wait: float = 0.7):
    """Runs `script` with -c (see conftest.interrupt_after)."""
    waited, exited, out, _ = interrupt_after([sys.executable, "-c", textwrap.dedent(script)], wait)
    return waited, exited, out


@pytest.mark.parametrize("workers", [0, 2])
def test_ctrl_c_during_a_30_second_sample_ends_the_loop_before_the_sample_ends(workers):
    # Every sample takes 30 s: the loop waits in ferry for a batch that is still being made. The
    # KeyboardInterrupt arrives within a poll period; the sample in the making is abandoned (it
    # holds nothing of the program's) instead of being waited for, and the program exits at once.
    # Bounds well under the sample's 30 s, which hold on a loaded machine; the latency itself is
    # bench/ctrl_c_latency.py's.
    waited, exited, out = _interrupt_after(_loop_script(workers, 30000, 100))
    assert waited < 10.0, out
    assert exited < 15.0, out


def _write_idx(path, array: np.ndarray) -> None:
    codes = {np.dtype(np.uint8): 0x08}
    with open(path, "wb") as f:
        f.write(bytes([0, 0, codes[array.dtype], array.ndim]))
        for d in array.shape:
            f.write(int(d).to_bytes(4, "big"))
        f.write(array.tobytes())


def test_idx_shapes_are_the_ones_its_help_names(tmp_path):
    images = np.arange(8 * 28 * 28, dtype=np.uint64).astype(np.uint8).reshape(8, 28, 28)
    _write_idx(tmp_path / "images", images)
    _write_idx(tmp_path / "labels", np.arange(8, dtype=np.uint8))
    doc = ferry.datasets.idx.__doc__
    raw = ferry.datasets.idx(str(tmp_path / "images"), str(tmp_path / "labels"))
    x, y = next(iter(ferry.DataLoader(raw, batch_size=4)))
    assert "[B, 28, 28]" in doc and tuple(x.shape) == (4, 28, 28) and x.dtype == torch.uint8
    assert np.array_equal(x.numpy(), images[:4])
    floats = ferry.datasets.idx(str(tmp_path / "images"), str(tmp_path / "labels"), float=True)
    x, _ = next(iter(ferry.DataLoader(floats, batch_size=4)))
    assert "[B, 1, 28, 28]" in doc and tuple(x.shape) == (4, 1, 28, 28) and x.dtype == torch.float32


def test_shuffle_with_a_stream_is_a_value_error(tar_dir):
    # PyTorch refuses shuffle=True for an IterableDataset; accepting and ignoring it hid the mistake.
    with pytest.raises(ValueError, match="shuffle=True is not for a stream"):
        ferry.DataLoader(ferry.datasets.tar(tar_dir), batch_size=2, shuffle=True)


def test_bad_batch_size_and_seed_are_one_line_value_errors():
    ds = ferry.datasets.synthetic(n=10, shape=(2,))
    for bad, says in ((None, "batch_size=None"), (0, "batch_size must be >= 1, got 0"), (-1, "batch_size=-1"),
                      (2.5, "batch_size=2.5 is not an int"), (True, "batch_size=True is not an int")):
        with pytest.raises(ValueError, match=re.escape(says)) as info:
            ferry.DataLoader(ds, batch_size=bad)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"batch_size=None \(samples without batching\) is for Python datasets"):
        ferry.DataLoader(ds, batch_size=None)
    with pytest.raises(ValueError, match="seed must be an int"):
        ferry.DataLoader(ds, seed=-1)


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i * i


def test_option_errors_are_the_librarys_and_value_errors():
    # One set of rules (ferry::detail::validate_options) for ferry's and Python datasets, raised as
    # ferry.OptionError, a ValueError as PyTorch raises, before any worker process is asked for.
    cases = [
        (dict(num_workers=-1), "num_workers must be >= 0, got -1"),
        (dict(num_workers=2, prefetch_factor=0), "prefetch_factor must be >= 1, got 0"),
        (dict(persistent_workers=True), "persistent_workers=true needs num_workers > 0"),
        (dict(timeout=-1), "timeout=-1 is not a number of seconds >= 0"),
        (dict(max_error_fraction=2.0), "max_error_fraction must be in [0, 1], got 2"),
        (dict(device=-1), "device=-1 is not a CUDA device index"),
        (dict(on_error="ignore"), "on_error must be raise, skip or replace, got 'ignore'"),
    ]
    before = set(os.listdir("/proc"))
    for ds in (ferry.datasets.synthetic(n=8, shape=(2,)), _Squares()):
        for kwargs, says in cases:
            with pytest.raises(ferry.OptionError, match=re.escape(says)) as info:
                ferry.DataLoader(ds, batch_size=2, **kwargs)
            assert isinstance(info.value, ValueError) and isinstance(info.value, ferry.Error)
    children = [p for p in set(os.listdir("/proc")) - before if p.isdigit()
                and os.path.exists(f"/proc/{p}/stat") and open(f"/proc/{p}/stat").read().split()[3] == str(os.getpid())]
    assert children == []  # no worker or zygote made for a loader refused


def test_the_seed_is_visible_and_fixed_by_default(rows_npy):
    path, _ = rows_npy
    ds = ferry.datasets.npy(path)
    a, b = ferry.DataLoader(ds, batch_size=64, shuffle=True), ferry.DataLoader(ds, batch_size=64, shuffle=True)
    assert a.seed == 0 and ferry.DataLoader(ds, seed=7).seed == 7
    assert [as_bytes(x) for x in a] == [as_bytes(x) for x in b]  # reproducible unless seeded otherwise
    assert "\nseed 0\n" in a.state_dict()["ferry_loader_state"]  # a checkpoint names its seed


def test_a_bool_npy_gives_torch_bool_batches(tmp_path):
    flags = (np.arange(40) % 3 == 0).reshape(10, 4)
    np.save(tmp_path / "flags.npy", flags)
    batches = list(ferry.DataLoader(ferry.datasets.npy(str(tmp_path / "flags.npy")), batch_size=5))
    assert batches[0][0].dtype == torch.bool
    assert np.array_equal(torch.cat([b[0] for b in batches]).numpy(), flags)


def test_a_device_without_cuda_in_torch_is_a_cuda_error():
    if torch.cuda.is_available():
        pytest.skip("torch has CUDA here")
    ds = ferry.datasets.synthetic(n=10, shape=(2,))
    for device in (0, "cuda", "cuda:1"):
        with pytest.raises(ferry.CudaError, match="needs CUDA, and this torch has none"):
            ferry.DataLoader(ds, device=device)
