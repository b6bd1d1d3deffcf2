#!/usr/bin/env bash
# The loaders benchmark (bench/RESULTS.md): installs Debian's mate-backgrounds photographs if
# missing, cuts them into 500x375 JPEG tiles (and 1500x1000 ones, build/bench-data/photos-1500, for
# a GPU host's images-peers), builds the release preset and runs bench_loaders.
# Usage: scripts/bench-loaders.sh [--runs N]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
if ! dpkg-query -W -f='${Status}' mate-backgrounds 2>/dev/null | grep -q "install ok installed"; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends mate-backgrounds
fi
cmake --preset release >/dev/null
cmake --build --preset release --target bench_loaders
tiles=build/bench-data/photos
[ -d "$tiles" ] || build/release/bench/bench_loaders --make-tiles /usr/share/backgrounds/mate/nature "$tiles"
# The larger-image set for scripts/gpu.sh images-peers: 1500x1000 tiles of all three folders.
large=build/bench-data/photos-1500
if [ ! -d "$large" ]; then
  for d in nature desktop abstract; do
    build/release/bench/bench_loaders --make-tiles "/usr/share/backgrounds/mate/$d" "$large.tmp/$d" 1500x1000
  done
  mkdir -p "$large" && for d in "$large.tmp"/*/; do cp -r "$d"* "$large/"; done && rm -rf "$large.tmp"
fi
build/release/bench/bench_loaders --photos "$tiles" "$@"
