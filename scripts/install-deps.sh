#!/usr/bin/env bash
# Installs ferry's build and test dependencies from Debian 12 packages. Idempotent: does nothing
# when everything is already there. Runs apt-get as root (directly, or through sudo).
set -euo pipefail
packages=(g++ cmake ninja-build libtbb-dev libconcurrentqueue-dev libspdlog-dev catch2 libdlpack-dev
          zlib1g-dev libpng-dev libturbojpeg0-dev libjpeg62-turbo-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# nvJPEG for GPU decode, where the CUDA Toolkit has nvcc but not nvJPEG: the pinned PyPI wheel
# (header and library) into /opt/ferry-nvjpeg, where CMake looks for it.
nvjpeg_version=13.0.1.86
cuda_root=$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")
if [ -x "$cuda_root/bin/nvcc" ] && [ ! -f "$cuda_root/include/nvjpeg.h" ] && [ ! -f /opt/ferry-nvjpeg/nvidia/cu13/include/nvjpeg.h ] \
   && command -v python3 >/dev/null; then
  echo "install-deps: nvidia-nvjpeg==$nvjpeg_version (PyPI) into /opt/ferry-nvjpeg"
  SUDO_PIP=""; [ "$(id -u)" -eq 0 ] || SUDO_PIP=sudo
  $SUDO_PIP python3 -m pip install --quiet --disable-pip-version-check --target /opt/ferry-nvjpeg "nvidia-nvjpeg==$nvjpeg_version" \
    || echo "install-deps: nvJPEG not installed; GPU decode will not be built"
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
