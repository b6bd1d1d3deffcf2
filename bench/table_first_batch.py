"""First batch from many Parquet files: ferry.datasets.parquet opening N files (footers only) and
delivering its first batch of token windows, timed from before the open (torch and ferry already
imported, as in a training script); resident-set growth over the same span.

  python bench/table_first_batch.py --out build/bench-data/many --files 1000 --rows 2000

Each file holds --rows rows of the machine's own text (tests/text/corpus.py), two row groups;
the tokenizer is a byte-level BPE tokenizer.json trained on that text. Each measurement runs in
a fresh process; medians of --repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "text"))


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(out: str, workers: int) -> None:
    import torch  # noqa: F401  (a training script has it imported; the batches are torch tensors)

    import ferry

    files = sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".parquet"))
    r0, t0 = rss_kb(), time.perf_counter()
    ds = ferry.datasets.parquet(files=files, tokenizer=os.path.join(out, "tokenizer.json"), seq_len=1024,
                                eos="<|endoftext|>")
    opened = time.perf_counter() - t0
    loader = ferry.DataLoader(ds, batch_size=16, num_workers=workers)
    next(iter(loader))
    first = time.perf_counter() - t0
    print(json.dumps({"open": opened, "first": first, "rss_mb": (rss_kb() - r0) / 1024, "files": len(files)}))


def make(out: str, n: int, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    import corpus

    stamp = os.path.join(out, f"made-{n}-{rows}")
    if os.path.exists(stamp):
        return
    os.makedirs(out, exist_ok=True)
    docs = [d for d in corpus.documents(max_changelogs=200) if d]
    for i in range(n):
        part = [docs[(i * rows + k) % len(docs)] for k in range(rows)]
        pq.write_table(pa.table({"text": part}), os.path.join(out, f"part-{i:05d}.parquet"), row_group_size=rows // 2)
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    t.save(os.path.join(out, "tokenizer.json"))
    open(stamp, "w").close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/bench-data/many")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args.out, args.workers)
    make(args.out, args.files, args.rows)
    runs = []
    for _ in range(args.repeat):
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--out", args.out, "--workers",
                            str(args.workers)], capture_output=True, text=True, check=True)
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out) if f.endswith(".parquet"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    print(f"# First batch from {runs[0]['files']} Parquet files ({size / 1e9:.2f} GB, {args.rows} rows each; "
          f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} vCPUs, commit {commit}); medians of {args.repeat} fresh processes")
    print("| open (footers) s | first batch s | RSS growth MB |")
    print("|---:|---:|---:|")
    med = {k: statistics.median(r[k] for r in runs) for k in ("open", "first", "rss_mb")}
    print(f"| {med['open']:.3f} | {med['first']:.3f} | {med['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
