#!/usr/bin/env python3
"""A process's first loader: seconds from making it to its first batch, ferry against PyTorch.

Each run is a fresh Python process that does what a training script does: imports torch,
torchvision and ferry (ferry's zygote starts at its import), starts CUDA, builds torchvision's
ImageFolder with the float recipe (RandomResizedCrop 224, RandomHorizontalFlip, ToTensor,
Normalize), then makes the loader, the one timed: from DataLoader(...) to the first batch on the
GPU, synchronized. Loaders: torch.utils.data.DataLoader (pin_memory=True, then
.cuda(non_blocking=True)); ferry.DataLoader on the same dataset with pin_memory=True (the same
copy); ferry.DataLoader with device=0. Batch 256, shuffled, drop_last, --workers worker processes.
The processes run one after another, the loaders taking turns, --runs of each; the table gives
the median and the range, and what the child saw at its start: the threads its process ran after
importing torch and torchvision (ferry forks its zygote from a process of one thread, else
starts a fresh interpreter) and the seconds its imports took.
--after-cuda: the script's ResNet-50 on the GPU (one step run) before ferry's import, so the CUDA
driver's threads run as ferry is imported.
Usage: first_loader.py --images DIR [--workers 15] [--runs 3] [--after-cuda]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LOADERS = ("torch", "ferry-pin", "ferry-device")


def child(which: str, images: str, workers: int, after_cuda: bool) -> None:
    t0 = time.perf_counter()
    import torch
    import torchvision
    import torchvision.transforms as T

    if after_cuda:  # the script's model on the GPU before ferry's import (CUDA's threads run)
        model = torchvision.models.resnet50().cuda()
        model(torch.zeros(2, 3, 224, 224, device="cuda")).sum().backward()
        torch.cuda.synchronize()
    threads = len(os.listdir("/proc/self/task"))
    names = sorted({open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")})
    import ferry
    from ferry import _zygote

    imports = time.perf_counter() - t0
    zygote = "none" if _zygote._zygote is None else ("fresh" if _zygote._zygote._popen else "forked")
    torch.zeros(1, device="cuda")  # a training script's model is on the GPU before its loader
    ds = torchvision.datasets.ImageFolder(images, T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]))
    args = dict(batch_size=256, shuffle=True, num_workers=workers, drop_last=True)
    t = time.perf_counter()
    if which == "torch":
        loader = torch.utils.data.DataLoader(ds, pin_memory=True, **args)
    elif which == "ferry-pin":
        loader = ferry.DataLoader(ds, pin_memory=True, **args)
    else:
        loader = ferry.DataLoader(ds, device=0, **args)
    x, y = next(iter(loader))
    x = x.cuda(non_blocking=True)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    print(json.dumps({"first": first, "imports": imports, "threads": threads, "zygote": zygote, "names": names}),
          flush=True)
    if hasattr(loader, "close"):
        loader.close()
    del x, y, loader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", required=True)
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", choices=LOADERS)
    ap.add_argument("--after-cuda", action="store_true",
                    help="a ResNet-50 on the GPU (a step run) before ferry's import, as in a script that imports it late")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.images, args.workers, args.after_cuda)
        return
    results: dict = {k: [] for k in LOADERS}
    for _ in range(args.runs):
        for which in LOADERS:
            out = subprocess.run([sys.executable, __file__, "--child", which, "--images", args.images, "--workers",
                                  str(args.workers)] + (["--after-cuda"] if args.after_cuda else []),
                                 capture_output=True, text=True, timeout=300)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode != 0 or not lines:
                print(f"{which}: exit {out.returncode}\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results[which].append(json.loads(lines[-1]))
    print(f"{args.workers} worker processes, batch 256, torchvision's float recipe over {args.images}; "
          f"one fresh process a run, {args.runs} runs a loader, taking turns"
          + ("; a ResNet-50 on the GPU before ferry's import" if args.after_cuda else "") + "\n")
    names = sorted({n for rs in results.values() for r in rs for n in r.get("names", [])})
    print(f"threads' names before ferry's import: {', '.join(names)}\n")
    print("| loader | first batch, median (s) | range (s) | threads after importing torch | zygote | imports (s) |")
    print("|---|---:|---:|---:|---|---:|")
    for which in LOADERS:
        rs = results[which]
        if not rs:
            print(f"| {which} | failed | | | | |")
            continue
        firsts = [r["first"] for r in rs]
        print(f"| {which} | {statistics.median(firsts):.2f} | {min(firsts):.2f}-{max(firsts):.2f} | "
              f"{'/'.join(sorted({str(r['threads']) for r in rs}))} | {'/'.join(sorted({r['zygote'] for r in rs}))} | "
              f"{statistics.median(r['imports'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
