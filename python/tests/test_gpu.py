"""ferry.DataLoader from Python on a GPU: batches on the device without a copy, ordered on torch's
current stream, intact under a slow consumer, and nothing left behind. Skipped without a GPU
(failed instead under FERRY_REQUIRE_GPU=1)."""

import gc
import os
import time

import numpy as np
import pytest
import torch

import ferry
from conftest import require_gpu, require_torchvision_io

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu():
    require_gpu()


@pytest.mark.parametrize("gather", ["host", "device"])
@pytest.mark.parametrize("workers", [0, 3])
def test_device_batches_equal_the_host_batches(rows_npy, gather, workers):
    path, array = rows_npy
    ds = ferry.datasets.npy(path)
    dev = ferry.DataLoader(ds, batch_size=64, shuffle=True, seed=2, num_workers=workers, device=0, gather=gather)
    host = ferry.DataLoader(ds, batch_size=64, shuffle=True, seed=2)
    n = 0
    for (d,), (h,) in zip(dev, host, strict=True):
        assert d.is_cuda and d.device.index == 0
        assert d.data_ptr() == dev._loader.last_pointers()[0]  # torch views ferry's device buffer
        assert torch.equal(d.cpu(), h)
        n += 1
    assert n == len(dev) == 16
    assert dev.stats()["device_gather"] == (gather == "device")


def test_pinned_batches_are_pinned(rows_npy):
    path, array = rows_npy
    loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=100, num_workers=2, pin_memory=True)
    for i, (rows,) in enumerate(loader):
        assert rows.is_pinned() and not rows.is_cuda
        assert rows.data_ptr() == loader._loader.last_pointers()[0]
        assert np.array_equal(rows.numpy(), array[100 * i:100 * (i + 1)])


def test_ten_thousand_batches_intact_behind_a_slow_consumer_stream():
    # Sample i is 256 bytes of i % 251 and label i % 10: each batch's sums are known. The consumer
    # stream sleeps before reading every batch, so the loader's copies run far ahead of it; a
    # buffer reused too early would change a later batch's sums.
    n, b, batches = 10_000 * 16, 16, 10_000
    ds = ferry.datasets.synthetic(n=n, shape=(256,))
    stream = torch.cuda.Stream(0)
    with torch.cuda.stream(stream):
        loader = ferry.DataLoader(ds, batch_size=b, num_workers=4, device=0, prefetch_factor=4)
        sums = torch.zeros(batches, dtype=torch.int64, device="cuda")
        labels = torch.zeros(batches, dtype=torch.int64, device="cuda")
        for k, (x, y) in enumerate(loader):
            if k % 16 == 0:
                torch.cuda._sleep(200_000)  # ~0.1 ms: the consumer falls behind the copies
            sums[k] = x.to(torch.int64).sum()
            labels[k] = y.sum()
        stream.synchronize()
    idx = np.arange(n).reshape(batches, b)
    assert np.array_equal(sums.cpu().numpy(), (idx % 251).sum(axis=1) * 256)
    assert np.array_equal(labels.cpu().numpy(), (idx % 10).sum(axis=1))


def test_a_loader_freed_mid_epoch_returns_its_threads_pinned_blocks_and_device_memory(rows_npy):
    path, _ = rows_npy
    torch.cuda.synchronize()
    threads = len(os.listdir("/proc/self/task"))
    free_before = torch.cuda.mem_get_info(0)[0]
    assert ferry._ferry.pinned_bytes() == 0
    loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=100, num_workers=4, device=0, gather="host")
    it = iter(loader)
    kept = next(it)[0]
    next(it)
    assert ferry._ferry.pinned_bytes() > 0
    del it, loader
    gc.collect()
    assert kept.sum().item() >= 0  # a batch still held stays readable
    del kept
    gc.collect()
    torch.cuda.synchronize()
    assert ferry._ferry.pinned_bytes() == 0  # every pinned block freed
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/task")) > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/task")) == threads
    assert torch.cuda.mem_get_info(0)[0] >= free_before - (8 << 20)  # device buffers freed (8 MiB of slack)


