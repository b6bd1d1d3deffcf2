#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu.sh build: the device gather over a 616 MB .npy written two
# ways (numpy's np.save, through write(); numpy's open_memmap, through a shared writable mapping),
# each run in the background under a time limit, since a registration that never returns leaves
# its process unkillable. Prints how each ended. Usage: scripts/npy-register-probe.sh [dir]
set -u
cd "$(dirname "$0")/.."
dir=${1:-/tmp/ferry-probe}
mkdir -p "$dir"
export LD_LIBRARY_PATH=/tmp/ferry-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
python3 - "$dir" <<'PY'
import sys, numpy as np
d = sys.argv[1]
np.save(f"{d}/saved.npy", np.full((4096, 3, 224, 224), 7, np.uint8))
a = np.lib.format.open_memmap(f"{d}/memmap.npy", mode="w+", dtype=np.uint8, shape=(4096, 3, 224, 224))
a[:] = 7
a.flush()
del a
PY
for f in saved memmap; do
  ( timeout -s KILL 45 build/gpu/ferry bench npy -c path="$dir/$f.npy" -b 256 -w 0 --device 0 --gather device -n 60 \
      > "$dir/$f.txt" 2>&1; echo "exit $?" >> "$dir/$f.txt" ) &
  sleep 50
  echo "== $f.npy (written by $([ $f = saved ] && echo np.save || echo open_memmap))"
  grep -E "batches/s|gather|Error|error|exit" "$dir/$f.txt" | head -5 || true
  [ -s "$dir/$f.txt" ] || echo "no output after 50 s: still inside the call"
done
