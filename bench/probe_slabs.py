#!/usr/bin/env python3
"""What making a worker-process slab costs (Note [Slabs] in python/ferry/_slabs.py), on a GPU host.

For slabs of --mb MiB: one made alone (memfd + mapping, then cudaHostRegister), then --threads
made at once on as many threads, then as many made one after another; whether torch sees a slab
as pinned; and, beside them, torch's own way for the same bytes (pin_memory() of a pageable
tensor: its caching host allocator's first block, then one reused).
Usage: probe_slabs.py [--mb 193] [--threads 15]
"""
import argparse
import ctypes
import mmap
import os
import threading
import time

import torch

import ferry  # noqa: F401  (the extension the slabs register through)
from ferry import _ferry

# A pool of shared blocks as a loader's (Note [Shared blocks] in python/src/blocks.cpp), with room
# for every block the probe holds at once: each lease below makes a block (memfd, mapping, register).
BLOCKS = None


def make(i, mb):
    t0 = time.perf_counter()
    slab = BLOCKS.lease(mb << 20, True, 1 << 20)
    return slab, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=193)
    ap.add_argument("--threads", type=int, default=15)
    args = ap.parse_args()
    torch.cuda.init()
    global BLOCKS
    BLOCKS = _ferry.SharedBlocks(True, (2 * args.threads + 2) * (args.mb << 20))
    print(f"# slabs of {args.mb} MiB; {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n")
    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, args.mb << 20)
    t0 = time.perf_counter()
    populated = mmap.mmap(fd, args.mb << 20, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    unpinned = time.perf_counter() - t0
    populated.close()
    os.close(fd)
    slab, alone = make(0, args.mb)
    view = torch.frombuffer((ctypes.c_uint8 * slab.size).from_address(slab.address), dtype=torch.uint8)
    print(f"* one slab: {alone * 1e3:.0f} ms (a memfd mapped with its pages made, not registered: {unpinned * 1e3:.0f} ms); "
          f"torch sees it pinned: {view.is_pinned()}")
    del view  # the slab stays leased, as every one below: each is made anew
    out = [None] * args.threads
    def run(i):
        out[i] = make(1 + i, args.mb)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.threads)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    each = sorted(s for _, s in out)
    print(f"* {args.threads} at once: {wall * 1e3:.0f} ms in all; each {each[0] * 1e3:.0f} to {each[-1] * 1e3:.0f} ms "
          f"(median {each[len(each) // 2] * 1e3:.0f})")
    held = out  # held: the next ones are made anew
    t0 = time.perf_counter()
    times = []
    made = []
    for i in range(args.threads):
        s, t = make(100 + i, args.mb)
        made.append(s)
        times.append(t)
    wall = time.perf_counter() - t0
    print(f"* {args.threads} one after another: {wall * 1e3:.0f} ms in all; first {times[0] * 1e3:.0f} ms")
    del made, held, slab
    x = torch.empty(args.mb << 20, dtype=torch.uint8).fill_(1)
    for k in range(3):
        t0 = time.perf_counter()
        p = x.pin_memory()
        t = time.perf_counter() - t0
        print(f"* torch's pin_memory() of {args.mb} MiB, call {k + 1}: {t * 1e3:.0f} ms")
        del p


if __name__ == "__main__":
    main()
