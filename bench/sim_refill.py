#!/usr/bin/env python3
"""A model of the loader's window under round-robin: how busy slow workers stay, and how many
batches a second reach a consumer, when batches must be delivered in order, batch b is worker
b mod W's, and at most prefetch_factor x W batches are in flight.

No loader runs here: an event simulation of the engine's dispatch rule (src/engine.cpp,
Note [Refill under round-robin]) with batch times drawn from a normal distribution (mean 1 s,
the spread given as a fraction of it), and a consumer that takes `--step` seconds a batch (the
GPU's step). It compares refilling the window in bursts of half of it (the engine's rule for
any-free-worker jobs) with refilling each slot as it frees (PyTorch's index queue, and the
engine's rule under round-robin), and larger windows.

    python3 bench/sim_refill.py [--workers 15] [--spread 0.1,0.2,0.3] [--step 0.064] [--batches 4000]
"""

from __future__ import annotations

import argparse
import heapq
import random
from typing import Dict, List, Optional, Tuple


def simulate(workers: int, prefetch: int, burst: int, spread: float, step: float, batches: int,
             warmup: int = 200, seed: int = 1) -> Tuple[float, float]:
    """(batches/s the consumer takes, fraction of the workers' time spent making batches),
    measured after `warmup` batches."""
    rnd = random.Random(seed)
    window = workers * prefetch
    queues: List[List[int]] = [[] for _ in range(workers)]
    working: List[Optional[int]] = [None] * workers
    done: Dict[int, float] = {}
    events: List[Tuple[float, int, int, float]] = []  # (time, worker or -1 for the consumer, batch, duration)
    state = {"next_key": 0, "in_flight": 0}
    taken = 0  # batches the consumer has taken: the window's start

    def dispatch() -> None:
        bursting = False
        while state["next_key"] < batches and state["next_key"] < taken + window:
            free = taken + window - state["next_key"]
            if not bursting and state["in_flight"] > 0 and free < burst:
                return
            bursting = True
            queues[state["next_key"] % workers].append(state["next_key"])
            state["in_flight"] += 1
            state["next_key"] += 1

    def start(now: float) -> None:
        for w in range(workers):
            if working[w] is None and queues[w]:
                b = queues[w].pop(0)
                d = max(0.05, rnd.gauss(1.0, spread))
                working[w] = b
                heapq.heappush(events, (now + d, w, b, d))

    now = consumer_free = 0.0
    busy = 0.0
    t0 = 0.0
    dispatch()
    start(0.0)
    while taken < batches:
        if taken in done and consumer_free <= now:
            begin = max(consumer_free, done.pop(taken))
            consumer_free = begin + step
            taken += 1
            if taken == warmup:
                t0 = begin
            dispatch()
            start(now)
            heapq.heappush(events, (consumer_free, -1, -1, 0.0))
            continue
        when, w, b, d = heapq.heappop(events)
        now = max(now, when)
        if w >= 0:
            done[b] = when
            working[w] = None
            state["in_flight"] -= 1
            if b >= warmup:
                busy += d
            dispatch()
            start(when)
    span = consumer_free - t0
    return (batches - warmup) / span, busy / (workers * span)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--spread", default="0.05,0.1,0.2,0.3,0.4", help="batch times' standard deviation, / mean")
    ap.add_argument("--step", type=float, default=1 / 15.6, help="the consumer's seconds a batch")
    ap.add_argument("--batches", type=int, default=4000)
    args = ap.parse_args()
    w = args.workers
    half = None  # the burst: half the window
    rules = [("half-window bursts, prefetch 2", 2, half), ("a slot at a time, prefetch 2", 2, 1),
             ("a slot at a time, prefetch 3", 3, 1), ("a slot at a time, prefetch 4", 4, 1)]
    print(f"# {w} workers, batches of mean 1 s, consumer {args.step:.3f} s a batch (at most {1 / args.step:.1f}/s); "
          "in order, round-robin")
    print()
    print("| spread | " + " | ".join(name for name, _, _ in rules) + " |")
    print("|---:|" + "---:|" * len(rules))
    for spread in (float(s) for s in args.spread.split(",")):
        cells = []
        for _, prefetch, burst in rules:
            rate, busy = simulate(w, prefetch, max(1, w * prefetch // 2) if burst is None else burst, spread,
                                  args.step, args.batches)
            cells.append(f"{rate:.2f}/s, {busy:.2f} busy")
        print(f"| {spread:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
