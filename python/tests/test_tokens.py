"""Language-model data from Python: ferry.datasets.tokens / megatron / mixture as dict batches of
torch tensors, every window once an epoch, the same batches for any worker count, a mixture
resumed exactly from state_dict() (and with new weights from that index on), s3:// equal to local,
and damaged files as ferry.DataError naming the file."""

import json
import os

import numpy as np
import pytest
import torch

import ferry

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "megatron")


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    tokens = (np.arange(16 * 40 + 5, dtype=np.int64) * 7 + 3) % 65521
    path = tmp_path_factory.mktemp("tokens") / "train.bin"
    tokens.astype(np.uint16).tofile(path)
    return str(path), tokens


def epoch(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_windows_as_dicts_every_token_once(token_file, workers):
    path, tokens = token_file
    ds = ferry.datasets.tokens(path, seq_len=16, dtype="uint16")
    assert len(ds) == 40 and ds.fields == ["input_ids", "labels"]
    batches = epoch(ferry.DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers, seed=3))
    assert len(batches) == 5
    starts = []
    for b in batches:
        assert set(b) == {"input_ids", "labels"}
        assert b["input_ids"].dtype == torch.int64 and b["input_ids"].shape == (8, 16)
        for row, lab in zip(b["input_ids"].numpy(), b["labels"].numpy(), strict=True):
            at = int(np.nonzero(tokens == row[0])[0][0])
            assert at % 16 == 0
            assert np.array_equal(row, tokens[at:at + 16]) and np.array_equal(lab, tokens[at + 1:at + 17])
            starts.append(at)
    assert sorted(starts) == list(range(0, 640, 16))
    ref = epoch(ferry.DataLoader(ds, batch_size=8, shuffle=True, num_workers=0, seed=3))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, ref, strict=True))


