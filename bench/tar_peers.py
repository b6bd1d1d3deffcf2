"""turboloader's image loader over a tar of JPEGs, timed as bench_object_store times ferry's rows.

Reads the shard bench_object_store wrote with --keep-shards (the same bytes as its rows), with
turboloader's own RandomResizedCrop 224 + flip (``train_aug=True``) and ImageNet's mean/std, float,
shuffled, ``drop_last``; one loader, its first epoch untimed, then --runs epochs. Prints a Markdown
row: images/s (median), busy cores of this process, images/s a busy core, images an epoch.

    build/release/bench/bench_object_store --images 10260 --per-shard 10260 --workers 16 --batch 256 --drop-last \\
        --float --runs 3 --local-only --keep-shards /tmp/shards --only "indexed (TarImages)|stream (TarShards)"
    python3 bench/tar_peers.py /tmp/shards/train-000.tar --batch 256 --workers 16 --runs 3

turboloader comes from PyPI (``turboloader==2.39.0``); its fused path decodes on threads of its own
(``num_workers`` is passed, and busy cores say what it used).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tar", help="a tar of JPEG records (key.jpg + key.cls)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    import turboloader as tl

    loader = tl.DataLoader(
        args.tar,
        batch_size=args.batch,
        num_workers=args.workers,
        shuffle=True,
        image_size=224,
        output_format="pytorch",
        train_aug=True,
        drop_last=True,
        transform=tl.ImageNetNormalize(),
    )

    def epoch(e: int) -> tuple[int, float, float]:
        loader.set_epoch(e)
        c0, t0 = time.process_time(), time.perf_counter()
        n = 0
        for batch in loader:
            images = batch[0] if isinstance(batch, tuple) else batch
            n += int(images.shape[0])
        s = time.perf_counter() - t0
        return n, n / s, (time.process_time() - c0) / s

    epoch(0)  # untimed, as bench_object_store's rows
    rows = [epoch(e) for e in range(1, args.runs + 1)]
    rate = statistics.median(r[1] for r in rows)
    mid = sorted(rows, key=lambda r: r[1])[len(rows) // 2]
    print(
        f"| turboloader {tl.__version__} (DataLoader, train_aug) | local disk | {rate:.0f} | 1.00 | {mid[2]:.2f} | "
        f"{rate / mid[2]:.0f} | - | - | - | {mid[0]} |"
    )


if __name__ == "__main__":
    main()
