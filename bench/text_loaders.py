"""Raw Parquet text to batches of token windows, peers side by side in one run.

  python bench/text_loaders.py --out build/bench-data/text --mb 120 --workers 2

The corpus: the machine's own text (tests/text/corpus.py: licences, Debian changelogs), repeated
to --mb megabytes with each copy's rows numbered, written by pyarrow as three Parquet files of
very different sizes (10%, 30%, 60%), row groups of 2,000 rows; a byte-level BPE tokenizer.json
(vocab 32,000) trained on it with `tokenizers`. Each contestant runs in a process of its own for
one pass over the files (windows of --seq + 1 tokens, --batch a batch, an end-of-text token after
each row), and reports tokens/s (wall time of the pass) and busy cores (the process's CPU seconds, its worker
processes' included, over the process's wall time, start-up included):

* ferry: ferry.datasets.parquet + ferry.DataLoader(num_workers=--workers).
* hf_streaming: HF `datasets` streaming (load_dataset("parquet", streaming=True)) tokenized a row
  at a time with `tokenizers` into a window buffer (torchtitan's recipe), through
  torch.utils.data.DataLoader(num_workers=--workers) (where `datasets` is importable: pass
  --hf-python, a Python that has it).
* pyarrow_loop: pyarrow's iter_batches + `tokenizers`' encode_batch (its own threads) + numpy
  windows, in the main process.

Then the tokenizers alone, on one thread each over the same rows: ferry.Tokenizer.encode_batch
against `tokenizers`' encode_batch (RAYON_NUM_THREADS=1), with the ids compared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "text"))


def make_corpus(out: str, mb: int) -> tuple[list[str], str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import corpus

    os.makedirs(out, exist_ok=True)
    files = [os.path.join(out, f"part-{i}.parquet") for i in range(3)]
    tok = os.path.join(out, "tokenizer.json")
    stamp = os.path.join(out, f"made-{mb}mb")
    if all(os.path.exists(p) for p in [*files, tok, stamp]):
        return files, tok
    docs = [d for d in corpus.documents() if d]
    rows: list[str] = []
    size, copy = 0, 0
    while size < mb << 20:
        for d in docs:
            r = f"[{copy}] {d}"
            rows.append(r)
            size += len(r.encode())
        copy += 1
    cuts = [0, len(rows) // 10, len(rows) * 4 // 10, len(rows)]
    for i, path in enumerate(files):
        pq.write_table(pa.table({"text": rows[cuts[i]:cuts[i + 1]]}), path, row_group_size=2000)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    t.save(tok)
    open(stamp, "w").close()
    return files, tok


def run_ferry(files, tok, seq, batch, workers):
    import ferry

    ds = ferry.datasets.parquet(files=files, tokenizer=tok, seq_len=seq, eos="<|endoftext|>")
    loader = ferry.DataLoader(ds, batch_size=batch, num_workers=workers)
    tokens, first = 0, None
    t0 = time.perf_counter()
    for b in loader:
        if first is None:
            first = time.perf_counter() - t0
        tokens += b["input_ids"].numel()
    return tokens, first


def run_hf(files, tok, seq, batch, workers):
    import torch
    from datasets import load_dataset
    from tokenizers import Tokenizer

    class Windows(torch.utils.data.IterableDataset):
        """torchtitan's HuggingFaceDataset: a row at a time into a buffer, windows of seq + 1."""

        def __init__(self):
            self.ds = load_dataset("parquet", data_files=files, split="train", streaming=True)
            self.tok = Tokenizer.from_file(tok)
            self.eos = self.tok.token_to_id("<|endoftext|>")

        def __iter__(self):
            buf: list[int] = []
            for row in self.ds:
                buf.extend(self.tok.encode(row["text"], add_special_tokens=False).ids)
                buf.append(self.eos)
                while len(buf) >= seq + 1:
                    x = torch.tensor(buf[: seq + 1])
                    buf = buf[seq:]
                    yield x[:-1], x[1:]

    loader = torch.utils.data.DataLoader(Windows(), batch_size=batch, num_workers=workers)
    tokens, first = 0, None
    t0 = time.perf_counter()
    for x, _ in loader:
        if first is None:
            first = time.perf_counter() - t0
        tokens += x.numel()
    return tokens, first