def test_megatron_fixture_packed(tmp_path):
    meta = json.load(open(os.path.join(FIXTURES, "u16.json")))
    ds = ferry.datasets.megatron(os.path.join(FIXTURES, "u16"), seq_len=32, packed=True, out_dtype="int32")
    assert ds.fields == ["input_ids", "labels", "position_ids", "cu_seqlens"]
    assert len(ds) == (sum(meta["lengths"]) - 1) // 32
    b = next(iter(ferry.DataLoader(ds, batch_size=4)))
    assert b["input_ids"].dtype == torch.int32 and b["cu_seqlens"].shape == (4, 33)
    # The corpus by the fixture's rule (meta["token"]); window w covers tokens [32 w, 32 w + 33).
    corpus = [(d * 7919 + t * 31) % meta["vocab"] for d, n in enumerate(meta["lengths"]) for t in range(n)]
    starts = np.cumsum(meta["lengths"])[:-1].tolist()
    tok = b["input_ids"][0].tolist()
    assert tok == corpus[:32] and b["labels"][0].tolist() == corpus[1:33]
    assert b["position_ids"][0].tolist() == list(range(32))  # the first document is longer than the window
    # A window a document starts inside: positions restart there, cu_seqlens names it, labels run on
    # across the documents' boundary to the next document's first token.
    w = next(s // 32 for s in starts if s % 32 != 0)
    cut = starts[[s // 32 for s in starts].index(w)] - 32 * w
    rows = epoch(ferry.DataLoader(ds, batch_size=4))[w // 4]
    got = {k: v[w % 4].tolist() for k, v in rows.items()}
    assert got["input_ids"] == corpus[32 * w:32 * w + 32] and got["labels"] == corpus[32 * w + 1:32 * w + 33]
    inside = [s - 32 * w for s in starts if 32 * w < s < 32 * w + 32]
    assert inside[0] == cut
    bounds = [0] + inside + [32]
    assert got["position_ids"] == [k for a, z in zip(bounds, bounds[1:], strict=False) for k in range(z - a)]
    assert got["cu_seqlens"] == [0] + inside + [32] * (33 - 1 - len(inside))
    shuffled = ferry.datasets.megatron(os.path.join(FIXTURES, "u16"), seq_len=32, packed=True, shuffle_documents=True,
                                       document_block=16)
    assert len(shuffled) == len(ds)
    first = [epoch(ferry.DataLoader(shuffled, batch_size=4, seed=s))[0]["input_ids"] for s in (1, 1, 2)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])


def test_megatron_best_fit_packing_keeps_the_windows_tokens():
    # Note [Best-fit packing]: in the corpus order, an epoch's inputs are the windows' tokens, placed
    # differently; every sequence is full and its positions restart where cu_seqlens say.
    prefix = os.path.join(FIXTURES, "u16")
    fit = ferry.datasets.megatron(prefix, seq_len=32, packed=True, best_fit_group=4)
    windows = ferry.datasets.megatron(prefix, seq_len=32, packed=True)
    assert len(fit) == len(windows)
    a = epoch(ferry.DataLoader(fit, batch_size=4, num_workers=2))
    b = epoch(ferry.DataLoader(windows, batch_size=4))
    ids = lambda e: sorted(torch.cat([x["input_ids"].flatten() for x in e]).tolist())  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != []
    for x in a:
        for pos, cu in zip(x["position_ids"].tolist(), x["cu_seqlens"].tolist(), strict=True):
            starts = [k for k, p in enumerate(pos) if p == 0]
            assert cu == starts + [32] * (33 - len(starts))
    with pytest.raises(ferry.Error, match="packed"):
        ferry.datasets.megatron(prefix, seq_len=32, best_fit_group=4)


def test_mixture_resumes_from_state_dict_and_takes_new_weights(token_file):
    path, _ = token_file
    a = ferry.datasets.tokens(path, seq_len=16, dtype="uint16")
    b = ferry.datasets.megatron(os.path.join(FIXTURES, "u16"), seq_len=16)
    mix = ferry.datasets.mixture([(a, 0.75), (b, 0.25)], seed=9, block=8, size=96)
    assert len(mix) == 96 and mix.fields == ["input_ids", "labels"]
    whole = epoch(ferry.DataLoader(mix, batch_size=8, num_workers=2, seed=1))
    loader = ferry.DataLoader(mix, batch_size=8, num_workers=1, seed=1)
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    state = loader.state_dict()
    del it
    resumed = ferry.DataLoader(mix, batch_size=8, num_workers=3, seed=1)
    resumed.load_state_dict(state)
    rest = epoch(resumed)
    got = [x["input_ids"] for x in first] + [x["input_ids"] for x in rest]
    assert len(got) == len(whole) == 12
    assert all(torch.equal(x, y["input_ids"]) for x, y in zip(got, whole, strict=True))
    # New weights from sample 40 on (only b's windows): samples 0-39 unchanged, every one from 40 on
    # one of b's; sample 40 came from a under the old weights, so a start 1 or 8 samples late fails.
    changed = ferry.datasets.mixture([(a, 0.75), (b, 0.25)], seed=9, block=8, size=96, schedule=[(40, [0.0, 1.0])])
    other = epoch(ferry.DataLoader(changed, batch_size=8, seed=1))
    rows = lambda e: [tuple(r) for x in e for r in x["input_ids"].tolist()]  # noqa: E731
    b_windows = set(rows(epoch(ferry.DataLoader(b, batch_size=8))))
    old, new = rows(whole), rows(other)
    assert new[:40] == old[:40]
    assert old[40] not in b_windows and all(r in b_windows for r in new[40:])
    with pytest.raises(ValueError, match="fields differ"):
        ferry.datasets.mixture([(a, 1), (ferry.datasets.megatron(os.path.join(FIXTURES, "u16"), seq_len=16, packed=True), 1)])


def test_damaged_token_files_are_data_errors(tmp_path):
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ferry.DataError, match="odd.bin: at byte 2"):
        ferry.datasets.tokens(str(bad), seq_len=4, dtype="uint16")
    with pytest.raises(ferry.Error, match="needs its token type"):
        ferry.datasets.tokens(str(bad), seq_len=4)
    with pytest.raises(ferry.DataError, match="nothing.idx"):
        ferry.datasets.megatron(str(tmp_path / "nothing"))


def test_tokens_and_megatron_over_s3_equal_local(object_store, token_file):
    path, _ = token_file
    url = object_store(path, "tokens/train.bin")
    idx = object_store(os.path.join(FIXTURES, "u16.idx"), "mega/u16.idx")
    object_store(os.path.join(FIXTURES, "u16.bin"), "mega/u16.bin")
    for remote, local in ((ferry.datasets.tokens(url, seq_len=16, dtype="uint16"), ferry.datasets.tokens(path, seq_len=16, dtype="uint16")),
                          (ferry.datasets.megatron(idx[:-4], seq_len=16, packed=True),
                           ferry.datasets.megatron(os.path.join(FIXTURES, "u16"), seq_len=16, packed=True))):
        r = epoch(ferry.DataLoader(remote, batch_size=8, shuffle=True, num_workers=2, seed=5))
        loc = epoch(ferry.DataLoader(local, batch_size=8, shuffle=True, num_workers=2, seed=5))
        assert len(r) == len(loc) > 0
        assert all(torch.equal(x[k], y[k]) for x, y in zip(r, loc, strict=True) for k in x)


@pytest.mark.gpu
@pytest.mark.parametrize("workers", [0, 3])
def test_device_batches_equal_the_host_batches(token_file, workers):
    from conftest import require_gpu

    require_gpu()
    path, _ = token_file
    ds = ferry.datasets.megatron(os.path.join(FIXTURES, "u16"), seq_len=32, packed=True)
    host = epoch(ferry.DataLoader(ds, batch_size=8, shuffle=True, seed=4))
    for gather in ("auto", "device"):
        dev = [{k: v.cpu() for k, v in b.items()} for b in ferry.DataLoader(ds, batch_size=8, shuffle=True, seed=4, device=0,
                                                                             num_workers=workers, gather=gather)]
        assert len(dev) == len(host) > 0
        assert all(set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in y) for x, y in zip(dev, host, strict=True))
    on_gpu = next(iter(ferry.DataLoader(ferry.datasets.tokens(path, seq_len=16, dtype="uint16"), batch_size=4, device=0)))
    assert on_gpu["input_ids"].is_cuda and on_gpu["labels"].device == on_gpu["input_ids"].device


def _global_batches(ds, world, steps, state=None, per_global=8, workers=0):
    """The global batches (each row's first input token, in the group's order) of `world` ranks
    simulated in one process, each running `steps` batches (all when None) from `state`; and rank
    0's state after."""
    per_rank = per_global // world
    ranks, out_state = [], None
    for r in range(world):
        loader = ferry.DataLoader(ds, batch_size=per_rank, shuffle=True, seed=5, num_workers=workers,
                                  num_replicas=world, rank=r)
        if state is not None:
            loader.load_state_dict(state)
        got = []
        for i, b in enumerate(loader):
            got.append(b["input_ids"][:, 0].tolist())
            if steps is not None and i + 1 == steps:
                break
        ranks.append(got)
        if r == 0:
            out_state = loader.state_dict()
    # position in the group's order: step * G + k * world + rank
    return [[ranks[r][b][k] for k in range(per_rank) for r in range(world)] for b in range(len(ranks[0]))], out_state


def test_mixture_resumed_at_world_sizes_4_2_1_gives_the_uninterrupted_global_batches(token_file):
    path, _ = token_file
    mix = ferry.datasets.mixture([(ferry.datasets.tokens(path, seq_len=16, dtype="uint16"), 0.6),
                                  (ferry.datasets.megatron(os.path.join(FIXTURES, "u16"), seq_len=16), 0.4)],
                                 seed=2, block=16, size=96)
    whole, _ = _global_batches(mix, 4, None)
    assert len(whole) == 12
    got, state = _global_batches(mix, 4, 3, workers=2)
    more, state = _global_batches(mix, 2, 4, state)
    rest, _ = _global_batches(mix, 1, None, state, workers=3)
    assert got + more + rest == whole
    with pytest.raises(TypeError, match="for ferry datasets"):
        ferry.DataLoader([1, 2, 3], num_replicas=2, rank=0)
    with pytest.raises(ferry.Error, match="rank"):
        ferry.DataLoader(mix, batch_size=4, num_replicas=2, rank=2)


def test_torchrun_two_ranks_checkpoint_and_resume_on_one_and_on_two(token_file, tmp_path):
    # Two processes under torchrun run 3 steps and save rank 0's state; the epoch is then finished
    # by one process, and again by two: every global batch equals the uninterrupted run's.
    import subprocess
    import sys

    path, _ = token_file
    script = os.path.join(os.path.dirname(__file__), "dist_tokens.py")
    env = dict(os.environ, FERRY_TEST_TOKENS=path)

    def run(nproc, phase, steps):
        # torchrun itself where FERRY_TORCHRUN=1 (Debian's torch 1.13 torchrun fails on Python 3.11),
        # else a process per rank with the variables torchrun sets.
        args = [script, str(tmp_path), phase, str(steps)]
        if os.environ.get("FERRY_TORCHRUN") == "1":
            procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       f"--nproc_per_node={nproc}", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
        else:
            procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(env, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                                               LOCAL_WORLD_SIZE=str(nproc)))
                     for r in range(nproc)]
        try:
            for p in procs:
                out, err = p.communicate(timeout=240)
                assert p.returncode == 0, out[-2000:] + err[-3000:]
        finally:  # a failed or stuck rank leaves no process behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    run(2, "first", 3)
    run(1, "rest1", 0)
    run(2, "rest2", 0)

    def read(phase, world):
        ranks = [json.load(open(tmp_path / f"{phase}-{r}.json")) for r in range(world)]
        per = len(ranks[0][0]) if ranks[0] else 0
        return [[ranks[r][b][k] for k in range(per) for r in range(world)] for b in range(len(ranks[0]))]

    whole, _ = _global_batches(ferry.datasets.tokens(path, seq_len=16, dtype="uint16"), 2, None, per_global=8)
    first = read("first", 2)
    assert len(first) == 3
    assert first + read("rest1", 1) == whole
    assert first + read("rest2", 2) == whole
    if os.environ.get("FERRY_REQUIRE_GPUS") == "2":  # each rank of two on its own GPU
        assert [open(tmp_path / f"first-{r}.device").read() for r in (0, 1)] == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("packed", [False, True])
def test_raw_windows_widened_as_the_device_path_does_equal_the_host_batches(packed):
    # With device=, a token dataset's windows cross as stored and are widened on the GPU
    # (DataLoader._widened); here the same widening on the CPU against the host path's batches.
    import types

    prefix = os.path.join(FIXTURES, "u16")
    ds = ferry.datasets.megatron(prefix, seq_len=32, packed=packed)
    raw = ferry._ferry.make_dataset("megatron", ds.config + ",raw=1")
    assert raw.fields[0] == "tokens" and raw.token_type == "uint16"
    host = epoch(ferry.DataLoader(ds, batch_size=8, shuffle=True, seed=3))
    fake = types.SimpleNamespace(_widen=(raw.token_type, "int64"))
    widened = list(ferry.DataLoader._widened(fake, iter(ferry.DataLoader(raw, batch_size=8, shuffle=True, seed=3))))
    assert len(widened) == len(host) > 0
    for w, h in zip(widened, host, strict=True):
        assert set(w) == set(h)
        assert all(w[k].dtype == h[k].dtype and torch.equal(w[k], h[k]) for k in h)
