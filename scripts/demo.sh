#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, and runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target basic_loader
exec build/default/examples/basic_loader "$@"
