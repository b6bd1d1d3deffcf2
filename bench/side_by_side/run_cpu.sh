#!/usr/bin/env bash
# Side by side on this (CPU-only) machine, in one run: ferry against Debian's PyTorch 1.13
# DataLoader (python3-torch) and libtorch 1.13's make_data_loader (libtorch-dev), same workloads,
# same per-sample work, 0/1/2 workers; prints a ratio table (markdown) and saves the raw JSON lines.
# Usage: bench/side_by_side/run_cpu.sh [out.md]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/archive/results/cpu-side-by-side.md}
scripts/install-deps.sh >/dev/null
for p in python3-torch libtorch-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="${missing:-} $p"
done
if [ -n "${missing:-}" ]; then
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  ${SUDO:-} apt-get install -y -qq --no-install-recommends $missing
fi
cmake --preset release >/dev/null && cmake --build --preset release --target ferry_cli >/dev/null
cmake -S bench/side_by_side -B build/side-cpu -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/side-cpu >/dev/null
D=/usr/share/datasets/fashion-mnist
# (B)'s rows, one file read by all three: 60000 x 784 float32 (188 MB).
rows=build/bench-data/rows784.npy
mkdir -p build/bench-data
[ -f $rows ] || /usr/bin/python3 -c "import numpy as np; np.save('$rows', np.random.default_rng(0).random((60000, 784), dtype=np.float32))"
raw=$(mktemp)
for w in 0 1 2; do
  for wl in A B; do
    if [ $wl = A ]; then
      args=(idx -c "images=$D/train-images-idx3-ubyte.gz,labels=$D/train-labels-idx1-ubyte.gz,flip=1,mean=0.2860,std=0.3530")
    else
      args=(npy -c "path=$rows")
    fi
    # Three runs of ~3 epochs each after a warm-up; the median is kept.
    for r in 1 2 3; do
      build/release/ferry bench "${args[@]}" -b 256 -w $w --warmup 40 --batches 700 --json |
        python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'peer':'ferry','workload':'$wl','workers':$w,'samples_per_second':d['samples_per_second']}))"
    done
  done
done >> "$raw"
/usr/bin/python3 bench/side_by_side/peers_cpu.py --rows $rows >> "$raw"  # Debian's python, with python3-torch
build/side-cpu/peers_libtorch_cpu $D $rows >> "$raw"
python3 - "$raw" "$out" <<'PY'
import json, statistics, sys, platform, os, subprocess
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
res = {}
for r in rows:
    res.setdefault((r["workload"], r["peer"].split()[0], r["workers"]), []).append(r["samples_per_second"])
peers = {r["peer"].split()[0]: r["peer"] for r in rows}
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/Model name: *//p'"], capture_output=True, text=True).stdout.strip()
lines = [f"# Side by side on the CPU: {os.cpu_count()} cores ({cpu}), {platform.platform()}", "",
         "(A) Fashion-MNIST, per sample: random flip, to float, normalize; (B) 784 float32 rows, no per-sample work.",
         "Batch 256, shuffled. samples/s, median of 3 runs; ratios are ferry / peer at the same workers.", "",
         f"Peers: {', '.join(peers.values())}.", "",
         "| workload | workers | ferry | torch | libtorch | ferry / torch | ferry / libtorch |",
         "|---|---:|---:|---:|---:|---:|---:|"]
for wl in "AB":
    for w in (0, 1, 2):
        f = statistics.median(res.get((wl, "ferry", w), [0]))
        t = statistics.median(res.get((wl, "torch", w), [0]))
        l = statistics.median(res.get((wl, "libtorch", w), [0]))
        lines.append(f"| {wl} | {w} | {f:,.0f} | {t:,.0f} | {l:,.0f} | {f / t if t else 0:.1f} | {f / l if l else 0:.1f} |")
    best = {p: max(statistics.median(res.get((wl, p, w), [0])) for w in (0, 1, 2)) for p in ("ferry", "torch", "libtorch")}
    lines.append(f"| {wl}, best of each | - | {best['ferry']:,.0f} | {best['torch']:,.0f} | {best['libtorch']:,.0f} | "
                 f"{best['ferry'] / best['torch']:.1f} | {best['ferry'] / best['libtorch']:.1f} |")
text = "\n".join(lines) + "\n"
print(text)
open(sys.argv[2], "w").write(text + "\nRaw runs:\n\n```\n" + open(sys.argv[1]).read() + "```\n")
PY
rm -f "$raw"
