#!/usr/bin/env python3
"""Summarize ferry Chrome traces (ferry trace -o, bench_gpu_decode --trace-dir): for each span name,
its count, median and 90th percentile duration and total, per file.

Usage: python3 bench/trace_summary.py TRACE.json [TRACE.json ...]
"""
import json
import statistics
import sys

for path in sys.argv[1:]:
    spans = {}
    for e in json.load(open(path))["traceEvents"]:
        if e.get("ph") == "X":
            spans.setdefault(e["name"], []).append(e["dur"])
    print(path)
    for name, d in sorted(spans.items()):
        d.sort()
        print(f"  {name:40s} n={len(d):7d}  median {statistics.median(d):10.1f} us  p90 {d[int(0.9 * len(d))]:10.1f} us"
              f"  total {sum(d) / 1e3:10.1f} ms")
