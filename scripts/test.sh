#!/usr/bin/env bash
# The README's test command: installs what is missing, builds from scratch and runs every test.
# With arguments, runs the named presets instead of "default": scripts/test.sh tsan asan.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(default)
for preset in "${presets[@]}"; do
  echo "=== ferry: build and test, preset '$preset' ==="
  rm -rf "build/$preset"
  python_args=()  # the Python module builds against the environment install-deps.sh made
  [ -x .venv/bin/python ] && python_args=(-DPython_EXECUTABLE="$PWD/.venv/bin/python")
  cmake --preset "$preset" "${python_args[@]}"
  cmake --build --preset "$preset"
  ctest --preset "$preset"
done
