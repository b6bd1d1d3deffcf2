#!/usr/bin/env bash
# The README's test command: installs what is missing, builds (incrementally: what the demo or an
# earlier run built is reused; a fresh clone builds everything) and runs every test. With
# arguments, runs the named presets instead of "default": scripts/test.sh tsan asan.
# FERRY_CLEAN=1 deletes each preset's build folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(default)
for preset in "${presets[@]}"; do
  echo "=== ferry: build and test, preset '$preset' ==="
  [ "${FERRY_CLEAN:-0}" = 1 ] && rm -rf "build/$preset"
  python_args=()  # the Python module builds against the environment install-deps.sh made
  [ -x .venv/bin/python ] && python_args=(-DPython_EXECUTABLE="$PWD/.venv/bin/python")
  cmake --preset "$preset" "${python_args[@]}"
  cmake --build --preset "$preset"
  # A preset that builds the Python package runs its suite: one that built it without registering
  # the tests (the wheels missing, nanobind not found) fails here, not by a suite gone quiet.
  # (ctest's listing is read whole first: grep -q leaving a pipe early kills ctest by SIGPIPE,
  # which pipefail would read as the tests missing.)
  if grep -q "^FERRY_BUILD_PYTHON:BOOL=ON" "build/$preset/CMakeCache.txt" \
     && ! grep -q " python_tests$" <<<"$(ctest --preset "$preset" -N)"; then
    echo "scripts/test.sh: preset '$preset' builds the Python package but registered no python_tests (see CMake's 'ferry: Python module' line)" >&2
    exit 1
  fi
  ctest --preset "$preset" 2>&1 | tee "build/$preset/ctest-output.txt"
  # What passing output hides: why tests were skipped, and the Python suite's count.
  python3 scripts/test_summary.py "build/$preset/ctest-output.txt" "build/$preset/Testing/Temporary/LastTest.log" || true
done
