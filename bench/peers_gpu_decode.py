"""Peers of bench_gpu_decode on the same image folder, in one run (scripts/gpu.sh bench):
torchvision's batched GPU decode (decode_jpeg on cuda) followed by its RandomResizedCrop + flip +
normalize on the GPU, decode alone, and PyTorch's DataLoader over torchvision's ImageFolder (PIL)
with 16 workers. Images/s, median of --runs epochs after a warm-up; the CPU cores the process kept
busy (children included for the DataLoader)."""
import argparse, glob, os, resource, time

import torch
import torchvision
from torchvision.io import decode_jpeg, read_file
import torchvision.transforms as T1
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as F


def cpu_seconds():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def timed(fn, runs):
    rows = []
    for r in range(runs + 1):
        c0, t0 = cpu_seconds(), time.perf_counter()
        n = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if r:
            rows.append((n / wall, (cpu_seconds() - c0) / wall))
    rows.sort()
    return rows[len(rows) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=16)
    a = ap.parse_args()
    files = sorted(glob.glob(os.path.join(a.root, "*", "*.jpg")))
    datas = [read_file(f) for f in files]
    B = 256
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(3, 1, 1)

    def decode_only():
        n = 0
        for i in range(0, len(datas) - B + 1, B):
            decode_jpeg(datas[i:i + B], device="cuda")
            n += B
        return n

    def decode_and_crop():
        n = 0
        for i in range(0, len(datas) - B + 1, B):
            imgs = decode_jpeg(datas[i:i + B], device="cuda")
            out = []
            for img in imgs:
                top, left, h, w = T1.RandomResizedCrop.get_params(img, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
                x = F.resized_crop(img, top, left, h, w, [224, 224], antialias=False)
                if torch.rand(1).item() < 0.5:
                    x = F.horizontal_flip(x)
                out.append(x)
            batch = (torch.stack(out).float() / 255 - mean) / std
            n += batch.shape[0]
        return n

    print(f"peers_gpu_decode: {len(files)} images, torch {torch.__version__}, torchvision {torchvision.__version__}, "
          f"{torch.cuda.get_device_name()}")
    print("| pipeline | images/s | busy cores | images/s per busy core |\n|---|---:|---:|---:|")
    for name, fn in [("torchvision decode_jpeg on cuda, batched, decode alone", decode_only),
                     ("torchvision decode_jpeg on cuda + resized_crop + flip + normalize", decode_and_crop)]:
        ips, busy = timed(fn, a.runs)
        print(f"| {name} | {ips:.0f} | {busy:.2f} | {ips / max(busy, 1e-9):.0f} |", flush=True)

    tf = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(), T.ToImage(),
                    T.ToDtype(torch.float32, scale=True), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(a.root, transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=B, shuffle=True, num_workers=a.workers, pin_memory=True,
                                     persistent_workers=True)

    def dataloader():
        n = 0
        for x, _y in dl:
            x = x.cuda(non_blocking=True)
            n += x.shape[0]
        return n

    ips, busy = timed(dataloader, a.runs)
    print(f"| PyTorch DataLoader + torchvision ImageFolder (PIL), {a.workers} workers, pin_memory | {ips:.0f} | {busy:.2f} | "
          f"{ips / max(busy, 1e-9):.0f} |", flush=True)


if __name__ == "__main__":
    main()
