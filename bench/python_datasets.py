#!/usr/bin/env python3
"""A Python dataset through ferry.DataLoader (worker processes, the default, and worker threads)
and torch.utils.data.DataLoader (worker processes), side by side in one run: per-batch overhead
and time to the first batch.

Datasets (map-style classes, as a user writes them):
  * scalars: __getitem__ returns (float, int); batch 64; the loaders' own cost per batch;
  * tensors: __getitem__ returns a 3x224x224 uint8 tensor (a view of one preallocated tensor,
    cloned: 150 KB of memory traffic a sample) and an int; batch 256.
For each worker count, each loader is made fresh; "first batch" is the time from constructing
the loader to receiving batch 0, then batches/s over --batches batches after --warmup (median of
--runs). Busy cores: this process's and its children's CPU time over the measured wall time.
With --pin pinned, every loader pins (pin_memory=True); with --pin device, PyTorch's pins and
the loop copies each batch to the GPU (.cuda(non_blocking=True)), ferry's delivers on the GPU
(device=0), and the clock stops once the copies are done. There the row "threads, torch's pin"
runs ferry's worker threads with each batch pinned by torch on the worker, as before worker
threads' batches went through ferry's pin thread and device stage (Note [Thread batches through
the pipeline] in ferry/_python.py).
Usage: python_datasets.py [--workers 0,2,8] [--batches 200] [--warmup 20] [--runs 3] [--pin none|pinned|device]
"""
import argparse
import os
import platform
import resource
import statistics
import time

import torch
import torch.utils.data as tud

import ferry
import ferry._bridge


class Scalars:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return float(i), i % 10


class Tensors:
    def __init__(self, n):
        self.n = n
        self.base = torch.arange(3 * 224 * 224, dtype=torch.int32).to(torch.uint8).view(3, 224, 224)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.base.clone(), i % 1000


def cpu_seconds():
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def children_cpu(pids, waited=False):
    """CPU seconds of live worker processes (RUSAGE_CHILDREN counts only the ones reaped); with
    `waited`, also what each has counted of the children it reaped (a worker's curl, say)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15 if waited else 13]) / tick
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def worker_pids():
    """Every descendant of this process (torch's workers are its children; ferry's are children of
    the forkserver, a child of this process)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
    found, frontier = [], [os.getpid()]
    while frontier:
        nxt = [pid for pid, parent in parents.items() if parent in frontier]
        found.extend(nxt)
        frontier = nxt
    return found


def to_cuda(batch):
    return [x.cuda(non_blocking=True) if isinstance(x, torch.Tensor) else x for x in batch]


def measure(make, warmup, batches, move=None):
    t0 = time.perf_counter()
    loader = make()
    it = iter(loader)
    move = move or (lambda b: b)
    move(next(it))
    first = time.perf_counter() - t0
    for _ in range(warmup):
        move(next(it))
    pids = worker_pids()
    c0, k0 = cpu_seconds(), children_cpu(pids)
    t1 = time.perf_counter()
    for _ in range(batches):
        move(next(it))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t1
    busy = (cpu_seconds() - c0 + children_cpu(pids) - k0) / wall
    del it, loader
    return batches / wall, first, busy


def main():  # noqa: C901
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="0,2,8")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--datasets", default="scalars,tensors")
    ap.add_argument("--pin", choices=("none", "pinned", "device"), default="none")
    args = ap.parse_args()
    pin = args.pin != "none"
    ferry_pin = {"device": 0} if args.pin == "device" else {"pin_memory": pin}
    torch_move = to_cuda if args.pin == "device" else None
    print(f"# Python datasets: ferry.DataLoader (processes, threads) vs torch.utils.data.DataLoader (processes); "
          f"{os.cpu_count()} vCPUs, Python {platform.python_version()}, torch {torch.__version__}; "
          f"{args.batches} batches after {args.warmup}, median of {args.runs}; batches {args.pin}"
          f"{' (' + torch.cuda.get_device_name(0) + ')' if torch.cuda.is_available() else ''}\n")
    old = "| ferry threads, torch's pin | / torch " if pin else ""
    print("| dataset | workers | torch batches/s | ferry processes | / torch | ferry threads | / torch "
          f"{old}| first batch (s): torch, ferry processes, ferry threads | busy cores: torch, processes, threads |")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if pin else "") + "---|---|")
    for name in args.datasets.split(","):
        batch = 64 if name == "scalars" else 256
        need = (args.batches + args.warmup + 2) * batch
        ds = Scalars(need) if name == "scalars" else Tensors(need)
        for w in (int(v) for v in args.workers.split(",")):
            makers = {
                "torch": lambda ds=ds, batch=batch, w=w: tud.DataLoader(ds, batch_size=batch, num_workers=w, pin_memory=pin),
                "process": lambda ds=ds, batch=batch, w=w: ferry.DataLoader(ds, batch_size=batch, num_workers=w, **ferry_pin),
                "thread": lambda ds=ds, batch=batch, w=w: ferry.DataLoader(ds, batch_size=batch, num_workers=w, worker_type="thread", **ferry_pin),
            }
            if pin:
                makers["thread-torch-pin"] = makers["thread"]
            rows = {k: [] for k in makers}
            for _ in range(args.runs):
                for k, make in makers.items():
                    real = ferry._bridge.host_batch
                    if k == "thread-torch-pin":  # each batch pinned by torch on the worker, moved by this loop
                        ferry._bridge.host_batch = lambda b: None
                    try:
                        move = torch_move if k in ("torch", "thread-torch-pin") else None
                        rows[k].append(measure(make, args.warmup, args.batches, move))
                    finally:
                        ferry._bridge.host_batch = real
            m = {k: [statistics.median(v[i] for v in rows[k]) for i in range(3)] for k in rows}
            t, p, h = m["torch"], m["process"], m["thread"]
            before = ""
            if pin:
                o = m["thread-torch-pin"]
                before = f"{o[0]:,.0f} | {o[0] / t[0]:.2f} | "
            print(f"| {name} (batch {batch}) | {w} | {t[0]:,.0f} | {p[0]:,.0f} | {p[0] / t[0]:.2f} | {h[0]:,.0f} | "
                  f"{h[0] / t[0]:.2f} | {before}{t[1]:.3f}, {p[1]:.3f}, {h[1]:.3f} | {t[2]:.1f}, {p[2]:.1f}, {h[2]:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
