#!/usr/bin/env python3
"""Ctrl-C during a slow sample: seconds from SIGINT to the loop's KeyboardInterrupt, and to the
program's exit, ferry against PyTorch's DataLoader side by side.

Each run is a fresh Python process whose loop waits for a batch whose every sample sleeps 30 s (a
stuck read, a slow decode); the parent sends SIGINT once the first sample is being fetched plus
0.2 s. Rows: a Python dataset through torch.utils.data.DataLoader and through ferry.DataLoader
(worker processes, and ferry's worker threads), and ferry's own synthetic dataset (its samples made
in C++). The tests check only bounds well under the sample's 30 s (python/tests, "Ctrl-C"); the
figures are these. Usage: ctrl_c_latency.py [--runs 5] [--workers 2]
"""
import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROWS = ("torch", "ferry-process", "ferry-thread", "ferry-synthetic")

SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, ferry

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 100
        def __getitem__(self, i):
            open(os.environ["STARTED"], "w").close()
            time.sleep(30)
            return i

    if __name__ == "__main__":
        row, workers = sys.argv[1], int(sys.argv[2])
        if row == "torch":
            loader = torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=workers)
        elif row == "ferry-synthetic":
            open(os.environ["STARTED"], "w").close()
            ds = ferry.datasets.synthetic(n=100, shape=(2,), delay_rate=1.0, delay_ms=30000)
            loader = ferry.DataLoader(ds, batch_size=2, num_workers=workers)
        else:
            loader = ferry.DataLoader(Slow(), batch_size=2, num_workers=workers, worker_type=row.split("-")[1])
        print("ready", flush=True)
        try:
            for batch in loader:
                pass
        except KeyboardInterrupt:
            print("interrupted %.6f" % time.monotonic(), flush=True)
            sys.exit(0)
""")


def one_run(script: str, row: str, workers: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        started = os.path.join(tmp, "started")
        env = dict(os.environ, STARTED=started)
        proc = subprocess.Popen([sys.executable, script, row, str(workers)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            deadline = time.monotonic() + 120
            while not os.path.exists(started) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
            exited = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if not out.startswith("interrupted"):
            raise SystemExit(f"{row}: no KeyboardInterrupt: {out!r} {err[-2000:]!r}")
        return float(out.split()[1]) - sent, exited


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "loop.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        got: dict[str, list[tuple[float, float]]] = {r: [] for r in ROWS}
        for _ in range(args.runs):  # the rows take turns, so a busy moment hits them alike
            for row in ROWS:
                got[row].append(one_run(script, row, args.workers))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{args.workers} workers, {args.runs} runs a row, {time.strftime('%Y-%m-%d')}")
    print("| loader | SIGINT to KeyboardInterrupt, median (max) | SIGINT to exit, median (max) |")
    print("|---|---:|---:|")
    for row in ROWS:
        waits, exits = [w for w, _ in got[row]], [e for _, e in got[row]]
        print(f"| {row} | {statistics.median(waits) * 1000:.0f} ms ({max(waits) * 1000:.0f}) "
              f"| {statistics.median(exits) * 1000:.0f} ms ({max(exits) * 1000:.0f}) |")


if __name__ == "__main__":
    main()
