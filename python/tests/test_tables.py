"""ferry.datasets.parquet: Parquet files of raw text (written here with pyarrow from the machine's
own text, three files of very different sizes, several row groups each) tokenized on ferry's
threads: the windows are the ones `tokenizers` ids cut as ferry/loaders/table.h says, every row
group's tokens used once an epoch, the same batches for 0, 1, 4 and 16 workers, a mid-epoch
resume at other worker counts equal to the uninterrupted run from the restored row group on
(the state holds its cursor), and bad files as ferry.DataError naming the file, row group and
row."""

from __future__ import annotations

import os
import sys

import pytest

import ferry

pa = pytest.importorskip("pyarrow", reason="pyarrow writes the test's Parquet files (scripts/install-deps.sh)")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers", reason="PyPI's tokenizers is the reference (scripts/install-deps.sh)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "text"))
import corpus  # noqa: E402

SEQ = 64
ROW_GROUP = 300


def _parquet_or_skip():
    if "parquet" not in ferry.datasets.registered() and not _built_with_arrow():
        pytest.skip("ferry was built without Apache Arrow (scripts/install-deps.sh puts it in /opt/ferry-arrow)")


def _built_with_arrow():
    try:
        ferry.datasets.parquet(files=["/nonexistent.parquet"], tokenizer=__file__)
    except ferry.Error as e:
        return "without Apache Arrow" not in str(e)
    return True


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    _parquet_or_skip()
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("table")
    docs = corpus.documents(max_changelogs=150)
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    tok = str(d / "tokenizer.json")
    t.save(tok)
    rows = docs[:]
    rows.insert(5, None)  # a null row: no text, skipped
    cuts = [0, 400, 400 + len(rows) // 2, len(rows)]  # a small file and two large ones
    files = []
    for i in range(3):
        part = rows[cuts[i]:cuts[i + 1]]
        path = str(d / f"part-{i}.parquet")
        pq.write_table(pa.table({"id": list(range(len(part))), "text": pa.array(part, pa.string())}), path,
                       row_group_size=ROW_GROUP)
        files.append((path, part))
    return {"dir": str(d), "tokenizer": tok, "files": files, "ref": t}


def _expected_windows(table, seq_len=SEQ):
    """The windows of shuffle=False: each row group's ids (eos after each row), cut into windows of
    seq_len + 1 overlapping by one; the tail of each row group unused."""
    ref = table["ref"]
    eos = ref.token_to_id("<|endoftext|>")
    out = []
    for _, rows in table["files"]:
        for g in range(0, len(rows), ROW_GROUP):
            ids = []
            texts = [r for r in rows[g:g + ROW_GROUP] if r is not None]
            for e in ref.encode_batch(texts, add_special_tokens=False):
                ids.extend(e.ids)
                ids.append(eos)
            for w in range((len(ids) - 1) // seq_len if len(ids) > seq_len else 0):
                out.append(ids[w * seq_len:w * seq_len + seq_len + 1])
    return out


def _epoch(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def _windows(batches):
    out = []
    for b in batches:
        for i in range(b["input_ids"].shape[0]):
            x, y = b["input_ids"][i].tolist(), b["labels"][i].tolist()
            assert x[1:] == y[:-1]
            out.append(x + y[-1:])
    return out


def test_windows_are_the_reference_tokenizers_and_every_row_group_once(table):
    ds = ferry.datasets.parquet(dir=table["dir"], tokenizer=table["tokenizer"], seq_len=SEQ, eos="<|endoftext|>",
                                shuffle=False)
    assert ds.fields == ["input_ids", "labels"]
    with pytest.raises(TypeError):
        len(ds)
    batches = _epoch(ferry.DataLoader(ds, batch_size=16, num_workers=2))
    assert all(b["input_ids"].shape[1] == SEQ for b in batches)
    want = _expected_windows(table)
    assert _windows(batches) == want


def _expected_packed(table, seq_len=SEQ):
    """shuffle=False's packed windows: (ids, position_ids, cu_seqlens), the rows' starts within each
    window (each row its ids then eos) restarting the positions, as ferry/loaders/table.h says."""
    ref = table["ref"]
    eos = ref.token_to_id("<|endoftext|>")
    out = []
    for _, rows in table["files"]:
        for g in range(0, len(rows), ROW_GROUP):
            ids, starts = [], []
            texts = [r for r in rows[g:g + ROW_GROUP] if r is not None]
            for e in ref.encode_batch(texts, add_special_tokens=False):
                starts.append(len(ids))
                ids.extend(e.ids)
                ids.append(eos)
            for w in range((len(ids) - 1) // seq_len if len(ids) > seq_len else 0):
                a = w * seq_len
                inner = [s - a for s in starts if a < s < a + seq_len]
                cu = [0] + inner
                cu += [seq_len] * (seq_len + 1 - len(cu))
                pos, first = [], 0
                for k in range(seq_len):
                    if k in inner:
                        first = k
                    pos.append(k - first)
                out.append((ids[a:a + seq_len + 1], pos, cu))
    return out


def test_packed_windows_carry_each_rows_start(table):
    ds = ferry.datasets.parquet(dir=table["dir"], tokenizer=table["tokenizer"], seq_len=SEQ, eos="<|endoftext|>",
                                shuffle=False, packed=True)
    assert ds.fields == ["input_ids", "labels", "position_ids", "cu_seqlens"]
    want = _expected_packed(table)
    assert sum(len(c) - c.count(SEQ) for _, _, c in want) > len(want)  # windows of several rows: the test can fail
    for workers in (0, 3):
        batches = _epoch(ferry.DataLoader(ds, batch_size=16, num_workers=workers))
        b = batches[0]
        assert b["position_ids"].dtype == b["input_ids"].dtype and b["position_ids"].shape == b["input_ids"].shape
        assert str(b["cu_seqlens"].dtype) == "torch.int32" and b["cu_seqlens"].shape[1] == SEQ + 1
        got = []
        for b in batches:
            for i in range(b["input_ids"].shape[0]):
                got.append((b["input_ids"][i].tolist() + b["labels"][i][-1:].tolist(), b["position_ids"][i].tolist(),
                            b["cu_seqlens"][i].tolist()))
        assert got == want
    # The packed windows' tokens are the unpacked ones'.
    plain = ferry.datasets.parquet(dir=table["dir"], tokenizer=table["tokenizer"], seq_len=SEQ, eos="<|endoftext|>",
                                   shuffle=False)
    assert [w for w, _, _ in want] == _windows(_epoch(ferry.DataLoader(plain, batch_size=16)))


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_identical_for_any_worker_count(table, shuffle):
    ds = ferry.datasets.parquet(files=[p for p, _ in table["files"]], tokenizer=table["tokenizer"], seq_len=SEQ,
                                eos="<|endoftext|>", shuffle=shuffle, rows_per_read=100)
    runs = {}
    for w in (0, 1, 4, 16):
        loader = ferry.DataLoader(ds, batch_size=8, num_workers=w, seed=7)
        runs[w] = [_windows(_epoch(loader)), _windows(_epoch(loader))]
    for w in (1, 4, 16):
        assert runs[w] == runs[0], f"num_workers={w} differs from 0"
    first, second = runs[0]
    assert len(first) == len(second) > 100
    if shuffle:
        assert first != second  # another order of row groups and rows each epoch
        assert sorted(map(tuple, first)) != sorted(map(tuple, _expected_windows(table)))  # rows shuffled within reads


@pytest.mark.parametrize("before,after", [(2, 3), (4, 1), (0, 16)])
def test_resume_mid_epoch_at_other_worker_counts(table, before, after):
    ds = ferry.datasets.parquet(dir=table["dir"], tokenizer=table["tokenizer"], seq_len=SEQ, eos="<|endoftext|>",
                                shuffle=True, rows_per_read=128)
    full = ferry.DataLoader(ds, batch_size=8, num_workers=before, seed=11)
    want = _epoch(full) + _epoch(full)
    for stop in (1, len(want) // 3, len(want) // 2 + 5):
        epoch_len = len(want) // 2
        loader = ferry.DataLoader(ds, batch_size=8, num_workers=before, seed=11)
        got = []
        for b in loader:
            got.append({k: v.clone() for k, v in b.items()})
            if len(got) == min(stop, epoch_len):
                break
        if stop > epoch_len:
            for b in loader:
                got.append({k: v.clone() for k, v in b.items()})
                if len(got) == stop:
                    break
        state = loader.state_dict()
        assert "cursor 1" in state["ferry_loader_state"]
        del loader
        resumed = ferry.DataLoader(ds, batch_size=8, num_workers=after, seed=11)
        resumed.load_state_dict(state)
        rest = _epoch(resumed)
        if stop < epoch_len:
            rest += _epoch(resumed)
        assert _windows(got + rest) == _windows(want), f"stop={stop}"


def test_bad_input_names_the_file_row_group_and_row(table, tmp_path):
    tok = table["tokenizer"]
    no_col = str(tmp_path / "no-text.parquet")
    pq.write_table(pa.table({"body": ["a", "b"]}), no_col)
    with pytest.raises(ferry.DataError, match=r"no-text.parquet: no column 'text' \(its columns: body\)"):
        ferry.datasets.parquet(files=no_col, tokenizer=tok)
    ints = str(tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), ints)
    with pytest.raises(ferry.DataError, match=r"ints.parquet: column 'text' is .*not a string column"):
        ferry.datasets.parquet(files=ints, tokenizer=tok)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 this is not a parquet file at all PAR1")
    with pytest.raises(ferry.DataError, match="junk.parquet: not a readable Parquet file"):
        ferry.datasets.parquet(files=str(junk), tokenizer=tok)
    truncated = tmp_path / "truncated.parquet"
    whole = open(table["files"][0][0], "rb").read()
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ferry.DataError, match="truncated.parquet"):
        ferry.datasets.parquet(files=str(truncated), tokenizer=tok)
    with pytest.raises(ferry.DataError, match="missing.parquet"):
        ferry.datasets.parquet(files=str(tmp_path / "missing.parquet"), tokenizer=tok)
    # Bytes that are not UTF-8 in a binary column read as text: the row is named.
    bad = str(tmp_path / "bad-utf8.parquet")
    pq.write_table(pa.table({"text": pa.array([b"fine text " * 20, b"more \xff\xfe bad", b"x"], pa.binary())}), bad,
                   row_group_size=2)
    ds = ferry.datasets.parquet(files=bad, tokenizer=tok, seq_len=4, shuffle=False)
    with pytest.raises(ferry.DataError, match=r"bad-utf8.parquet, row group 0, row 1: at byte 5: not UTF-8"):
        _epoch(ferry.DataLoader(ds, batch_size=2, num_workers=2))
    with pytest.raises(ferry.Error, match="has no token 'nope'"):
        ferry.datasets.parquet(files=bad, tokenizer=tok, eos="nope")
    with pytest.raises(ValueError, match="files= or dir="):
        ferry.datasets.parquet(tokenizer=tok)
