"""How much of their time ferry's worker processes wait between batches, on any machine.

A map-style Python dataset whose samples take --sample-ms each, spinning on the CPU (--work spin)
or sleeping (--work sleep: many workers on few cores), through ferry.DataLoader's worker
processes (persistent), while the loop holds the GIL --hold ms a batch (a training step's Python,
spinning). Reports batches/s against the workers' own rate (workers / (batch x sample time)) and,
for spinning samples, the worker processes' busy cores.

    python3 bench/probe_worker_wait.py --workers 1 --batch 32 --sample-ms 5 --work spin --hold 0,50,120
    python3 bench/probe_worker_wait.py --workers 15 --batch 16 --sample-ms 4 --work sleep --hold 0,2
    python3 bench/probe_worker_wait.py --workers 15 --batch 16 --sample-ms 4 --work sleep --hold 0 --spread 0,0.15,0.3

--spread gives the batches times that spread (one random factor a batch, the same on every run),
as the ResNet recipe's did (0.13-0.18 traced on the H200 host; Note [Refill under round-robin]).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

import torch

import ferry


class Samples:
    def __init__(self, seconds: float, spin: bool, batch: int = 1, spread: float = 0.0) -> None:
        self.seconds, self.spin, self.batch, self.spread = seconds, spin, batch, spread

    def __len__(self) -> int:
        return 10_000_000

    def __getitem__(self, i: int):
        seconds = self.seconds
        if self.spread:  # one factor a batch (the sampler is sequential): batch times spread by `spread`
            seconds *= max(0.05, random.Random(i // self.batch).gauss(1.0, self.spread))
        if self.spin:
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass
        else:
            time.sleep(seconds)
        return torch.zeros(3, 32, 32), i


def cpu_seconds(pids) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--work", choices=("spin", "sleep"), default="spin")
    ap.add_argument("--hold", default="0,50", help="ms the loop holds the GIL a batch, comma-separated")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=0.0, help="ms the loop then sleeps a batch (a GPU step: the "
                    "GIL released)")
    ap.add_argument("--spread", default="0", help="batch times' standard deviation over their mean, comma-separated "
                    "(as bench/sim_refill.py's)")
    args = ap.parse_args()
    ideal = args.workers / (args.batch * args.sample_ms / 1000)
    print(f"# {args.workers} worker processes, batches of {args.batch} samples of {args.sample_ms:g} ms ({args.work}), "
          f"the loop sleeping {args.step_ms:g} ms a batch; "
          f"{os.cpu_count()} vCPUs, {platform.platform()}, torch {torch.__version__}, ferry {ferry.__version__}\n")
    print("| batch times' spread | the loop holds the GIL a batch | batches/s | / the workers' rate | workers' busy cores |")
    print("|---:|---:|---:|---:|---:|")
    for spread, hold in ((float(v), float(h) / 1000) for v in args.spread.split(",") for h in args.hold.split(",")):
        loader = ferry.DataLoader(Samples(args.sample_ms / 1000, args.work == "spin", args.batch, spread),
                                  batch_size=args.batch, num_workers=args.workers, persistent_workers=True)
        it = iter(loader)
        for _ in range(args.warmup):
            next(it)
        pids = loader._pool.pids()
        c0, t0 = cpu_seconds(pids), time.perf_counter()
        for _ in range(args.batches):
            next(it)
            end = time.perf_counter() + hold
            while time.perf_counter() < end:  # the step's Python, the GIL held
                pass
            if args.step_ms:
                time.sleep(args.step_ms / 1000)
        wall = time.perf_counter() - t0
        rate = args.batches / wall
        busy = f"{(cpu_seconds(pids) - c0) / wall:.2f}" if args.work == "spin" else "-"
        print(f"| {spread:g} | {hold * 1000:g} ms | {rate:.2f} | {rate / ideal:.2f} | {busy} |", flush=True)
        del it, loader


if __name__ == "__main__":
    main()
