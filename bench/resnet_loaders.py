#!/usr/bin/env python3
"""ResNet-50 training fed by ferry and by PyTorch's DataLoader, side by side in one run.

The standard ImageNet recipe on a folder of JPEGs: RandomResizedCrop 224 + horizontal flip,
batch 256, ResNet-50 in bfloat16 autocast, channels_last, SGD. Rows (each a fresh loader, the
median of --runs passes of --steps steps after --warmup steps):
  * the GPU alone: the same steps on one batch already on the GPU (the rate no loader can pass);
  * ferry image_folder with mean/std (float32 batches), --workers workers, device=0, every other
    option left at its default (the configuration that used to stop at batch 0 on the pinned
    budget);
  * ferry image_folder, uint8 batches, normalized on the GPU in the step;
  * torch.utils.data.DataLoader + torchvision's ImageFolder with torchvision's recipe
    (RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize), the same workers,
    pin_memory=True, .to(cuda, non_blocking=True);
  * the same torchvision dataset, unchanged, through ferry.DataLoader (worker processes, device=0:
    pinned on the worker thread, copied on torch's stream), the same workers;
  * the uint8 recipe (PILToTensor instead of ToTensor + Normalize, normalized on the GPU in the
    step) through each of the two.
Busy host cores: every process's CPU time (/proc/stat, all cores) over the measured wall time.
First batch: seconds from making the loader to its first batch in hand (median of the runs), and
in the row's first run. Each run's ferry loader is closed and dropped after it (its stats()
kept for the slab counters), as a torch loader goes with its last reference.
With the defaults (8 + 30 steps of 256 of a 10,260-image folder) the measured steps lie inside
the first epoch; more steps cross epochs, where a loader without persistent workers starts its
workers again (rows with --steps 80 say what that costs).
Usage: resnet_loaders.py --images DIR [--workers 15] [--steps 30] [--warmup 8] [--runs 3] [--rows gpu,ferry-float,...]
"""
import argparse
import importlib
import sys
import os
import statistics
import time

import torch
import torchvision

ferry = None  # imported by main(): before the model, or with --import-after-model once it is on the GPU

BREAKDOWN = bool(os.environ.get("RESNET_STATS"))  # also print busy cores by process and thread
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def busy_jiffies():
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]) - idle


