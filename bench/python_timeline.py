"""When each batch arrives: a Python dataset (torchvision's ImageFolder recipe) through
ferry.DataLoader's worker processes and through torch.utils.data.DataLoader, the loader alone, the
same workers and batch. Prints seconds from iter() to batches 1, 2, 5, 10, 20, 40, 80, ... and the
steady rate between the last two marks, so that start-up and the steady rate read apart.
Usage: python_timeline.py --images DIR [--workers 15] [--batches 120] [--loaders ferry,torch]
"""
import argparse
import os
import sys
import time

import torch
import torchvision

import ferry

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--loaders", default="ferry,torch")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds between making each loader and iter(), as a script that builds its model "
                         "in between (times still count from iter())")
    ap.add_argument("--trace", default=None, help="write the first ferry loader's Chrome trace (its first 60 batches) here")
    args = ap.parse_args()
    t = torchvision.transforms
    recipe = t.Compose([t.RandomResizedCrop(224), t.RandomHorizontalFlip(), t.ToTensor(), t.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(args.images, transform=recipe)
    marks = [1, 2, 5, 10, 20, 40, 80, 120, 160, 240]
    print(f"# {len(ds)} images, batch {args.batch}, {args.workers} workers, {os.cpu_count()} vCPUs, torch {torch.__version__}"
          f"; iter() {args.settle:g} s after each loader was made; seconds from iter()")
    print("| loader | " + " | ".join(f"batch {m}" for m in marks if m <= args.batches) + " | steady images/s |")
    print("|---|" + "---:|" * (len([m for m in marks if m <= args.batches]) + 1))
    for name in args.loaders.split(","):
        t0 = time.perf_counter()
        if name.startswith("ferry"):
            # ferry, ferry-unordered (in_order=False), ferry-prefetch8 (prefetch_factor=8), ferry-threads
            extra = {"ferry-unordered": {"in_order": False}, "ferry-prefetch8": {"prefetch_factor": 8},
                     "ferry-threads": {"worker_type": "thread"}}.get(name, {})
            if args.trace:
                extra["trace_batches"] = 60
            loader = ferry.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                      drop_last=True, persistent_workers=True, **extra)
        else:
            loader = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                                 drop_last=True, persistent_workers=True)
        made = time.perf_counter() - t0
        time.sleep(args.settle)
        times, n = {}, 0
        t0 = time.perf_counter()
        while n < args.batches:
            for _ in loader:
                n += 1
                if n in marks:
                    times[n] = time.perf_counter() - t0
                if n >= args.batches:
                    break
        done = [m for m in marks if m in times]
        a, b = done[-2], done[-1]
        steady = (b - a) * args.batch / (times[b] - times[a])
        print(f"| {name} (made in {made:.2f} s) | " + " | ".join(f"{times[m]:.2f} s" for m in done) + f" | {steady:,.0f} |",
              flush=True)
        if name.startswith("ferry"):
            print(name, loader.stats(), file=sys.stderr, flush=True)
            if args.trace:
                loader.write_trace(args.trace)
                args.trace = None
        del loader


if __name__ == "__main__":
    main()
