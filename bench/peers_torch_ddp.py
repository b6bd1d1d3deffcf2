#!/usr/bin/env python3
"""PyTorch's DataLoader per GPU under torchrun: the peer of bench_multi_gpu's ranks (a GPU host).

  torchrun --standalone --nproc-per-node 2 bench/peers_torch_ddp.py [--cpu-slices 2] [--workers-a 8] [--workers-b 6]

Each rank: the workload's rows drawn with replacement (as bench_pin and bench_multi_gpu), batch
256, pin_memory=True, each batch moved with .to(cuda:LOCAL_RANK, non_blocking=True); all ranks
start each pass together (a barrier through NCCL); median of --runs passes after a warm-up pass.
The loop row: 10 ms of GPU work a step (torch.cuda._sleep), synchronized each step; GPU waiting
for data = 1 - steps x the step alone / wall. --cpu-slices K binds rank r to the r-th of K equal
slices of the CPUs it may use (its workers inherit it).
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--workers-a", type=int, default=8)
    ap.add_argument("--workers-b", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--cpu-slices", type=int, default=0)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.cpu_slices:
        cpus = sorted(os.sched_getaffinity(0))
        per = len(cpus) // args.cpu_slices
        s = local % args.cpu_slices
        os.sched_setaffinity(0, cpus[s * per:(s + 1) * per])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    cpus = sorted(os.sched_getaffinity(0))
    tag = f"torch DataLoader under torchrun | {world} GPU{'s' if world > 1 else ''} busy"
    out = []

    def rate(loader, per_pass):
        rates = []
        for k in range(args.runs + 1):
            dist.barrier()
            t0 = time.perf_counter()
            for (x,) in loader:
                x.to(dev, non_blocking=True)
            torch.cuda.synchronize()
            if k:
                rates.append(per_pass / (time.perf_counter() - t0))
        return statistics.median(rates)

    for name, shape, dtype, samples, batches, w in [
        ("(a) 3x224x224 uint8", (3, 224, 224), torch.uint8, 2048, args.batches, args.workers_a),
        ("(b) 784 float32", (784,), torch.float32, 60000, args.batches * 20, args.workers_b),
    ]:
        data = (torch.arange(samples * int(torch.tensor(shape).prod())) * 131 + 7).to(dtype).reshape(samples, *shape)
        ds = TensorDataset(data)
        sampler = RandomSampler(ds, replacement=True, num_samples=batches * 256)
        loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=w, pin_memory=True,
                            persistent_workers=True, prefetch_factor=2)
        out.append((f"{name}, {w} workers", rate(loader, batches), "batches/s"))
        del loader

    # The training loop on (a) batches.
    data = torch.full((2048, 3, 224, 224), 3, dtype=torch.uint8)
    ds = TensorDataset(data)
    steps = args.steps
    sampler = RandomSampler(ds, replacement=True, num_samples=(steps + 10) * 256)
    loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=args.workers_a, pin_memory=True, prefetch_factor=2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    cycles_per_ms = 100_000_000 / ((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(30):
        torch.cuda._sleep(int(args.step_ms * cycles_per_ms))
        torch.cuda.synchronize()
    base_ms = (time.perf_counter() - t0) * 1e3 / 30
    dist.barrier()
    step = 0
    for (x,) in loader:
        if step == 10:
            t0 = time.perf_counter()
        if step == steps + 10:
            break
        x = x.to(dev, non_blocking=True)
        torch.cuda._sleep(int(args.step_ms * cycles_per_ms))
        torch.cuda.synchronize()
        step += 1
    wall = (time.perf_counter() - t0) * 1e3
    out.append((f"loop: (a) batches, {args.step_ms:.0f} ms steps, GPU waiting", 100 * max(0.0, 1 - steps * base_ms / wall), "%"))
    cpu_text = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
    for row, v, unit in out:
        value = f"{v:.2f}" if unit == "%" else f"{v:.0f}"
        print(f"| {tag} | {row} | cuda:{local} | {value} {unit} | CPUs {cpu_text} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
