#!/usr/bin/env bash
# The README's first command: installs what is missing, builds, and trains the Fashion-MNIST demo
# (on the GPU when there is one, else on the CPU). Extra arguments go to the demo (--epochs N, --cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --demo
cmake --preset default >/dev/null
cmake --build --preset default --target train_fashion_mnist ferry_cli
exec build/default/examples/fashion_mnist/train_fashion_mnist "$@"
