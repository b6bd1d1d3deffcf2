#!/usr/bin/env python3
"""PyTorch's DataLoader on bench_pin's workloads, for the side-by-side table (run on a GPU host).

Same data shape, batch 256, samples drawn with replacement as bench_pin does; each batch is moved
with .to('cuda', non_blocking=True) and the stream is synchronized at the end of each pass.
Median of 3 timed passes after a warm-up pass. Usage: peers_torch.py [--batches N]
"""
import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


def rate(batches, loader):
    def one_pass():
        n = 0
        for (x,) in loader:
            x.to("cuda", non_blocking=True)
            n += 1
        torch.cuda.synchronize()
        return n

    one_pass()
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        n = one_pass()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--workers", default="6,8,12")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    print(f"# peers_torch — torch {torch.__version__}, {torch.cuda.get_device_name(0)}, median of 3 passes")
    for name, shape, dtype, samples, batches in [
        ("(a) 3x224x224 uint8", (3, 224, 224), torch.uint8, 2048, args.batches),
        ("(b) 784 float32", (784,), torch.float32, 60000, args.batches * 10),
    ]:
        data = (torch.arange(samples * int(torch.tensor(shape).prod())) * 131 + 7).to(dtype).reshape(samples, *shape)
        mb = data[0].numel() * data.element_size() * 256 / 1e6
        print(f"\n## {name}: batch 256 = {mb:.2f} MB, {batches} batches per pass\n")
        print("| pipeline | workers | batches/s | GB/s |\n|---|---:|---:|---:|")
        ds = TensorDataset(data)
        for pin in (True, False):
            for w in workers:
                sampler = RandomSampler(ds, replacement=True, num_samples=batches * 256)
                loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=w, pin_memory=pin,
                                    persistent_workers=True, prefetch_factor=2)
                r = rate(batches, loader)
                print(f"| torch DataLoader, pin_memory={pin} | {w} | {r:.0f} | {r * mb / 1e3:.1f} |", flush=True)
                del loader


def training_loop(step_ms, steps, workers, pin):
    """Each step: step_ms of GPU work (torch.cuda._sleep) on the batch, then synchronize. GPU waiting
    for data = 1 - steps * baseline / wall, the baseline being the same step with no loader."""
    data = torch.full((2048, 3, 224, 224), 3, dtype=torch.uint8)
    ds = TensorDataset(data)
    sampler = RandomSampler(ds, replacement=True, num_samples=(steps + 10) * 256)
    loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=workers, pin_memory=pin, prefetch_factor=2)
    # Calibrate _sleep's cycles per millisecond.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    cycles_per_ms = 100_000_000 / ((time.perf_counter() - t0) * 1e3)
    # Baseline: the identical step with no data loading (as bench_pin does).
    t0 = time.perf_counter()
    for _ in range(30):
        torch.cuda._sleep(int(step_ms * cycles_per_ms))
        torch.cuda.synchronize()
    base_ms = (time.perf_counter() - t0) * 1e3 / 30
    step = 0
    for (x,) in loader:
        if step == 10:
            t0 = time.perf_counter()
        if step == steps + 10:
            break
        x = x.to("cuda", non_blocking=True)
        torch.cuda._sleep(int(step_ms * cycles_per_ms))
        torch.cuda.synchronize()
        step += 1
    wall = (time.perf_counter() - t0) * 1e3
    print(f"| torch DataLoader, pin_memory={pin}, {workers} workers | {base_ms:.2f} ms | {steps} | {wall:.0f} ms | "
          f"{100 * max(0.0, 1 - steps * base_ms / wall):.2f}% |", flush=True)


if __name__ == "__main__":
    main()
    print("\n## training loop: (a) batches, GPU work per step, synchronize each step\n")
    print("| loader | step alone (baseline) | steps | wall | GPU waiting for data |\n|---|---:|---:|---:|---:|")
    for ms in (10.0, 20.0):
        for pin in (True, False):
            training_loop(ms, 200, 8, pin)
