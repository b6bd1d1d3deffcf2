#!/usr/bin/env python3
"""Time to the first batch from Python: ferry.DataLoader against torch.utils.data.DataLoader.

In-memory data, 2,048 samples of 3x224x224 uint8, batch 256 (38.5 MB), shuffled, pinned
(pin_memory=True where there is a GPU, the usual setting). Rows: PyTorch's DataLoader over a TensorDataset;
ferry over its own in-memory dataset (ferry.datasets.synthetic, made by C++ threads); ferry over the
same TensorDataset (a Python dataset: worker threads, and worker processes). Each figure is the
median of --runs new loaders, from DataLoader(...) to the first batch in hand; CUDA is started
once before the rows.
Usage: first_batch.py [--runs 5] [--workers 0,4,12]
"""
import argparse
import os
import statistics
import time

import torch
import torch.utils.data as tud

import ferry


def first_ms(make, runs):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        loader = make()
        batch = next(iter(loader))
        times.append((time.perf_counter() - t0) * 1e3)
        del batch, loader
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", default="0,4,12")
    args = ap.parse_args()
    pin = torch.cuda.is_available()
    if pin:
        torch.zeros(1).pin_memory()  # CUDA's start-up, once, before the rows
    x = torch.full((2048, 3, 224, 224), 7, dtype=torch.uint8)
    tensors = tud.TensorDataset(x)
    synthetic = ferry.datasets.synthetic(n=2048, shape=(3, 224, 224))
    print(f"# first batch, ms (median of {args.runs}): 2,048 x 3x224x224 uint8 in memory, batch 256, shuffled, "
          f"pin_memory={pin}; {os.cpu_count()} vCPUs, torch {torch.__version__}\n")
    print("| workers | PyTorch, TensorDataset | ferry, its in-memory dataset | ferry, the TensorDataset, threads | "
          "ferry, the TensorDataset, processes |")
    print("|---:|---:|---:|---:|---:|")
    for w in [int(v) for v in args.workers.split(",")]:
        kw = dict(batch_size=256, shuffle=True, num_workers=w, pin_memory=pin)
        row = [first_ms(lambda: tud.DataLoader(tensors, **kw), args.runs),
               first_ms(lambda: ferry.DataLoader(synthetic, **kw), args.runs),
               first_ms(lambda: ferry.DataLoader(tensors, worker_type="thread", **kw), args.runs)]
        row.append(first_ms(lambda: ferry.DataLoader(tensors, worker_type="process", **kw), args.runs) if w else float("nan"))
        print(f"| {w} | " + " | ".join("-" if v != v else f"{v:.1f}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
