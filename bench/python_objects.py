#!/usr/bin/env python3
"""A dataset of many Python objects through worker processes: ferry.DataLoader against torch's.

The dataset holds --objects (path, label) tuples, as an ImageFolder's `samples` list does; each
sample is a small tensor made from its tuple, so the loader's own costs show: starting the
workers with the dataset in them, and what the processes' memory becomes as the workers touch
every object (copy-on-write pages copied as reference counts change). Rows, side by side in one
run, each a fresh loader with --workers worker processes, batch --batch, shuffled:
  * torch.utils.data.DataLoader (fork, its default on Linux);
  * ferry.DataLoader, its loader zygote forked from this process with the dataset in it (this
    process runs one thread when the loader is made; Note [Loader zygotes forked from the main
    process] in python/ferry/_zygote.py), the workers forked from that;
  * ferry.DataLoader as where the process runs other threads: the dataset pickled and sent once to
    a loader zygote forked from ferry's zygote.
Columns: seconds from DataLoader(...) to the first batch in hand (median of --runs); the whole
process tree's memory (the sum of every process's PSS, so shared pages count once, from
/proc/<pid>/smaps_rollup) at the first batch and after a whole epoch; seconds for the epoch.
Usage: python_objects.py [--objects 1000000] [--workers 8] [--batch 256] [--runs 3]
"""
import argparse
import os
import statistics
import time

import torch
import torch.utils.data as tud

import ferry


class Paths(tud.Dataset):
    def __init__(self, n):
        self.samples = [(f"/data/imagenet/train/n{i % 1000:08d}/image_{i:08d}.JPEG", i % 1000) for i in range(n)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        return torch.tensor([len(path), label])


def tree(pid):
    """pid and its descendants."""
    children = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
            except (OSError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def pss_gib(pids):
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 2**20


def row(make, runs):
    firsts, mem_first, mem_end, epochs, forked = [], [], [], [], set()
    for _ in range(runs):
        t0 = time.perf_counter()
        loader = make()
        forked.add(getattr(getattr(loader, "_pool", None), "forked", None))
        it = iter(loader)
        next(it)
        firsts.append(time.perf_counter() - t0)
        pids = tree(os.getpid())
        pids += [p for z in (getattr(getattr(ferry, "_zygote", None), "_zygote", None),) if z for p in tree(z.pid)]
        mem_first.append(pss_gib(set(pids)))
        t1 = time.perf_counter()
        n = 1
        for n, _ in enumerate(it, 2):
            if n == len(loader) - 2:  # the workers are still alive here
                pids = tree(os.getpid())
                pids += [p for z in (getattr(getattr(ferry, "_zygote", None), "_zygote", None),) if z for p in tree(z.pid)]
                mem_end.append(pss_gib(set(pids)))
        epochs.append(time.perf_counter() - t1)
        del it, loader
    return (statistics.median(firsts), statistics.median(mem_first), statistics.median(mem_end), statistics.median(epochs),
            forked)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    ds = Paths(args.objects)
    made = time.perf_counter() - t0
    base = pss_gib([os.getpid()])
    print(f"# {args.objects:,} (path, label) objects ({made:.1f} s to make; this process {base:.2f} GiB PSS), "
          f"{args.workers} worker processes, batch {args.batch}, shuffled, median of {args.runs}; {os.cpu_count()} vCPUs, "
          f"torch {torch.__version__}\n")
    print("| loader | first batch (s) | tree PSS at first batch (GiB) | tree PSS at epoch's end (GiB) | epoch (s) |")
    print("|---|---:|---:|---:|---:|")
    rows = {
        "torch DataLoader (fork)": lambda: tud.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers),
        "ferry.DataLoader (loader zygote forked from this process)": lambda: ferry.DataLoader(
            ds, batch_size=args.batch, shuffle=True, num_workers=args.workers),
        "ferry.DataLoader (dataset sent to a loader zygote)": lambda: ferry.DataLoader(
            ds, batch_size=args.batch, shuffle=True, num_workers=args.workers),
    }
    fork_safe = ferry._zygote.fork_safe
    for name, make in rows.items():
        ferry._zygote.fork_safe = (lambda: False) if "sent" in name else fork_safe
        first, m1, m2, epoch, forked = row(make, args.runs)
        if "ferry" in name and forked != {"forked from this" in name}:
            name += f" (NOT AS NAMED: forked {sorted(map(str, forked))})"
        print(f"| {name} | {first:.2f} | {m1:.2f} | {m2:.2f} | {epoch:.1f} |", flush=True)


if __name__ == "__main__":
    main()
