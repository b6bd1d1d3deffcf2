#!/usr/bin/env bash
# Builds the libFuzzer targets (preset "fuzz": clang, ASan + UBSan) and runs each for a bounded
# time from a generated seed corpus. A crash, sanitizer report or unexpected exception fails.
# Usage: scripts/fuzz.sh [seconds per target, default 60]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
scripts/install-deps.sh
for p in clang libclang-rt-14-dev; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    [ "$(id -u)" -eq 0 ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$p" || {
      echo "fuzz.sh: needs $p (apt-get install $p)"; exit 1; }
  fi
done
rm -rf build/fuzz
cmake --preset fuzz
cmake --build --preset fuzz --target fuzz_idx fuzz_npy fuzz_tokens fuzz_tar fuzz_tar_stream fuzz_image fuzz_plan fuzz_state fuzz_s3 fuzz_tokenizer fuzz_make_seeds
corpus=build/fuzz/corpus
build/fuzz/tests/fuzz/fuzz_make_seeds "$corpus"
mkdir -p "$corpus/plan" && cp "$corpus"/image/*.jpg "$corpus/plan/"  # GPU decode's worker side reads JPEGs
mkdir -p "$corpus/tar_stream" && cp "$corpus"/tar/* "$corpus/tar_stream/"  # the same archives, as a stream
for target in idx npy tokens tar tar_stream image plan state s3 tokenizer; do
  echo "=== fuzz_$target: ${seconds}s ==="
  mkdir -p "$corpus/$target" build/fuzz/findings
  # -rss_limit_mb: a parser that allocates what a header claims would be caught here.
  build/fuzz/tests/fuzz/fuzz_$target "$corpus/$target" -max_total_time="$seconds" -rss_limit_mb=2048 \
    -max_len=65536 -artifact_prefix=build/fuzz/findings/$target- -print_final_stats=1 2>&1 | tail -12
done
