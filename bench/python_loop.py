#!/usr/bin/env python3
"""ferry from Python against ferry's C++ loop and PyTorch's DataLoader, on a GPU host.

Workloads (batch 256, delivered on cuda:0): (a) rows of 3x224x224 uint8 and (b) rows of 784
float32, both from a .npy (memory-mapped), and, with --images, JPEGs decoded on the GPU
(RandomResizedCrop 224 + flip + normalize to float). Rows:
  * throughput: ferry.DataLoader iterated by Python, the same loader's options iterated by a C++
    loop in the same process (ferry._ferry.cpp_seconds), and torch.utils.data.DataLoader over the
    same rows (pin_memory, .to(cuda, non_blocking=True)); median of --runs passes after a warm-up;
  * training loop: a 10 ms GPU step (torch.cuda._sleep, synchronized each step) per batch; GPU
    waiting for data = 1 - steps x step alone / wall, and the share of the wall spent waiting for
    epochs' first batches ((a)'s file is 16 batches an epoch; both loaders restart each epoch);
  * time to first batch: DataLoader(...) to the first batch in hand.
Usage: python_loop.py --data DIR [--images DIR] [--batches 400] [--runs 3]
"""
import argparse
import os
import resource
import statistics
import time

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchLoader, Dataset as TorchDataset, RandomSampler

import ferry
from ferry import _ferry


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def py_pass(make, warmup, batches):
    """Seconds and busy cores for `batches` batches after `warmup`, iterating epochs as needed, from
    a fresh loader (as cpp_pass's C++ loop makes one)."""
    loader = make()
    n, t0, c0 = 0, time.perf_counter(), cpu_seconds()
    while n < warmup + batches:
        for _ in loader:
            n += 1
            if n == warmup:
                torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), cpu_seconds()
            if n == warmup + batches:
                break
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return wall, (cpu_seconds() - c0) / wall


def cpp_pass(make, warmup, batches):
    loader = make()
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    seconds = _ferry.cpp_seconds(loader.dataset, loader._options, warmup, batches)
    torch.cuda.synchronize()
    return seconds, (cpu_seconds() - c0) / (time.perf_counter() - t0)


class NpyRows(TorchDataset):
    def __init__(self, path):
        self.path, self.rows = path, None
        self.n = np.load(path, mmap_mode="r").shape[0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.rows is None:  # opened in each worker process
            self.rows = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.array(self.rows[i]))


def torch_loader(path, workers):
    # Shuffled epochs of the whole file, as ferry's (shuffle=True): both pay each epoch's start.
    ds = NpyRows(path)
    return TorchLoader(ds, batch_size=256, sampler=RandomSampler(ds), num_workers=workers, pin_memory=True,
                       persistent_workers=workers > 0, prefetch_factor=2 if workers else None)


def torch_pass(loader, warmup, batches):
    n, t0 = 0, time.perf_counter()
    while n < warmup + batches:
        for x in loader:
            x.to("cuda", non_blocking=True)
            n += 1
            if n == warmup:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            if n == warmup + batches:
                break
    torch.cuda.synchronize()
    return time.perf_counter() - t0, float("nan")


def median_rate(fn, loader, warmup, batches, runs):
    out = [fn(loader, warmup, batches) for _ in range(runs)]
    rates = [batches / s for s, _ in out]
    cores = [c for _, c in out]
    return statistics.median(rates), statistics.median(cores)


def calibrate():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return 100_000_000 / ((time.perf_counter() - t0) * 1e3)


def training_loop(loader, to_device, step_ms, steps, cycles_per_ms):
    """GPU waiting for data over `steps` steps (after 10), and the part of it spent at epochs' starts."""
    cycles = int(step_ms * cycles_per_ms)
    t0 = time.perf_counter()
    for _ in range(30):
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
    base_ms = (time.perf_counter() - t0) * 1e3 / 30
    step, t0, starts = 0, time.perf_counter(), 0.0
    it = iter(loader)
    while step < steps + 10:
        a = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)  # a new epoch: its first batch waits for the pipeline to fill
            batch = next(it)
            if step >= 10:
                starts += time.perf_counter() - a
        if step == 10:
            t0 = time.perf_counter()
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        if to_device:
            x = x.to("cuda", non_blocking=True)
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        step += 1
    wall = (time.perf_counter() - t0) * 1e3
    return base_ms, wall, max(0.0, 1 - steps * base_ms / wall), starts * 1e3 / wall


