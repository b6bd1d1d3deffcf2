#!/usr/bin/env bash
# Installs ferry's build and test dependencies from Debian 12 packages. Idempotent: does nothing
# when everything is already there. Runs apt-get as root (directly, or through sudo).
set -euo pipefail
packages=(g++ cmake ninja-build libtbb-dev libconcurrentqueue-dev libspdlog-dev catch2 libdlpack-dev
          zlib1g-dev libpng-dev libturbojpeg0-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
