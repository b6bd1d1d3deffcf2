#!/usr/bin/env python3
"""Language-model tokens delivered on cuda:0, side by side in one run: ferry.datasets.tokens
through ferry.DataLoader(device=0), nanoGPT's get_batch recipe, PyTorch's DataLoader over a memmap
Dataset of windows, and turboloader's TokenDataLoader(device="cuda") (when importable).

One flat uint16 token file (--tokens, random ids below 50,257, written once). Each row is a fresh
loader: --warmup batches, then --batches timed ones; the batch's input_ids and labels are on
cuda:0 (int64) before the next is taken, and the device is synchronized before the clock stops.
Tokens/s counts input_ids tokens. Busy cores: every process's CPU time (/proc/stat, all cores) over
the timed wall time. Each row runs --runs times; the table gives the median and the range.

Rows:
  ferry-wN      ferry.DataLoader(tokens(path, seq_len, dtype="uint16"), shuffle=True, num_workers=N,
                device=0, persistent_workers=True): workers write each window into its batch's
                pinned rows (int64), the device stage copies the batch on a side stream
  nanogpt       the recipe of nanoGPT's get_batch: random offsets, np.memmap, torch.stack of
                int64 windows, pin_memory(), .to(cuda, non_blocking=True), on the training thread
  torch-w4      torch.utils.data.DataLoader over a map-style Dataset of the same windows (memmap),
                shuffle=True, 4 workers, pin_memory=True, persistent_workers=True, .to(cuda, non_blocking=True)
  turboloader   turboloader.TokenDataLoader(path, seq_len, batch_size, dtype="uint16", device="cuda")
  litdata       litdata's StreamingDataset(item_loader=TokensLoader(block_size=seq_len + 1), shuffle=True)
                through its StreamingDataLoader (4 workers, pin_memory=True), over the same tokens
                written once by litdata.optimize as int32 chunks (litdata stores the tensors it is
                given; int16 would wrap ids past 32,767), .to(cuda, non_blocking=True)
  ferry-gpu-wN  ferry-wN with gather="device": the GPU reads each window from a page-locked copy
                of the file (made when the loader starts) and writes int64 input_ids and labels itself; the pin thread
                writes the window starts, and no worker starts whatever N says

Each timed run takes --batches batches, and more until --seconds have passed (busy cores are
counted in 1/100 s ticks).

Usage: tokens_loaders.py [--tokens 200000000] [--shapes 1024x64,2048x32,8192x8] [--batches 300]
       [--seconds 0] [--warmup 20] [--runs 3] [--rows nanogpt,torch-w4,turboloader,ferry-w1,ferry-w2,ferry-w4] [--dir /tmp]
"""
import argparse
import importlib
import os
import statistics
import sys
import time

import numpy as np
import torch

import ferry


def busy_jiffies():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v[:8]) - v[3] - v[4]


class Windows(torch.utils.data.Dataset):
    """The token file cut into windows of seq_len + 1 (inputs and labels shifted by one)."""

    def __init__(self, path, seq_len):
        self.path, self.seq_len = path, seq_len
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len
        self.data = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.data is None:  # opened in the worker
            self.data = np.memmap(self.path, dtype=np.uint16, mode="r")
        w = torch.from_numpy(self.data[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


def ferry_rows(path, seq, batch, workers, gather="auto"):
    ds = ferry.datasets.tokens(path, seq_len=seq, dtype="uint16")
    loader = ferry.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, device=0,
                              persistent_workers=workers > 0, seed=1, gather=gather)
    while True:
        for b in loader:
            yield b["input_ids"], b["labels"]


def nanogpt_rows(path, seq, batch):
    data = np.memmap(path, dtype=np.uint16, mode="r")
    while True:  # the recipe: a fresh memmap view, random offsets, stack, pin, copy
        ix = torch.randint(len(data) - seq - 1, (batch,))
        x = torch.stack([torch.from_numpy(data[i:i + seq].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq].astype(np.int64)) for i in ix.tolist()])
        yield x.pin_memory().to("cuda", non_blocking=True), y.pin_memory().to("cuda", non_blocking=True)


def torch_rows(path, seq, batch, workers):
    loader = torch.utils.data.DataLoader(Windows(path, seq), batch_size=batch, shuffle=True, num_workers=workers,
                                         pin_memory=True, persistent_workers=True, drop_last=True)
    while True:
        for x, y in loader:
            yield x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)


def turbo_rows(path, seq, batch):
    import turboloader
    loader = turboloader.TokenDataLoader(path, seq, batch_size=batch, dtype="uint16", device="cuda")
    while True:
        for x, y in loader:
            yield x, y


