"""The most images/s any loader can make of torchvision's ImageFolder recipe on this host.

The recipe's own work (PIL's decode, RandomResizedCrop 224, the flip, ToTensor and Normalize: the
same calls bench/resnet_loaders.py's rows make, through ImageFolder.__getitem__) is run in P
processes side by side, each on its own share of the images, with no loader: no batches, no
collate, no copies, no training. What they make together is a ceiling for every loader running
that recipe unchanged on the same cores, PyTorch's DataLoader and ferry's alike; the CPU an image
they spend is the recipe's alone.

Each process is forked before any thread starts here, warms up for --warmup seconds, then counts
the images it finishes and the CPU it spends over the same --seconds window as the others.

With --batch B > 1, each process also collates its samples into batches of B (image, label), into
memory kept across batches, as a worker process does: `--stack held` holds a batch's samples and
stacks them once all are made (torch's default_collate's way: ferry's slab collate, Note
[Collated into the slab]); `--stack streamed` copies each sample's tensors into the batch's rows
as the sample is made (Note [Samples stacked as they come]). Both run ferry's own code over a
block of its pool.

    python3 bench/recipe_ceiling.py --images /tmp/ferry-photos300 --procs 8,15,16 --seconds 20
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import time


def tune_malloc() -> None:
    """glibc's malloc told to keep what it frees, as ferry's worker processes tell it (Note [A
    worker's freed memory kept] in ferry/_worker.py)."""
    from ferry import _worker

    if not _worker.keep_freed_memory():
        raise SystemExit("mallopt refused")


def one(images: str, rank: int, procs: int, start: float, warmup: float, seconds: float, batch: int, tune: bool,
        stack: str, out) -> None:
    import resource

    import torch
    import torchvision
    import torchvision.transforms as t

    if tune:
        tune_malloc()
    torch.set_num_threads(1)  # as a DataLoader's workers run
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    recipe = t.Compose([t.RandomResizedCrop(224), t.RandomHorizontalFlip(), t.ToTensor(), t.Normalize(mean, std)])
    data = torchvision.datasets.ImageFolder(images, transform=recipe)
    torch.manual_seed(rank)
    order = torch.randperm(len(data)).tolist()[rank::procs]
    begin, end = start + warmup, start + warmup + seconds
    done, k = 0, 0
    cpu0 = t0 = None
    faults0 = 0
    held: list = []
    side = placer = None
    if batch > 1:
        from ferry import _ferry, _slabs

        need = batch * (3 * 224 * 224 * 4 + 8) + (1 << 20)
        blocks = _ferry.SharedBlocks(False, need)
        block = blocks.lease(need, True, 1)
        side = _slabs.ProcessSlabs()
        side.add(block.id, block.size, os.dup(block.fd))
    while True:
        now = time.monotonic()
        if t0 is None and now >= begin:  # (a process whose imports ran past the warm-up counts from here)
            cpu0, t0, done = time.process_time(), now, 0
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if now >= end:
            break
        if stack == "streamed" and placer is None:
            placer = side.placer(block.id, batch)
        sample = data[order[k % len(order)]]
        k += 1
        done += 1
        if batch > 1:  # collated into memory kept across batches, as a worker process does
            held.append(sample if stack == "held" else placer.take(sample))
            if len(held) == batch:
                side.collate(held, block.id, None if stack == "held" else placer)
                held, placer = [], None
        del sample
    if t0 is None:
        out.put((0, 0.0, 0.0, 0))
    else:
        out.put((done, time.process_time() - cpu0, time.monotonic() - t0,
                 resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", required=True, help="an ImageFolder root (class folders of JPEGs)")
    ap.add_argument("--procs", default="15,16", help="process counts to run, comma-separated")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", default="1", help="samples a batch, collated as --stack says (1: no batches), "
                    "comma-separated")
    ap.add_argument("--malloc", default="glibc", help="glibc (as it is), tuned (keeps what it frees), or both")
    ap.add_argument("--stack", default="streamed", help="with --batch, comma-separated: held (stacked once all are "
                    "made) or streamed (each sample into its rows as it comes); both: the two")
    args = ap.parse_args()
    ctx = multiprocessing.get_context("fork")  # nothing here has started a thread
    import torch
    import torchvision

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"# The recipe's own work in P processes, no loader: {os.cpu_count()} vCPUs ({cpu}), {platform.platform()}, "
          f"torch {torch.__version__}, torchvision {torchvision.__version__}, images {args.images}, "
          f"{args.seconds:g} s counted after {args.warmup:g} s\n")
    print("| processes | batch | stacked | malloc | images/s | busy cores | ms of CPU an image | page faults an image |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    mallocs = ["glibc", "tuned"] if args.malloc == "both" else [args.malloc]
    stacks = ["held", "streamed"] if args.stack == "both" else args.stack.split(",")
    if set(stacks) - {"held", "streamed"}:
        raise SystemExit(f"--stack {args.stack}: held, streamed or both")
    runs = [(int(p), int(b), st, m) for p in args.procs.split(",") for b in args.batch.split(",")
            for st in (stacks if int(b) > 1 else ["-"]) for m in mallocs]
    for procs, batch, stack, how in runs:
        out = ctx.Queue()
        start = time.monotonic() + 1.0  # every process forked and importing before the clock starts
        ps = [ctx.Process(target=one, args=(args.images, r, procs, start, args.warmup, args.seconds, batch,
                                            how == "tuned", stack, out))
              for r in range(procs)]
        for p in ps:
            p.start()
        got = [out.get(timeout=args.warmup + args.seconds + 120) for _ in ps]
        for p in ps:
            p.join()
        if any(g[2] <= 0 for g in got):
            raise SystemExit(f"{procs} processes: a process counted nothing (imports longer than the warm-up?)")
        rate = sum(g[0] / g[2] for g in got)  # each over its own counted window
        busy = sum(g[1] / g[2] for g in got)
        faults = sum(g[3] for g in got) / max(1, sum(g[0] for g in got))
        print(f"| {procs} | {batch if batch > 1 else '-'} | {stack} | {how} | {rate:,.0f} | {busy:.1f} | {1000 * busy / rate:.2f} | "
              f"{faults:.0f} |", flush=True)


if __name__ == "__main__":
    main()
