#!/usr/bin/env python3
"""Summarize ferry Chrome traces (ferry trace -o, bench_gpu_decode --trace-dir, DataLoader(trace_batches=N)
and write_trace()): for each span name, its count, median and 90th percentile duration and total,
per file.

With --workers, also how the loader's workers spent the traced stretch: each worker's batch times
(median, and their spread: standard deviation over mean, the number bench/sim_refill.py takes),
the share of their time between their first and last batch spent making batches, and the share
the consumer waited. A worker's batch is the span from the start of its first stage to the end of
its last (fetch, transform, collate); batches before --skip (the warm-up) are left out.

Usage: python3 bench/trace_summary.py TRACE.json [TRACE.json ...] [--workers [--skip 45]]
"""
import argparse
import json
import statistics
from collections import defaultdict
from typing import Dict, List, Tuple

def workers(events: list, skip: int) -> None:
    # The loader names its tracks: "consumer", and "worker N" for each worker (TraceRecorder).
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans: Dict[int, Dict[int, List[float]]] = defaultdict(dict)  # worker -> batch -> [start, end] in us
    waits: List[Tuple[float, float]] = []
    consumer: List[Tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        batch = e.get("args", {}).get("batch", -1)
        if batch < skip:
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        track = names.get(e["tid"], "")
        if track == "consumer":
            consumer.append((start, end))
            if e["name"] == "wait for batch":
                waits.append((start, end))
        elif track.startswith("worker "):
            span = spans[e["tid"]].setdefault(batch, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
    if not spans or not consumer:
        print(f"  workers: no {'worker' if not spans else 'consumer'} spans after batch {skip}")
        return
    times: List[float] = []
    idle = busy = 0.0
    for _worker, batches in sorted(spans.items()):
        ordered = sorted(batches.values())
        times += [(b - a) / 1e6 for a, b in ordered]
        busy += sum(b - a for a, b in ordered)
        idle += sum(ordered[i + 1][0] - ordered[i][1] for i in range(len(ordered) - 1))
    mean = statistics.fmean(times)
    spread = statistics.pstdev(times) / mean
    first = min(a for a, _ in consumer)
    last = max(b for _, b in consumer)
    waited = sum(b - a for a, b in waits)
    print(f"  {len(times)} batches on {len(spans)} workers after batch {skip}")
    print(f"  batch time: median {statistics.median(times):.3f} s, mean {mean:.3f} s, spread (stdev / mean) "
          f"{spread:.2f}, fastest {min(times):.3f} s, slowest {max(times):.3f} s")
    print(f"  workers: {busy / (busy + idle):.2f} of their time between their first and last batch making batches")
    print(f"  consumer: waited {waited / (last - first):.2f} of {(last - first) / 1e6:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--workers", action="store_true", help="also the workers' batch times and waits")
    ap.add_argument("--skip", type=int, default=0, help="with --workers: batches left out at the start")
    args = ap.parse_args()
    for path in args.traces:
        with open(path) as f:
            data = json.load(f)
        events = data["traceEvents"] if isinstance(data, dict) else data
        spans: Dict[str, List[float]] = {}
        for e in events:
            if e.get("ph") == "X":
                spans.setdefault(e["name"], []).append(e["dur"])
        print(path)
        for name, d in sorted(spans.items()):
            d.sort()
            print(f"  {name:40s} n={len(d):7d}  median {statistics.median(d):10.1f} us  p90 {d[int(0.9 * len(d))]:10.1f} us"
                  f"  total {sum(d) / 1e3:10.1f} ms")
        if args.workers:
            workers(events, args.skip)


if __name__ == "__main__":
    main()
