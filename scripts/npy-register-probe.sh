#!/usr/bin/env bash
# On a GPU host, after scripts/gpu.sh build: the device gather over .npy files of (a)'s rows
# (3x224x224 uint8) of 512 and 4096 rows, each run in the background under a time limit; after
# 15 s, where each thread of a run still going is (state, kernel wait channel, and the main
# thread's user stack through a SIGUSR1 handler preloaded from bench/backtrace_preload.c).
# Usage: scripts/npy-register-probe.sh [dir]
set -u
cd "$(dirname "$0")/.."
dir=${1:-/tmp/ferry-probe}
mkdir -p "$dir"
export LD_LIBRARY_PATH=/tmp/ferry-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
gcc -shared -fPIC -o "$dir/libbt.so" bench/backtrace_preload.c
python3 - "$dir" <<'PY'
import sys, numpy as np
d = sys.argv[1]
for rows in (512, 4096):
    np.save(f"{d}/rows{rows}.npy", np.full((rows, 3, 224, 224), 7, np.uint8))
PY
for rows in 512 4096; do
  f="$dir/rows$rows"
  LD_PRELOAD="$dir/libbt.so" timeout -s KILL 40 build/gpu/ferry bench npy -c path="$f.npy" -b 256 -w 0 --device 0 \
    --gather device -n 60 > "$f.txt" 2>&1 &
  sleep 15
  pid=$(pgrep -f "path=$f.npy" | grep -v timeout | tail -1)
  echo "== $rows rows ($(du -h "$f.npy" | cut -f1)): $(grep -E "batches/s" "$f.txt" | head -1)"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    echo "still running after 15 s (pid $pid):"
    for t in /proc/$pid/task/*; do echo "  $(cat $t/comm) state=$(awk '{print $3}' $t/stat) wchan=$(cat $t/wchan 2>/dev/null)"; done
    kill -USR1 "$pid"; sleep 2
    grep -v "^\[" "$f.txt" | tail -25 | c++filt | cut -c1-200
  fi
  wait
done
