#!/usr/bin/env python3
"""What a worker process spends writing one collated batch into its slab (Note [Collated into the
slab] in ferry/_slabs.py): torch's default_collate in a worker (stacked into a new shared-memory
segment) followed by the slab pickler's copy, against ProcessSlabs.collate() stacking straight
into the slab, for the ResNet recipe's float batch (256 x 3 x 224 x 224, 154 MB). CPU seconds of
this process (user + system) and minor page faults, an image, median of --runs after one warm-up.
Usage: probe_collate.py [--batch 256] [--runs 15]
"""
import argparse
import os
import platform
import resource
import statistics
import time

import torch
from torch.utils.data._utils import worker as torch_worker

from ferry import _ferry, _slabs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a worker process
    torch_worker._worker_info = torch_worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    samples = [(torch.randn(3, 224, 224), i) for i in range(args.batch)]
    need = args.batch * 3 * 224 * 224 * 4 + (1 << 20)
    blocks = _ferry.SharedBlocks(False, need * 2)
    block = blocks.lease(need, True, 2)
    side = _slabs.ProcessSlabs()
    side.add(block.id, block.size, os.dup(block.fd))

    def torch_then_copy():
        return side.dump(torch.utils.data.default_collate(samples), block.id)

    def into_the_slab():
        return side.dump(side.collate(samples, block.id), block.id)

    print(f"# {platform.machine()}, {os.cpu_count()} vCPUs, torch {torch.__version__}, batch {args.batch} x 3 x 224 x 224 float32")
    print("| way | ms of CPU an image | page faults an image |")
    print("|---|---:|---:|")
    for name, way in (("torch's default_collate (shared memory), then copied into the slab", torch_then_copy),
                      ("stacked into the slab (ProcessSlabs.collate)", into_the_slab)):
        cpu, faults = [], []
        for run in range(args.runs + 1):
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            blob, regions = way()
            assert regions is not None
            t1, f1 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if run:
                cpu.append((t1 - t0) / args.batch * 1e3)
                faults.append((f1 - f0) / args.batch)
        print(f"| {name} | {statistics.median(cpu):.3f} | {statistics.median(faults):.0f} |")


if __name__ == "__main__":
    main()