def run_pyarrow(files, tok, seq, batch, workers):
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(tok)
    eos = t.token_to_id("<|endoftext|>")
    tokens, first = 0, None
    t0 = time.perf_counter()
    carry = np.zeros(0, np.int64)
    for path in files:
        for rb in pq.ParquetFile(path).iter_batches(columns=["text"], batch_size=1024):
            enc = t.encode_batch(rb.column(0).to_pylist(), add_special_tokens=False)
            ids = np.concatenate([carry] + [np.array(e.ids + [eos], np.int64) for e in enc])
            n = (len(ids) - 1) // seq
            w = np.lib.stride_tricks.sliding_window_view(ids, seq + 1)[: n * seq: seq]
            for k in range(0, len(w) - batch + 1, batch):
                x = torch.from_numpy(np.ascontiguousarray(w[k:k + batch]))
                if first is None:
                    first = time.perf_counter() - t0
                tokens += x[:, :-1].numel()
            carry = ids[(len(w) // batch) * batch * seq:]
    return tokens, first


def tokenizer_speed(files, tok):
    import pyarrow.parquet as pq
    import tokenizers

    import ferry

    rows = pq.ParquetFile(files[0]).read_row_group(0, columns=["text"]).column(0).to_pylist()
    for g in range(1, 4):
        rows += pq.ParquetFile(files[1]).read_row_group(g, columns=["text"]).column(0).to_pylist()
    mb = sum(len(r.encode()) for r in rows) / 1e6
    out = {}
    # Cold: each tokenizer freshly loaded (its word cache empty), one pass, alternating, 3 times;
    # warm: the best of 3 more passes on the same object (both keep a cache of words seen).
    for name in ("tokenizers", "ferry") * 3:
        if name == "tokenizers":
            ref = tokenizers.Tokenizer.from_file(tok)

            def fn(ref=ref):
                return [e.ids for e in ref.encode_batch(rows, add_special_tokens=False)]
        else:
            mine = ferry.Tokenizer.from_file(tok)

            def fn(mine=mine):
                return mine.encode_batch(rows, threads=1)
        times = []
        for _ in range(4):
            c0, t0 = time.process_time(), time.perf_counter()
            ids = fn()
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        o = out.setdefault(name, {"cold": [], "warm": [], "busy": [], "ids": ids})
        o["cold"].append(times[0][0])
        o["warm"].append(min(t for t, _ in times[1:]))
        o["busy"].append(times[0][1] / times[0][0])
    same = out["tokenizers"]["ids"] == out["ferry"]["ids"]
    return {"mb": mb, "rows": len(rows), "identical": same,
            **{k: {"cold": mb / statistics.median(v["cold"]), "warm": mb / statistics.median(v["warm"]),
                   "busy": statistics.median(v["busy"])} for k, v in out.items()}}


def child(args):
    fn = {"ferry": run_ferry, "hf_streaming": run_hf, "pyarrow_loop": run_pyarrow}[args.child]
    t0 = time.perf_counter()
    tokens, first = fn(args.files, args.tokenizer, args.seq, args.batch, args.workers)
    print(json.dumps({"tokens": tokens, "wall": time.perf_counter() - t0, "first": first}))


def contest(name, python, files, tok, args):
    cmd = [python, os.path.abspath(__file__), "--child", name, "--tokenizer", tok, "--seq", str(args.seq),
           "--batch", str(args.batch), "--workers", str(args.workers), "--files", *files]
    env = dict(os.environ)
    if name == "pyarrow_loop":
        env.pop("RAYON_NUM_THREADS", None)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, check=False)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"name": name, "error": f"exit {p.returncode}"}
    r = json.loads(p.stdout.decode().strip().splitlines()[-1])
    return {"name": name, **r, "process_wall": wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/bench-data/text")
    ap.add_argument("--mb", type=int, default=120)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hf-python", default=None, help="a Python with HF datasets (and torch) for hf_streaming")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the contestants, in turn; medians reported")
    ap.add_argument("--tokenizers-only", action="store_true", help="the tokenizers' comparison alone")
    ap.add_argument("--child", default=None)
    ap.add_argument("--files", nargs="*")
    ap.add_argument("--tokenizer")
    args = ap.parse_args()
    if args.child:
        return child(args)
    files, tok = make_corpus(args.out, args.mb)
    if args.tokenizers_only:
        speed = tokenizer_speed(files, tok)
        print(json.dumps({k: v for k, v in speed.items()}, indent=1))
        return None
    names = [("ferry", sys.executable), ("pyarrow_loop", sys.executable)]
    if args.hf_python:
        names.append(("hf_streaming", args.hf_python))
    runs: dict[str, list[dict]] = {n: [] for n, _ in names}
    for _ in range(args.repeat):
        for name, python in names:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            r = contest(name, python, files, tok, args)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if "error" not in r:
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                r["busy"] = cpu / r["process_wall"]
                r["tok_s"] = r["tokens"] / r["wall"]
            runs[name].append(r)
    rows = []
    for name, _ in names:
        good = [r for r in runs[name] if "error" not in r]
        if not good:
            rows.append(runs[name][0])
            continue
        med = {k: statistics.median(r[k] for r in good) for k in ("tok_s", "busy", "first", "tokens")}
        med["lo"], med["hi"] = min(r["tok_s"] for r in good), max(r["tok_s"] for r in good)
        rows.append({"name": name, **med})
    speed = tokenizer_speed(files, tok)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    print(f"# Raw Parquet text to token windows ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} vCPUs, "
          f"{platform.platform()}, commit {commit})")
    print(f"corpus {args.mb} MB in 3 Parquet files, seq {args.seq}, batch {args.batch}, workers {args.workers}\n")
    base = next((r for r in rows if r["name"] == "hf_streaming" and "tok_s" in r), None)
    print(f"medians of {args.repeat} rounds (the contestants in turn); tokens/s range in brackets\n")
    print("| loader | tokens | tokens/s | first batch s | busy cores | tokens/s per busy core | vs hf_streaming per core |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['error']} | | | | | |")
            continue
        per_core = r["tok_s"] / max(r["busy"], 1e-9)
        ratio = "" if base is None else f"{per_core / (base['tok_s'] / max(base['busy'], 1e-9)):.1f}x"
        print(f"| {r['name']} | {int(r['tokens']):,} | {r['tok_s'] / 1e6:.2f} M [{r['lo'] / 1e6:.2f}-{r['hi'] / 1e6:.2f}] | "
              f"{r['first']:.2f} | {r['busy']:.2f} | {per_core / 1e6:.2f} M | {ratio} |")
    print(f"\nTokenizers on one thread, {speed['rows']:,} rows ({speed['mb']:.1f} MB), ids identical: {speed['identical']}; "
          "cold: a fresh tokenizer's first pass, warm: its later passes (medians of 3)")
    print("| tokenizer | cold MB/s | warm MB/s | busy cores | cold ratio | warm ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in ("tokenizers", "ferry"):
        t = speed["tokenizers"]
        print(f"| {k} | {speed[k]['cold']:.2f} | {speed[k]['warm']:.2f} | {speed[k]['busy']:.2f} | "
              f"{speed[k]['cold'] / t['cold']:.2f}x | {speed[k]['warm'] / t['warm']:.2f}x |")


if __name__ == "__main__":
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer comparison's `tokenizers` on one thread
    main()
