"""The Python package over s3:// URLs, against a real S3-compatible server (conftest's
object_store): batches equal those of the same files read locally, and errors name the URL."""

import numpy as np
import pytest

import ferry


def _batches(dataset, **options):
    loader = ferry.DataLoader(dataset, **options)
    return [[np.asarray(t).copy() for t in batch] for batch in loader]


def _same(a, b):
    return len(a) == len(b) and all(all(np.array_equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_image_folder_over_s3_equals_local(object_store, image_root, workers):
    url = object_store(image_root, "images/")
    options = dict(batch_size=5, shuffle=True, seed=4, num_workers=workers)
    remote = _batches(ferry.datasets.image_folder(url, size=16), **options)
    local = _batches(ferry.datasets.image_folder(str(image_root), size=16), **options)
    assert len(remote) == 5 and _same(remote, local)
    assert ferry.object_store_stats()["requests"] > 0


def test_tar_shards_and_npy_over_s3_equal_local(object_store, tar_dir, rows_npy):
    url = object_store(tar_dir, "shards/")
    remote = _batches(ferry.datasets.tar(shards=[url + "shard-{0..1}.tar"], size=16, index=True), batch_size=4, shuffle=True, seed=1)
    local = _batches(ferry.datasets.tar(dir=str(tar_dir), size=16, index=True), batch_size=4, shuffle=True, seed=1)
    assert len(remote) == 3 and _same(remote, local)
    streamed = _batches(ferry.datasets.tar(dir=url, size=16, shuffle=False), batch_size=6)
    assert sum(len(b[1]) for b in streamed) == 12
    # A key with a timestamp (its ':' an item's own on the way to the registry, not a list separator).
    stamped = object_store(tar_dir / "shard-0.tar", "stamped/shard-2024-01-01T00:00:00.tar")
    assert sum(len(b[1]) for b in _batches(ferry.datasets.tar(shards=[stamped], size=16), batch_size=4)) == 6
    # The stream's batches filled across the workers: the local stream's, for any number of them.
    local_stream = _batches(ferry.datasets.tar(dir=str(tar_dir), size=16, shuffle=False), batch_size=5)
    for workers in (0, 3, 8):
        streamed = _batches(ferry.datasets.tar(dir=url, size=16, shuffle=False), batch_size=5, num_workers=workers)
        assert [len(b[1]) for b in streamed] == [5, 5, 2] and _same(streamed, local_stream)
    path, array = rows_npy
    npy = object_store(path, "rows.npy")
    rows = _batches(ferry.datasets.npy(npy), batch_size=100)
    assert np.array_equal(np.concatenate([b[0] for b in rows]), array)


def test_missing_objects_name_the_url(object_store):
    assert callable(object_store)  # the server and settings are up
    with pytest.raises(ferry.DataError, match=r"s3://ferry-py/nothing/here\.npy.*does not exist"):
        ferry.datasets.npy("s3://ferry-py/nothing/here.npy")
    with pytest.raises(ferry.DataError, match="holds no objects"):
        ferry.datasets.image_folder("s3://ferry-py/no-such-prefix/")


@pytest.mark.gpu
def test_gpu_decode_over_s3_equals_local(object_store, tmp_path):
    """decode="gpu" over s3://: an image folder, indexed tar shards and the tar stream give the
    batches the same files give locally, bit for bit (the same JPEG bytes reach the same nvJPEG
    decode)."""
    from conftest import require_gpu, require_torchvision_io
    require_gpu()
    import io
    import tarfile

    import torch
    tv = require_torchvision_io()
    rng = np.random.default_rng(5)
    folder, shards = tmp_path / "folder", tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "train-0.tar", "w") as tar:
        for c in range(2):
            (folder / f"c{c}").mkdir(parents=True)
            for i in range(12):
                y, x = np.mgrid[0:90, 0:130]
                img = np.stack([(x * (k + 1) + y * (2 - k) + rng.integers(0, 60)) % 256 for k in range(3)]).astype(np.uint8)
                jpeg = tv.encode_jpeg(torch.from_numpy(img), quality=90).numpy().tobytes()
                (folder / f"c{c}" / f"{i}.jpg").write_bytes(jpeg)
                for ext, data in (("jpg", jpeg), ("cls", str(c).encode())):
                    info = tarfile.TarInfo(f"c{c}-{i:02d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    kw = dict(size=48, random_crop=True, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25], decode="gpu")
    options = dict(batch_size=6, shuffle=True, seed=3, num_workers=2, device=0)

    def batches(dataset):
        return [[t.cpu() for t in batch] for batch in ferry.DataLoader(dataset, **options)]

    folder_url = object_store(folder, "gpu-folder/")
    shard_url = object_store(shards / "train-0.tar", "gpu-shards/train-0.tar")
    for remote, local in ((ferry.datasets.image_folder(folder_url, **kw), ferry.datasets.image_folder(str(folder), **kw)),
                          (ferry.datasets.tar(shards=[shard_url], index=True, **kw),
                           ferry.datasets.tar(shards=[str(shards / "train-0.tar")], index=True, **kw))):
        got, want = batches(remote), batches(local)
        assert len(got) == 4 and got[0][0].shape == (6, 3, 48, 48)
        assert all(torch.equal(g, w) for b, c in zip(got, want, strict=True) for g, w in zip(b, c, strict=True))
    # The stream (index=False): each 8 MiB of the shard one request, every JPEG decoded on the device.
    options = dict(batch_size=6, num_workers=2, device=0)
    stream = dict(size=48, random_crop=True, decode="gpu", index=False, shuffle=False)
    requests = ferry.object_store_stats()["requests"]
    got = batches(ferry.datasets.tar(shards=[shard_url], **stream))
    assert ferry.object_store_stats()["requests"] - requests <= 2
    want = batches(ferry.datasets.tar(shards=[str(shards / "train-0.tar")], **stream))
    assert len(got) == 4 and got[0][0].shape == (6, 48, 48, 3) and got[0][0].dtype == torch.uint8  # HWC, as the CPU stream
    assert all(torch.equal(g, w) for b, c in zip(got, want, strict=True) for g, w in zip(b, c, strict=True))


def test_a_silent_server_and_a_dataset_built_with_a_timeout(monkeypatch):
    # A loopback socket that listens and never answers: without a deadline a dataset's first read
    # would wait out every attempt's stall limit; with timeout= it is a ferry.TimeoutError naming
    # the URL, as a loader's timeout is.
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ferry-test-key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ferry-test-secret")
        monkeypatch.setenv("FERRY_S3_STALL_SECONDS", "600")
        for make in (lambda: ferry.datasets.npy("s3://silent/x.npy", timeout=0.3),
                     lambda: ferry.datasets.image_folder("s3://silent/train/", timeout=0.3),
                     lambda: ferry.datasets.tokens("s3://silent/t.bin", dtype="uint16", timeout=0.3)):
            with pytest.raises(ferry.TimeoutError, match=r"s3://silent/.*read deadline of 300 ms") as info:
                make()
            assert "ferry-test-secret" not in str(info.value)
        for bad in (0, -1, "1", True):
            with pytest.raises(ValueError, match="is not a number of seconds > 0"):
                ferry.datasets.npy("s3://silent/x.npy", timeout=bad)
    finally:
        silent.close()