def first_batch_ms(make):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loader = make()
    next(iter(loader))
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, loader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder for the .npy files (made if missing)")
    ap.add_argument("--images", help="an image folder (root/<class>/<jpeg>) for the GPU-decode rows")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gathers", default="host,device",
                    help="the row paths to run: host (workers copy rows into pinned blocks), device (the GPU gathers "
                         "them from the registered .npy mapping)")
    args = ap.parse_args()
    os.makedirs(args.data, exist_ok=True)
    print(f"# python_loop — ferry {ferry.__version__} from Python {'.'.join(map(str, os.sys.version_info[:3]))}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {os.cpu_count()} CPUs; "
          f"median of {args.runs} passes of {args.batches} batches after a warm-up")
    workloads = []
    for name, shape, dtype, rows, workers in [("(a) 3x224x224 uint8", (3, 224, 224), np.uint8, 4096, 12),
                                             ("(b) 784 float32", (784,), np.float32, 60000, 10)]:
        path = os.path.join(args.data, f"rows-{'x'.join(map(str, shape))}-{np.dtype(dtype).name}.npy")
        if not os.path.exists(path):
            a = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows,) + shape)
            for s in range(0, rows, 1024):
                a[s:s + 1024] = (np.arange(s, min(rows, s + 1024)) % 251).reshape((-1,) + (1,) * len(shape))
            a.flush()
            del a
        workloads.append((name, path, workers))

    print("\n## throughput, batches on cuda:0\n")
    print("| workload | pipeline | workers | batches/s | busy cores | Python / C++ |\n|---|---|---:|---:|---:|---:|")
    gathers = args.gathers.split(",")
    batches = {"(a)": args.batches, "(b)": args.batches * 10, "img": args.batches // 4}
    for name, path, workers in workloads:
        paths = [(g, workers if g == "host" else 0) for g in gathers]
        key = name[:3]
        n = batches[key]
        for gather, w in paths:
            def make(path=path, w=w, gather=gather):
                return ferry.DataLoader(ferry.datasets.npy(path), batch_size=256, shuffle=True, num_workers=w,
                                        device=0, gather=gather)
            py, py_cores = median_rate(py_pass, make, 20, n, args.runs)
            cpp, cpp_cores = median_rate(cpp_pass, make, 20, n, args.runs)
            print(f"| {name} | ferry.DataLoader (Python), gather={gather} | {w} | {py:,.0f} | {py_cores:.2f} | "
                  f"{py / cpp:.2f} |")
            print(f"| {name} | ferry C++ loop, the same loader options | {w} | {cpp:,.0f} | {cpp_cores:.2f} | |",
                  flush=True)
        tl = torch_loader(path, workers)
        tr, _ = median_rate(torch_pass, tl, 20, n, args.runs)
        print(f"| {name} | torch DataLoader, pin_memory, .to(cuda) | {workers} | {tr:,.0f} | — | |", flush=True)
        del tl
    images = None if not args.images else ferry.datasets.image_folder(
        args.images, size=224, random_crop=True, decode="gpu", mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    if images is not None:
        def make():
            return ferry.DataLoader(images, batch_size=256, shuffle=True, num_workers=2, device=0)
        py, py_cores = median_rate(py_pass, make, 8, batches["img"], args.runs)
        cpp, cpp_cores = median_rate(cpp_pass, make, 8, batches["img"], args.runs)
        print(f"| images, GPU decode | ferry.DataLoader (Python) | 2 | {py:,.1f} ({py * 256:,.0f} images/s) | "
              f"{py_cores:.2f} | {py / cpp:.2f} |")
        print(f"| images, GPU decode | ferry C++ loop, the same loader options | 2 | {cpp:,.1f} ({cpp * 256:,.0f} "
              f"images/s) | {cpp_cores:.2f} | |", flush=True)

    cycles = calibrate()
    print("\n## training loop: 10 ms GPU step per batch of 256, synchronized each step\n")
    print("| workload | loader | workers | step alone | steps | wall | GPU waiting for data | of it, at epochs' starts |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for name, path, workers in workloads:
        paths = [(g, workers if g == "host" else 0) for g in gathers]
        for gather, w in paths:
            loader = ferry.DataLoader(ferry.datasets.npy(path), batch_size=256, shuffle=True, num_workers=w,
                                      device=0, gather=gather)
            base, wall, wait, starts = training_loop(loader, False, 10.0, args.steps, cycles)
            print(f"| {name} | ferry.DataLoader (Python), gather={gather} | {w} | {base:.2f} ms | {args.steps} | "
                  f"{wall:.0f} ms | {100 * wait:.2f}% | {100 * starts:.2f}% |", flush=True)
            del loader
        tl = torch_loader(path, workers)
        base, wall, wait, starts = training_loop(tl, True, 10.0, args.steps, cycles)
        print(f"| {name} | torch DataLoader, pin_memory | {workers} | {base:.2f} ms | {args.steps} | {wall:.0f} ms | "
              f"{100 * wait:.2f}% | {100 * starts:.2f}% |", flush=True)
        del tl
    if images is not None:
        loader = ferry.DataLoader(images, batch_size=256, shuffle=True, num_workers=2, device=0)
        base, wall, wait, starts = training_loop(loader, False, 10.0, args.steps // 2, cycles)
        print(f"| images, GPU decode | ferry.DataLoader (Python) | 2 | {base:.2f} ms | {args.steps // 2} | "
              f"{wall:.0f} ms | {100 * wait:.2f}% | {100 * starts:.2f}% |", flush=True)
        del loader

    print("\n## time to first batch ((a), batch 256, on cuda:0)\n")
    print("| loader | workers | first batch |\n|---|---:|---:|")
    path = workloads[0][1]
    for gather, w in [("host", 12), ("host", 16)] + [("device", 0)] * ("device" in gathers):
        ms, loader = first_batch_ms(lambda w=w, gather=gather: ferry.DataLoader(ferry.datasets.npy(path), batch_size=256, shuffle=True,
                                                             num_workers=w, device=0, gather=gather))
        print(f"| ferry.DataLoader (Python), gather={gather} | {w} | {ms:.0f} ms |", flush=True)
        del loader
    for w in (12, 16):
        ms, tl = first_batch_ms(lambda w=w: torch_loader(path, w))
        print(f"| torch DataLoader, pin_memory | {w} | {ms:.0f} ms |", flush=True)
        del tl


if __name__ == "__main__":
    main()