def _litdata_slice(item):
    """litdata.optimize's fn: one slice of the token file as an int32 tensor."""
    path, begin, end = item
    yield torch.from_numpy(np.fromfile(path, dtype=np.uint16, count=end - begin, offset=2 * begin).astype(np.int32))


def litdata_rows(path, seq, batch, workers=4):
    import litdata
    from litdata.streaming.item_loader import TokensLoader
    out = f"{path}.litdata"
    if not os.path.exists(os.path.join(out, "index.json")):
        n = os.path.getsize(path) // 2
        step = 10_000_000
        litdata.optimize(fn=_litdata_slice, inputs=[(path, b, min(b + step, n)) for b in range(0, n, step)], output_dir=out,
                         chunk_size=(8192 + 1) * 1024, item_loader=TokensLoader(), num_workers=8)
    ds = litdata.StreamingDataset(out, item_loader=TokensLoader(block_size=seq + 1), shuffle=True)
    loader = litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, pin_memory=True, drop_last=True)
    while True:
        for b in loader:
            b = b.to("cuda", non_blocking=True).long()
            yield b[:, :-1], b[:, 1:]


def measure(make, warmup, batches, seconds=0.0):
    rows = make()
    for _ in range(warmup):
        next(rows)
    torch.cuda.synchronize()
    j0, t0 = busy_jiffies(), time.perf_counter()
    tokens = taken = 0
    while taken < batches or time.perf_counter() - t0 < seconds:
        x, y = next(rows)
        assert x.is_cuda and x.dtype == torch.int64 and y.shape == x.shape
        tokens += x.numel()
        taken += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy = (busy_jiffies() - j0) / os.sysconf("SC_CLK_TCK") / wall
    rows.close()
    return tokens / wall, busy


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=200_000_000)
    p.add_argument("--shapes", default="1024x64,2048x32,8192x8")
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rows", default="nanogpt,torch-w4,turboloader,ferry-w1,ferry-w2,ferry-w4")
    p.add_argument("--dir", default="/tmp")
    a = p.parse_args()
    path = os.path.join(a.dir, f"tokens-{a.tokens}.bin")
    if not os.path.exists(path) or os.path.getsize(path) != 2 * a.tokens:
        rng = np.random.default_rng(0)
        rng.integers(0, 50257, a.tokens, dtype=np.uint16).tofile(path)
    print(f"# tokens delivered on cuda:0 ({torch.cuda.get_device_name(0)}, {os.cpu_count()} CPUs), torch {torch.__version__}, "
          f"ferry {ferry.__version__}, {a.tokens:,} uint16 tokens, {a.batches} batches (and {a.seconds} s) after {a.warmup}, median of {a.runs}")
    print("| seq x batch | loader | M tokens/s (median) | range | busy cores | vs nanogpt |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in a.shapes.split(","):
        seq, batch = (int(v) for v in shape.split("x"))
        results = {}
        for row in a.rows.split(","):
            if row.startswith("ferry-gpu-w"):
                make = lambda w=int(row[11:]), seq=seq, batch=batch: ferry_rows(path, seq, batch, w, "device")
            elif row.startswith("ferry-w"):
                make = lambda w=int(row[7:]), seq=seq, batch=batch: ferry_rows(path, seq, batch, w)
            elif row == "nanogpt":
                make = lambda seq=seq, batch=batch: nanogpt_rows(path, seq, batch)
            elif row.startswith("torch-w"):
                make = lambda w=int(row[7:]), seq=seq, batch=batch: torch_rows(path, seq, batch, w)
            elif row in ("litdata", "turboloader"):  # peers from PyPI, when installed
                try:
                    importlib.import_module(row)
                except ImportError as e:
                    print(f"| {shape} | {row} | not importable: {e} | | | |")
                    continue
                rows_of = litdata_rows if row == "litdata" else turbo_rows
                make = lambda rows_of=rows_of, seq=seq, batch=batch: rows_of(path, seq, batch)
            else:
                sys.exit(f"unknown row {row}")
            try:
                runs = [measure(make, a.warmup, a.batches, a.seconds) for _ in range(a.runs)]
            except Exception as e:  # a peer that fails is reported, not the end of the table
                print(f"| {seq}x{batch} | {row} | failed: {type(e).__name__}: {str(e)[:200]} | | | |", flush=True)
                continue
            rates = sorted(r[0] for r in runs)
            med = statistics.median(rates)
            results[row] = med
            busy = statistics.median(r[1] for r in runs)
            base = results.get("nanogpt")
            print(f"| {seq}x{batch} | {row} | {med / 1e6:,.1f} | {rates[0] / 1e6:,.1f}-{rates[-1] / 1e6:,.1f} | {busy:.2f} | "
                  f"{'' if base is None else f'{med / base:.2f}x'} |", flush=True)


if __name__ == "__main__":
    main()
