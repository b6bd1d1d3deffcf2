#!/usr/bin/env bash
# The fast checks CI runs before the suites: C++ format (clang-format, .clang-format), Python
# lint (ruff, pyproject.toml's [tool.ruff]) over the files git tracks, and the Python package's
# types (mypy, [tool.mypy]). A contributor runs it
# before a commit (or lets pre-commit run it: .pre-commit-config.yaml); --fix rewrites the files.
# Usage: scripts/check.sh [--fix]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh > /dev/null
mapfile -t cpp < <(git ls-files '*.h' '*.cpp' '*.cu' '*.c')
if [ "${1:-}" = --fix ]; then
  clang-format -i "${cpp[@]}"
  .venv/bin/ruff check --fix .
  exit 0
fi
clang-format --dry-run --Werror "${cpp[@]}" || { echo "check: clang-format would change the files above (scripts/check.sh --fix)"; exit 1; }
.venv/bin/ruff check . || { echo "check: ruff found the problems above"; exit 1; }
.venv/bin/mypy || { echo "check: mypy found the type errors above (pyproject.toml's [tool.mypy])"; exit 1; }
echo "check: ${#cpp[@]} C++ files formatted, Python lint and types clean"
