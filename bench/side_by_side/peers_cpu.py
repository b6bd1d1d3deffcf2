#!/usr/bin/env python3
"""PyTorch's DataLoader on the CPU side-by-side workloads (bench/side_by_side/run_cpu.sh).

(A) Fashion-MNIST train set in memory (uint8 28x28), per sample: random horizontal flip (p=0.5),
    to float in [0, 1], normalize (0.2860, 0.3530); batch 256, shuffled.
(B) 60000 rows of 784 float32 from one .npy file (in memory), no per-sample work; batch 256, shuffled.
Each setting: one warm-up epoch, then the median samples/s of 3 epochs. Prints JSON lines.
"""
import argparse
import gzip
import json
import statistics
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims).copy())


class FashionAugmented(Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        x = self.images[i]
        if torch.rand(()) < 0.5:
            x = torch.flip(x, dims=[1])
        x = (x.float() / 255.0 - 0.2860) / 0.3530
        return x.unsqueeze(0), int(self.labels[i])


class Rows(Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i % 10


def measure(ds, workers, epochs=3):
    loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=workers,
                        persistent_workers=workers > 0)
    def epoch():
        n = 0
        for x, _y in loader:
            n += x.shape[0]
        return n
    epoch()
    rates = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        n = epoch()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--rows", required=True, help=".npy file of (B)'s rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    images = read_idx(f"{args.data}/train-images-idx3-ubyte.gz")
    labels = read_idx(f"{args.data}/train-labels-idx1-ubyte.gz")
    rows = torch.from_numpy(np.load(args.rows))
    for w in [int(x) for x in args.workers.split(",")]:
        for name, ds in (("A", FashionAugmented(images, labels)), ("B", Rows(rows))):
            print(json.dumps({"peer": f"torch {torch.__version__} DataLoader", "workload": name, "workers": w,
                              "samples_per_second": measure(ds, w)}), flush=True)


if __name__ == "__main__":
    main()
