"""The Python package over s3:// URLs, against a real S3-compatible server (conftest's
object_store): batches equal those of the same files read locally, and errors name the URL."""

import numpy as np
import pytest

import ferry


def _batches(dataset, **options):
    loader = ferry.DataLoader(dataset, **options)
    return [[np.asarray(t).copy() for t in batch] for batch in loader]


def _same(a, b):
    return len(a) == len(b) and all(all(np.array_equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))


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
    path, array = rows_npy
    npy = object_store(path, "rows.npy")
    rows = _batches(ferry.datasets.npy(npy), batch_size=100)
    assert np.array_equal(np.concatenate([b[0] for b in rows]), array)


def test_missing_objects_name_the_url(object_store):
    object_store.__call__  # the server and settings are up
    with pytest.raises(ferry.DataError, match=r"s3://ferry-py/nothing/here\.npy.*does not exist"):
        ferry.datasets.npy("s3://ferry-py/nothing/here.npy")
    with pytest.raises(ferry.DataError, match="holds no objects"):
        ferry.datasets.image_folder("s3://ferry-py/no-such-prefix/")
