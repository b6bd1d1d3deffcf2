#!/usr/bin/env python3
"""What packing does to documents: a Megatron-LM indexed dataset of documents with lengths drawn
from a log-normal distribution (--mean tokens), cut into sequences of --seq-len by plain packed
windows and by best-fit packing (ferry.datasets.megatron(..., packed=True, best_fit_group=G)), one
epoch each through ferry.DataLoader (shuffle=True, --workers workers); then best-fit packing
over documents shuffled each epoch (shuffle_documents=True) read in order (shuffle=False), which
packs each group once.

Each document's tokens are its own id (uint16), so a sequence's pieces (runs that start where
position_ids is 0) name their documents. Reported per loader: documents of at most seq_len tokens
that are cut (their tokens in more than one piece), pieces a sequence, padding (none by
construction: every sequence is full) and samples/s over the epoch. One run each.

Usage: tokens_packing.py [--docs 20000] [--mean 1000] [--seq-len 2048] [--groups 16,64,256] [--workers 2] [--dir /tmp]
"""
import argparse
import os
import struct
import time

import numpy as np

import ferry


def write_megatron(prefix, lengths):
    ids = np.repeat(np.arange(len(lengths), dtype=np.uint16), lengths)
    ids.tofile(prefix + ".bin")
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2]).astype(np.int64)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", len(lengths), len(lengths) + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())


def measure(ds, seq, workers, lengths, shuffle=True):
    loader = ferry.DataLoader(ds, batch_size=32, shuffle=shuffle, num_workers=workers, seed=1)
    pieces = np.zeros(len(lengths), dtype=np.int64)
    sequences = 0
    t0 = time.perf_counter()
    for b in loader:
        ids, pos = b["input_ids"].numpy(), b["position_ids"].numpy()
        starts = pos == 0
        pieces += np.bincount(ids[starts], minlength=len(lengths))
        sequences += ids.shape[0]
    wall = time.perf_counter() - t0
    short = lengths <= seq
    cut = int(((pieces > 1) & short).sum())
    return cut, int(short.sum()), pieces.sum() / sequences, sequences / wall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--mean", type=float, default=1000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--groups", default="16,64,256")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dir", default="/tmp")
    a = p.parse_args()
    assert a.docs < 65536, "document ids are the tokens (uint16)"
    rng = np.random.default_rng(0)
    sigma = 1.0
    lengths = np.maximum(1, rng.lognormal(np.log(a.mean) - sigma ** 2 / 2, sigma, a.docs)).astype(np.int64)
    prefix = os.path.join(a.dir, f"packing-{a.docs}-{int(a.mean)}")
    write_megatron(prefix, lengths)
    print(f"# {a.docs:,} documents, {lengths.sum():,} tokens (log-normal lengths, mean {lengths.mean():.0f}, "
          f"median {np.median(lengths):.0f}, {(lengths > a.seq_len).mean():.1%} longer than seq_len {a.seq_len}); "
          f"ferry {ferry.__version__}, {os.cpu_count()} CPUs, {a.workers} workers, one epoch each")
    print("| packing | documents <= seq_len cut | of them | pieces a sequence | padding | sequences/s |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [("windows", {}, True)] + [(f"best fit, group {g}", {"best_fit_group": int(g)}, True) for g in a.groups.split(",")]
    # A group's sequences read in order pack it once (the documents shuffled instead of the sequences).
    rows += [(f"best fit, group {g}, shuffle_documents, loader shuffle=False", {"best_fit_group": int(g), "shuffle_documents": True}, False)
             for g in a.groups.split(",")]
    for name, kw, shuffle in rows:
        ds = ferry.datasets.megatron(prefix, seq_len=a.seq_len, packed=True, **kw)
        cut, short, per_seq, rate = measure(ds, a.seq_len, a.workers, lengths, shuffle)
        print(f"| {name} | {cut:,} | {cut / short:.1%} | {per_seq:.2f} | 0 | {rate:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
