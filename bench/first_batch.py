#!/usr/bin/env python3
"""Time to the first batch from Python: ferry.DataLoader against torch.utils.data.DataLoader.

In-memory data, 2,048 samples of 3x224x224 uint8, batch 256 (38.5 MB), shuffled, pinned
(pin_memory=True where there is a GPU, the usual setting). Rows: PyTorch's DataLoader over a TensorDataset;
ferry over its own in-memory dataset (ferry.datasets.synthetic, made by C++ threads); ferry over the
same TensorDataset (a Python dataset: worker threads, and worker processes). Each figure is the
median of --runs new loaders, from DataLoader(...) to the first batch in hand; CUDA is started
once before the rows.

With --images DIR (an image folder: DIR/<class>/<image>.jpg), a second table: torchvision's ImageFolder
recipe (RandomResizedCrop 224 + flip + ToTensor + Normalize, PIL) through PyTorch's DataLoader,
against ferry's image_folder with the same crop, flip and normalize decoded on the CPU (pinned
batch in hand) and on the GPU (decode="gpu", device=0: the batch on the device, synchronized).
Usage: first_batch.py [--runs 5] [--workers 0,4,12] [--images DIR]
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
    ap.add_argument("--images", default="")
    args = ap.parse_args()
    pin = torch.cuda.is_available()
    if pin:
        torch.zeros(1).pin_memory()  # CUDA's start-up, once, before the rows
    x = torch.full((2048, 3, 224, 224), 7, dtype=torch.uint8)
    tensors = tud.TensorDataset(x)
    synthetic = ferry.datasets.synthetic(n=2048, shape=(3, 224, 224))
    table(args, pin, f"2,048 x 3x224x224 uint8 in memory, batch 256, shuffled, pin_memory={pin}; {os.cpu_count()} vCPUs, "
          f"torch {torch.__version__}",
          ["PyTorch, TensorDataset", "ferry, its in-memory dataset", "ferry, the TensorDataset, threads",
           "ferry, the TensorDataset, processes"],
          lambda w, kw: [lambda: tud.DataLoader(tensors, **kw), lambda: ferry.DataLoader(synthetic, **kw),
                         lambda: ferry.DataLoader(tensors, worker_type="thread", **kw),
                         (lambda: ferry.DataLoader(tensors, worker_type="process", **kw)) if w else None])
    if args.images:
        image_folder(args, pin)


def image_folder(args, pin):
    import torchvision.datasets as tvd
    import torchvision.transforms as T
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    recipe = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    torch_ds = tvd.ImageFolder(args.images, transform=recipe)
    cpu = ferry.datasets.image_folder(args.images, random_crop=True, mean=mean, std=std)
    gpu = ferry.datasets.image_folder(args.images, random_crop=True, mean=mean, std=std, decode="gpu") if pin else None

    def on_device(make):
        def made():
            loader = make()
            return _Synced(loader)
        return made

    print()
    table(args, pin, f"image folder {args.images} ({len(torch_ds)} JPEGs), batch 256, RandomResizedCrop 224 + flip + "
          f"normalize to float32, shuffled, pin_memory={pin}",
          ["PyTorch, torchvision ImageFolder (PIL)", "ferry, image_folder, CPU decode",
           'ferry, image_folder, decode="gpu" (batch on cuda:0)'],
          lambda w, kw: [lambda: tud.DataLoader(torch_ds, **kw), lambda: ferry.DataLoader(cpu, **kw),
                         on_device(lambda: ferry.DataLoader(gpu, batch_size=256, shuffle=True, num_workers=w, device=0))
                         if gpu is not None else None])


def table(args, pin, title, columns, makers):
    """A Markdown table: a row for each worker count, the first-batch time of each loader
    makers(w, kw) makes ("-" where it makes none)."""
    print(f"# first batch, ms (median of {args.runs}): {title}\n")
    print("| workers | " + " | ".join(columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for w in [int(v) for v in args.workers.split(",")]:
        kw = dict(batch_size=256, shuffle=True, num_workers=w, pin_memory=pin)
        row = [first_ms(make, args.runs) if make else float("nan") for make in makers(w, kw)]
        print(f"| {w} | " + " | ".join("-" if v != v else f"{v:.1f}" for v in row) + " |", flush=True)


class _Synced:
    """Iterates a loader whose batches are on the GPU, and waits for each before handing it over."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            torch.cuda.synchronize()
            yield batch


if __name__ == "__main__":
    main()