def test_gpu_decode_from_python(tmp_path):
    tv = require_torchvision_io()
    rng = np.random.default_rng(3)
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(20):
            y, x = np.mgrid[0:120, 0:160]
            img = np.stack([(x * (k + 1) + y * (2 - k) + rng.integers(0, 50)) % 256 for k in range(3)]).astype(np.uint8)
            (tmp_path / c / f"{i}.jpg").write_bytes(tv.encode_jpeg(torch.from_numpy(img), quality=90).numpy().tobytes())
    kw = dict(size=64, random_crop=True, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])
    gpu = ferry.DataLoader(ferry.datasets.image_folder(str(tmp_path), decode="gpu", **kw), batch_size=8, shuffle=True,
                           seed=9, num_workers=2, device=0, gpu_decode_threads=1)
    cpu = ferry.DataLoader(ferry.datasets.image_folder(str(tmp_path), **kw), batch_size=8, shuffle=True, seed=9)
    n = 0
    for (gi, gl), (ci, cl) in zip(gpu, cpu, strict=True):
        assert gi.is_cuda and gi.shape == (8, 3, 64, 64)
        assert torch.equal(gl.cpu(), cl)
        # the same crops and flips; pixels within the decoders' rounding (the C++ suite's tolerance)
        assert (gi.cpu() - ci).abs().mean().item() < 0.05
        n += 1
    assert n == 5
    assert gpu.stats()["images_decoded"] == 40
    assert gpu.stats()["decode_threads"] == 1


