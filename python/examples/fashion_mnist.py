#!/usr/bin/env python3
"""ferry's Fashion-MNIST demo in Python: a torch MLP (784-256-10, SGD with momentum) trained on
batches from ferry.DataLoader, the same model and data as examples/fashion_mnist (C++).

    python3 python/examples/fashion_mnist.py --epochs 3            # CPU, or --device 0 for a GPU

The loader's workers flip, convert and normalize every image in C++; Python sees only batches.
One epoch reaches about 84% test accuracy, which needs images and labels paired through every
stage (--min-accuracy makes the run fail below a bound: the CTest entry python_demo uses it).
"""
import argparse
import sys
import time

import torch

import ferry

DATA = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist


def dataset(data, split, flip):
    prefix = "train" if split == "train" else "t10k"
    return ferry.datasets.idx(f"{data}/{prefix}-images-idx3-ubyte.gz", f"{data}/{prefix}-labels-idx1-ubyte.gz",
                              flip=flip, mean=0.2860, std=0.3530)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--device", type=int, default=None, help="CUDA device (default: the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 if the last test accuracy is below")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cpu" if args.device is None else f"cuda:{args.device}")
    train = ferry.DataLoader(dataset(args.data, "train", flip=True), batch_size=args.batch_size, shuffle=True,
                             num_workers=args.workers, seed=args.seed, device=args.device)
    test = ferry.DataLoader(dataset(args.data, "test", flip=False), batch_size=1000, num_workers=args.workers,
                            device=args.device)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    print(f"ferry demo (Python): MLP 784-256-10 on Fashion-MNIST ({len(train.dataset)} train, "
          f"{len(test.dataset)} test images), {device}, batch {args.batch_size}, {args.workers} workers, torch "
          f"{torch.__version__}")

    accuracy = 0.0
    for epoch in range(args.epochs):
        t0, seen, correct, loss_sum = time.perf_counter(), 0, 0, 0.0
        model.train()
        for images, labels in train:
            out = model(images)
            loss = torch.nn.functional.cross_entropy(out, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(labels)
            loss_sum += loss.item() * len(labels)
            correct += (out.argmax(1) == labels).sum().item()
        seconds = time.perf_counter() - t0
        model.eval()
        test_correct, test_seen = 0, 0
        with torch.no_grad():
            for images, labels in test:
                test_correct += (model(images).argmax(1) == labels).sum().item()
                test_seen += len(labels)
        accuracy = test_correct / test_seen
        print(f"epoch {epoch + 1}: train loss {loss_sum / seen:.4f}, train accuracy {100 * correct / seen:.1f}%, "
              f"test accuracy {100 * accuracy:.1f}% ({seconds:.2f} s, {seen / seconds:,.0f} images/s)", flush=True)
    print("\nloader report (training loader, all epochs):")
    print(train.stats())
    if accuracy < args.min_accuracy:
        print(f"test accuracy {100 * accuracy:.1f}% is below --min-accuracy {100 * args.min_accuracy:.1f}%",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
