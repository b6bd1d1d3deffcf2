#!/usr/bin/env python3
"""Where a Python dataset's worker processes spend their CPU, under ferry and under PyTorch.

torchvision's ImageFolder recipe (RandomResizedCrop 224, flip, ToTensor, Normalize) on a folder of
JPEGs, the loader alone (no training step), --batches batches after --warmup. Each worker
process profiles its own main thread with cProfile from worker_init_fn to its exit (the same hook
for both loaders), and each loader's line gives the workers' CPU seconds an image (their
/proc times over the measured batches) and the functions that took the most of it.
Usage: profile_workers.py --images DIR [--workers 15] [--batches 40] [--loaders torch,ferry]
"""
import argparse
import cProfile
import glob
import io
import multiprocessing.util
import os
import pstats
import tempfile
import time

import torch
import torchvision

import ferry
from resnet_loaders import cpu_by_task  # a sibling script: its folder is on sys.path

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class Profiled:
    """worker_init_fn: profiles the worker process's main thread until the process ends."""

    def __init__(self, folder):
        self.folder = folder

    def __call__(self, worker_id):
        prof = cProfile.Profile()
        path = os.path.join(self.folder, f"worker-{os.getpid()}.prof")

        def dump():
            prof.disable()
            prof.dump_stats(path)

        multiprocessing.util.Finalize(None, dump, exitpriority=100)
        prof.enable()


def descendants_cpu():
    """CPU seconds so far of this process's descendants (resnet_loaders.cpu_by_task's breakdown)."""
    return sum(secs for task, secs in cpu_by_task().items() if task.startswith("descendants'"))


def forever(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--loaders", default="torch,ferry")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    t = torchvision.transforms
    recipe = t.Compose([t.RandomResizedCrop(224), t.RandomHorizontalFlip(), t.ToTensor(), t.Normalize(MEAN, STD)])
    dataset = torchvision.datasets.ImageFolder(args.images, transform=recipe)
    print(f"# {len(dataset)} images, batch {args.batch}, {args.workers} workers, {os.cpu_count()} vCPUs, "
          f"torch {torch.__version__}, torchvision {torchvision.__version__}\n")
    for name in args.loaders.split(","):
        folder = tempfile.mkdtemp(prefix=f"profile-{name}-")
        kw = dict(batch_size=args.batch, shuffle=True, num_workers=args.workers, persistent_workers=True,
                  worker_init_fn=Profiled(folder))
        loader = (torch.utils.data.DataLoader(dataset, **kw) if name == "torch" else ferry.DataLoader(dataset, **kw))
        it = forever(loader)
        for _ in range(args.warmup):
            next(it)
        c0, t0 = descendants_cpu(), time.perf_counter()
        for _ in range(args.batches):
            next(it)
        wall, cpu = time.perf_counter() - t0, descendants_cpu() - c0
        images = args.batches * args.batch
        it.close()
        del it, loader  # the workers end and write their profiles
        deadline = time.time() + 30
        while time.time() < deadline and len(glob.glob(os.path.join(folder, "*.prof"))) < args.workers:
            time.sleep(0.2)
        print(f"## {name}: {images / wall:,.0f} images/s, workers' CPU {cpu / wall:.1f} cores, "
              f"{cpu / images * 1e3:.2f} ms CPU an image")
        files = glob.glob(os.path.join(folder, "*.prof"))
        if files:
            out = io.StringIO()
            stats = pstats.Stats(*files, stream=out)
            stats.sort_stats("tottime").print_stats(args.top)
            text = out.getvalue()
            print("```\n" + text[text.find("ncalls") - 60 if "ncalls" in text else 0:].strip() + "\n```\n", flush=True)


if __name__ == "__main__":
    main()