class _Records:
    """A Python dataset of dicts: an image-like uint8 tensor, a float vector and a label."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"image": torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g),
                "vec": torch.randn(5, generator=g), "label": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_python_dataset_on_the_device_and_pinned(workers):
    ds = _Records()
    host = list(torch.utils.data.DataLoader(ds, batch_size=8))
    pinned_loader = ferry.DataLoader(ds, batch_size=8, num_workers=workers, pin_memory=True)
    dev_loader = ferry.DataLoader(ds, batch_size=8, num_workers=workers, device=0)
    pinned, dev = list(pinned_loader), list(dev_loader)
    assert len(host) == len(pinned) == len(dev) == 5
    if workers:  # worker processes' batches: in slabs, through ferry's pin thread and device stage
        assert pinned_loader.stats()["slab_batches"] == 5 and dev_loader.stats()["device"]
    for h, p, d in zip(host, pinned, dev, strict=True):
        assert all(p[k].is_pinned() for k in h)
        assert all(d[k].is_cuda and d[k].device.index == 0 for k in h)
        for k in h:
            assert torch.equal(p[k], h[k]) and torch.equal(d[k].cpu(), h[k])


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_threads_batches_go_through_the_pin_thread_and_the_device_stage(workers):
    # Note [Thread batches through the pipeline]: ferry's pin thread copies them into its pool's
    # blocks and its device stage makes the device copy, where torch pinned them on the worker.
    ds = _Records()
    host = list(torch.utils.data.DataLoader(ds, batch_size=8))
    pinned_loader = ferry.DataLoader(ds, batch_size=8, num_workers=workers, worker_type="thread", pin_memory=True)
    dev_loader = ferry.DataLoader(ds, batch_size=8, num_workers=workers, worker_type="thread", device=0)
    pinned, dev = list(pinned_loader), list(dev_loader)
    assert len(host) == len(pinned) == len(dev) == 5
    assert pinned_loader.stats()["pinning"] and pinned_loader.stats()["pin_seconds"] > 0
    assert dev_loader.stats()["device"] and dev_loader.stats()["copy_seconds"] > 0
    for h, p, d in zip(host, pinned, dev, strict=True):
        assert all(p[k].is_pinned() for k in h)
        assert all(d[k].is_cuda and d[k].device.index == 0 for k in h)
        for k in h:
            assert torch.equal(p[k], h[k]) and torch.equal(d[k].cpu(), h[k])


class _Rows:
    """Batch k of 4 rows of 64 KiB, every byte k % 251: a batch written over early shows."""

    def __len__(self):
        return 4 * 60

    def __getitem__(self, i):
        return torch.full((1 << 16,), (i // 4) % 251, dtype=torch.uint8)


def _in_a_slab(loader, tensor):
    return loader._pool.slabs.blocks.holds(tensor.data_ptr())


def test_worker_processes_write_into_registered_slabs_that_are_the_pinned_batches():
    loader = ferry.DataLoader(_Rows(), batch_size=4, num_workers=2, pin_memory=True)
    for k, rows in enumerate(loader):
        assert rows.is_pinned() and torch.equal(rows, torch.full_like(rows, k % 251))
        assert _in_a_slab(loader, rows)  # no copy into torch's pinned memory, the first batches' included
        del rows
    stats = loader.stats()
    assert stats["slab_misses"] == 0 and stats["slab_batches"] == 60


def _rows_and_a_parameter(samples):
    """default_collate, and a tensor that requires grad: no slab takes it."""
    return {"rows": torch.utils.data.default_collate(samples), "grad": torch.ones(3, requires_grad=True)}


def test_a_batch_with_a_tensor_no_slab_takes_travels_as_torchs_and_is_pinned_whole():
    loader = ferry.DataLoader(_Rows(), batch_size=4, num_workers=2, pin_memory=True, collate_fn=_rows_and_a_parameter)
    for k, batch in enumerate(loader):
        assert not _in_a_slab(loader, batch["rows"]) and batch["rows"].is_pinned()
        assert torch.equal(batch["rows"], torch.full_like(batch["rows"], k % 251))
        assert batch["grad"].is_pinned() and torch.equal(batch["grad"], torch.ones(3))
        if k == 5:
            break
    assert loader.stats()["slab_batches"] == 0


@pytest.mark.parametrize("kind", [(2, "process"), (0, "thread"), (2, "thread")], ids=lambda k: f"{k[0]}-{k[1]}")
def test_pinned_blocks_are_not_written_again_before_their_device_copy_ran(kind):
    # The consumer's stream sleeps before each batch's copy, so the copies lag far behind the
    # workers; a block (a process's slab, or the block the pin thread copied a worker thread's
    # batch into) handed back when its batch was queued (not copied) would be overwritten.
    stream = torch.cuda.Stream(0)
    with torch.cuda.stream(stream):
        loader = ferry.DataLoader(_Rows(), batch_size=4, num_workers=kind[0], worker_type=kind[1], device=0)
        firsts = []
        for rows in loader:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the next copy
            firsts.append(rows[:, :8].clone())
        torch.cuda.synchronize()
    for k, rows in enumerate(firsts):
        assert torch.equal(rows.cpu(), torch.full((4, 8), k % 251, dtype=torch.uint8)), k
    stats = loader.stats()
    # the device stage copied them (its event fencing each block), not torch
    assert stats["device"] and stats["copy_seconds"] > 0
    if kind[1] == "process":
        assert stats["slab_batches"] == 60


def test_python_batches_through_the_device_stage_equal_the_host_path_and_reuse_their_slabs():
    ds = _Records()
    host = list(torch.utils.data.DataLoader(ds, batch_size=8))
    loader = ferry.DataLoader(ds, batch_size=8, num_workers=2, device=0, persistent_workers=True)
    for epoch in range(3):
        for h, d in zip(host, loader, strict=True):
            assert all(d[k].is_cuda for k in ("image", "vec", "label"))
            for k in h:
                assert torch.equal(d[k].cpu(), h[k]), (epoch, k)
    stats, blocks = loader.stats(), loader._pool.slabs.blocks.stats()
    # (persistent workers make the next epoch's first batches ahead: a window of 2 x 2 at most)
    assert stats["device"] and 15 <= stats["slab_batches"] <= 15 + 2 * 2 and stats["slab_misses"] == 0
    # made in the first epoch, leased again behind their copies' events after
    assert blocks["made"] <= 2 * 2 + 4 and blocks["leases"] >= 15


class _Nested(torch.utils.data.Dataset):
    """Samples as real datasets return them: dicts of numpy arrays, numbers, strings and nested
    dicts and lists (module level: worker processes import it)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"id": i, "img": np.full((3, 4, 4), i, dtype=np.uint8),
                "meta": {"score": float(i) / 2, "tags": ["a", f"t{i}"], "inner": {"deep": np.arange(5, dtype=np.int16) + i}},
                "vec": np.arange(3, dtype=np.int32) * i, "pair": (torch.tensor([i, -i]), [np.float32(i)])}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


@pytest.mark.parametrize("workers,kind", [(0, "thread"), (2, "thread"), (2, "process")])
def test_pin_memory_pins_every_tensor_of_a_nested_sample(workers, kind):
    # torch pins every tensor of any structure default_collate makes; an unpinned one would make
    # every non_blocking copy of it synchronous without a word.
    ours = list(ferry.DataLoader(_Nested(), batch_size=4, num_workers=workers, worker_type=kind, pin_memory=True))
    theirs = list(torch.utils.data.DataLoader(_Nested(), batch_size=4, pin_memory=True))
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs, strict=True):
        ta, tb = _tensors(a), _tensors(b)
        assert len(ta) == len(tb) == 7
        assert [t.is_pinned() for t in ta] == [True] * 7, [(t.dtype, tuple(t.shape)) for t in ta if not t.is_pinned()]
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
        assert a["meta"]["tags"] == b["meta"]["tags"]
