#!/usr/bin/env python3
"""How a loader's workers spent a traced stretch: from a trace written by write_trace()
(DataLoader(trace_batches=N)), each worker's batch times (median and spread: their standard
deviation over their mean, the number bench/sim_refill.py takes), the time each worker waited
between its batches, and the consumer's waits.

    python3 bench/trace_workers.py trace.json [--skip 45]

A worker's batch is the span from the start of its first stage to the end of its last (fetch,
transform, collate); its wait is the time from the end of one batch to the start of its next.
Batches before --skip (the warm-up) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Dict, List, Tuple

CONSUMER = 1000  # TraceRecorder::kConsumerTrack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=0, help="batches left out at the start")
    args = ap.parse_args()
    with open(args.trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans: Dict[int, Dict[int, List[float]]] = defaultdict(dict)  # worker -> batch -> [start, end] in us
    waits: List[Tuple[float, float]] = []
    consumer: List[Tuple[float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        batch = e.get("args", {}).get("batch", -1)
        if batch < args.skip:
            continue
        start, end = e["ts"], e["ts"] + e["dur"]
        if e["tid"] == CONSUMER:
            consumer.append((start, end))
            if e["name"] == "wait for batch":
                waits.append((start, end))
            continue
        if e["tid"] >= CONSUMER:
            continue
        span = spans[e["tid"]].setdefault(batch, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    if not spans:
        raise SystemExit(f"{args.trace}: no worker spans after batch {args.skip}")
    times: List[float] = []
    idle = busy = 0.0
    for worker, batches in sorted(spans.items()):
        ordered = sorted(batches.values())
        times += [(b - a) / 1e6 for a, b in ordered]
        busy += sum(b - a for a, b in ordered)
        idle += sum(ordered[i + 1][0] - ordered[i][1] for i in range(len(ordered) - 1))
    mean = statistics.fmean(times)
    spread = statistics.pstdev(times) / mean
    first = min(a for a, _ in consumer)
    last = max(b for _, b in consumer)
    waited = sum(b - a for a, b in waits)
    print(f"{args.trace}: {len(times)} batches on {len(spans)} workers after batch {args.skip}")
    print(f"  batch time: median {statistics.median(times):.3f} s, mean {mean:.3f} s, spread (stdev / mean) "
          f"{spread:.2f}, fastest {min(times):.3f} s, slowest {max(times):.3f} s")
    print(f"  workers: {busy / (busy + idle):.2f} of their time between their first and last batch making batches")
    print(f"  consumer: waited {waited / (last - first):.2f} of {(last - first) / 1e6:.2f} s")


if __name__ == "__main__":
    main()
