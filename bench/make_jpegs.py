#!/usr/bin/env python3
"""Writes an ImageFolder of synthetic photographs-to-be (smooth gradients with noise, JPEG quality
90) for the Python benchmarks on a host without Debian's photographs: DIR/class_k/i.jpg, --classes
folders of --per-class 500x375 images. Needs PIL (torchvision's). Usage: make_jpegs.py DIR"""
import argparse
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np


def one(path_seed: tuple) -> None:
    from PIL import Image

    path, seed = path_seed
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:375, 0:500]
    base = rng.integers(0, 256, size=3)
    img = np.stack([(base[c] + x * (c + 1) // 3 + y * (3 - c) // 3) % 256 for c in range(3)], axis=-1)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(path, quality=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--classes", type=int, default=3)
    ap.add_argument("--per-class", type=int, default=57)
    args = ap.parse_args()
    jobs = []
    for c in range(args.classes):
        os.makedirs(os.path.join(args.dir, f"class_{c}"), exist_ok=True)
        jobs += [(os.path.join(args.dir, f"class_{c}", f"{i}.jpg"), c * 100003 + i) for i in range(args.per_class)]
    with ProcessPoolExecutor() as pool:
        list(pool.map(one, jobs, chunksize=8))
    print(f"{len(jobs)} JPEGs in {args.dir}")


if __name__ == "__main__":
    main()