def thread_cpu(pid, tid, hz):
    """(name, CPU seconds so far) of thread `tid` of process `pid`, from /proc."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        text = f.read()
    rest = text.rsplit(")", 1)[1].split()
    return text[text.index("(") + 1:text.rindex(")")], (int(rest[11]) + int(rest[12])) / hz


def cpu_by_task():
    """CPU seconds so far by task: this process's threads by name; its descendants' (the worker
    processes, the forkserver) threads summed by name ("main" for each one's main thread);
    every other process's summed."""
    hz = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    parents, totals = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            parents[int(pid)] = int(rest[1])
            totals[int(pid)] = (int(rest[11]) + int(rest[12])) / hz
        except (OSError, IndexError):
            continue

    def mine(pid):
        seen = 0
        while pid > 1 and seen < 8:
            pid = parents.get(pid, 1)
            if pid == me:
                return True
            seen += 1
        return False

    out = {}

    def add(key, secs):
        out[key] = out.get(key, 0.0) + secs

    for pid, secs in totals.items():
        if pid != me and not mine(pid):
            add("other processes", secs)
            continue
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                name, secs = thread_cpu(pid, tid, hz)
                if pid == me:
                    add(f"main process: {name}", secs)
                else:
                    add(f"descendants' threads: {'main' if tid == str(pid) else name}", secs)
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_report(before, after, wall):
    """Busy cores by task over the measured window, the largest first."""
    rows = sorted(((after.get(k, 0.0) - before.get(k, 0.0)) / wall, k) for k in after)
    return "; ".join(f"{k} {c:.2f}" for c, k in reversed(rows) if c >= 0.05)


def wait_for_slabs(worker_id):
    """worker_init_fn of the `-waits` row: each worker process waits for the main process's answer
    to its ask for a slab at the batch's first sample (ferry before f09e82a), where it goes on
    making samples meanwhile."""
    from ferry import _worker

    answer = _worker.Asker.answer
    _worker.Asker.answer = lambda self, wait: answer(self, True)


def make_model():
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def step(model, opt, images, labels):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def run(batches, model, opt, prepare, warmup, steps, made_at):
    """Images/s and busy cores over `steps` steps after `warmup`, re-iterating epochs as needed,
    and the seconds from `made_at` (before the loader was made) to the first batch in hand."""
    n, t0, j0, first = 0, None, None, None
    hz = os.sysconf("SC_CLK_TCK")
    while True:
        for images, labels in batches():
            if first is None:
                first = time.perf_counter() - made_at
            if prepare is not None:  # None: the loader alone, no training step
                images, labels = prepare(images, labels)
                step(model, opt, images, labels)
            n += 1
            if n == warmup:
                torch.cuda.synchronize()
                t0, j0 = time.perf_counter(), busy_jiffies()
                tasks0 = cpu_by_task() if BREAKDOWN else None
            if n == warmup + steps:
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                if BREAKDOWN:
                    print(f"  busy cores by task: {cpu_report(tasks0, cpu_by_task(), wall)}", file=sys.stderr, flush=True)
                return steps * len(labels) / wall, (busy_jiffies() - j0) / hz / wall, first


def main():
    global ferry
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rows", default="gpu,ferry-float,ferry-uint8,torch")
    ap.add_argument("--trace", type=int, default=0, help="ferry's Python-dataset rows record their first N batches' "
                    "timelines (trace_batches) and write them to --trace-dir/trace-<row>.json")
    ap.add_argument("--trace-dir", default=".")
    ap.add_argument("--import-after-model", action="store_true",
                    help="import ferry after the model is on cuda:0 (CUDA's threads already running)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval (seconds): how soon a thread waiting for the GIL gets it")
    args = ap.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if not args.import_after_model:
        ferry = importlib.import_module("ferry")
    torch.backends.cudnn.benchmark = True
    model, opt = make_model()
    if args.import_after_model:  # CUDA started, its threads running, as a script importing ferry in main() has it
        ferry = importlib.import_module("ferry")
    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255

    def as_is(x, y):
        return x.contiguous(memory_format=torch.channels_last), y

    def normalize_uint8(x, y):  # uint8 HWC batches: NHWC is channels_last memory already
        x = x.permute(0, 3, 1, 2).float().sub_(mean).div_(std)
        return x, y

    def normalize_chw_uint8(x, y):
        x = x.cuda(non_blocking=True).float().sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)
        return x, y.cuda(non_blocking=True)

    def to_cuda(x, y):
        return x.cuda(non_blocking=True).contiguous(memory_format=torch.channels_last), y.cuda(non_blocking=True)

    fixed_x = torch.randn(args.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    fixed_y = torch.randint(0, 1000, (args.batch,), device="cuda")

    def gpu_alone():
        def forever():
            while True:
                yield fixed_x, fixed_y
        return forever

    def ferry_rows(normalized, persistent=False):
        ds = (ferry.datasets.image_folder(args.images, size=224, random_crop=True, mean=MEAN, std=STD) if normalized
              else ferry.datasets.image_folder(args.images, size=224, random_crop=True))
        loader = ferry.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers, device=0,
                                  drop_last=True, persistent_workers=persistent)  # every other option at its default
        return lambda: loader

    def torchvision_folder(uint8):
        t = torchvision.transforms
        tail = [t.PILToTensor()] if uint8 else [t.ToTensor(), t.Normalize(MEAN, STD)]
        recipe = t.Compose([t.RandomResizedCrop(224), t.RandomHorizontalFlip(), *tail])
        return torchvision.datasets.ImageFolder(args.images, transform=recipe)

    def torch_rows(uint8=False):
        loader = torch.utils.data.DataLoader(torchvision_folder(uint8), batch_size=args.batch, shuffle=True,
                                             num_workers=args.workers, pin_memory=True, drop_last=True,
                                             persistent_workers=True)
        return lambda: loader

    made = []  # ferry loaders of the last row, whose stats() are printed after it

    def ferry_python_rows(uint8=False, device=True, pin=True, worker_type="process", prefetch_factor=None, init=None,
                          seed=None):
        loader = ferry.DataLoader(torchvision_folder(uint8), batch_size=args.batch, shuffle=True,
                                  num_workers=args.workers, device=0 if device and not uint8 else None, pin_memory=pin,
                                  drop_last=True, persistent_workers=True, worker_type=worker_type,
                                  prefetch_factor=prefetch_factor, trace_batches=args.trace, worker_init_fn=init,
                                  seed=seed)
        made.append(loader)
        return lambda: loader

    rows = {
        "gpu": ("the GPU alone (a batch already on the GPU)", gpu_alone, as_is),
        "ferry-float": (f"ferry image_folder, mean/std (float32), {args.workers} workers, defaults", lambda: ferry_rows(True), as_is),
        "ferry-uint8": (f"ferry image_folder, uint8, {args.workers} workers", lambda: ferry_rows(False), normalize_uint8),
        "ferry-float-persistent": (f"ferry image_folder, mean/std (float32), {args.workers} persistent workers",
                                   lambda: ferry_rows(True, True), as_is),
        "torch": (f"torch DataLoader + torchvision ImageFolder recipe, {args.workers} workers", torch_rows, to_cuda),
        "ferry-torchvision": (f"ferry.DataLoader + the same torchvision ImageFolder recipe, {args.workers} worker processes",
                              ferry_python_rows, as_is),
        # Where the Python-dataset path loses time: the same batches with no device stage, pinned
        # or not, the consumer copying them with .cuda() as the torch row does.
        "ferry-torchvision-pinned": (f"ferry.DataLoader + the same recipe, {args.workers} worker processes, pin_memory, "
                                     "no device (the consumer copies)", lambda: ferry_python_rows(device=False), to_cuda),
        "ferry-torchvision-pageable": (f"ferry.DataLoader + the same recipe, {args.workers} worker processes, pageable "
                                       "batches (the consumer copies)", lambda: ferry_python_rows(device=False, pin=False),
                                       to_cuda),
        "ferry-torchvision-alone": (f"ferry.DataLoader + the same recipe, {args.workers} worker processes, the loader "
                                    "alone (no training step)", lambda: ferry_python_rows(device=False, pin=False), None),
        "ferry-torchvision-device-alone": (f"ferry.DataLoader + the same recipe, {args.workers} worker processes, "
                                           "device=0, the loader alone (no training step)", ferry_python_rows, None),
        "torch-alone": (f"torch DataLoader + the same recipe, {args.workers} workers, the loader alone (no training step)",
                        torch_rows, None),
        "torch-uint8": (f"torch DataLoader + torchvision ImageFolder, uint8 (PILToTensor), {args.workers} workers",
                        lambda: torch_rows(True), normalize_chw_uint8),
        "ferry-torchvision-prefetch4": (f"ferry.DataLoader + the same torchvision ImageFolder recipe, {args.workers} "
                                        "worker processes, prefetch_factor=4", lambda: ferry_python_rows(prefetch_factor=4),
                                        as_is),
        "ferry-torchvision-waits": (f"ferry.DataLoader + the same torchvision ImageFolder recipe, {args.workers} worker "
                                    "processes, each waiting for its slab at a batch's first sample",
                                    lambda: ferry_python_rows(init=wait_for_slabs), as_is),
        "ferry-torchvision-seeded": (f"ferry.DataLoader + the same torchvision ImageFolder recipe, {args.workers} worker "
                                     "processes, seed=0 (ferry's order and seeds: the next epoch made ahead)",
                                     lambda: ferry_python_rows(seed=0), as_is),
        "ferry-torchvision-threads": (f"ferry.DataLoader + the same torchvision ImageFolder recipe, {args.workers} worker "
                                      "threads", lambda: ferry_python_rows(worker_type="thread"), as_is),
        "ferry-torchvision-uint8": (f"ferry.DataLoader + torchvision ImageFolder, uint8 (PILToTensor), "
                                    f"{args.workers} worker processes", lambda: ferry_python_rows(True), normalize_chw_uint8),
    }
    print(f"# ResNet-50 bf16 channels_last, batch {args.batch}, {args.steps} steps after {args.warmup}, "
          f"ferry imported {'after the model is on the GPU' if args.import_after_model else 'before the model'}, "
          f"median of {args.runs}; {torch.cuda.get_device_name(0)}, {os.cpu_count()} vCPUs, torch {torch.__version__}, "
          f"torchvision {torchvision.__version__}, images {args.images}, GIL switch interval {sys.getswitchinterval() * 1e3:g} ms\n")
    print("| loader | images/s (median) | runs | / GPU alone | busy host cores | first batch (s) | first batch, the row's first run (s) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    alone = None
    for key in args.rows.split(","):
        name, make, prepare = rows[key]
        rates, cores, firsts, report = [], [], [], None
        for _ in range(args.runs):
            made_at = time.perf_counter()
            batches = make()
            r, c, first = run(batches, model, opt, prepare, args.warmup, args.steps, made_at)
            rates.append(r)
            cores.append(c)
            firsts.append(first)
            del batches
            if made:  # a ferry loader of this run: its own account, then closed (as torch's goes with its last reference)
                stats = made[-1].stats()
                slabs = {k: v for k, v in stats.items() if k.startswith("slab")}
                pool = getattr(made[-1], "_pool", None)
                if pool is not None and pool.slabs is not None:
                    slabs.update(size=pool.slabs.size, limit=pool.slabs.limit, max_count=pool.slabs.max_count)
                report = f"{key}: {stats}{slabs or ''}"
                if args.trace:
                    made[-1].write_trace(os.path.join(args.trace_dir, f"trace-{key}.json"))
                made[-1].close()
                made.clear()
        med = statistics.median(rates)
        if key == "gpu":
            alone = med
        ratio = f"{med / alone:.3f}" if alone else "-"
        print(f"| {name} | {med:,.0f} | {', '.join(f'{r:,.0f}' for r in rates)} | {ratio} | {statistics.median(cores):.1f} | "
              f"{statistics.median(firsts):.2f} | {firsts[0]:.2f} |",
              flush=True)
        if report and os.environ.get("RESNET_STATS"):  # the last ferry loader's own account, to stderr
            print(report, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
