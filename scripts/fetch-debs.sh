#!/usr/bin/env bash
# Downloads the Debian 12 packages ferry builds against into .debs/ (git-ignored), for machines
# with no package registry (a GPU host): scripts/gpu.sh unpacks them there with dpkg -x.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .debs
cd .debs
pkgs=(libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libconcurrentqueue-dev libspdlog-dev libspdlog1.10
      libfmt-dev libfmt9 catch2 libdlpack-dev libturbojpeg0-dev libturbojpeg0 libjpeg62-turbo-dev libjpeg62-turbo libpng-dev libpng16-16 zlib1g-dev zlib1g
      libcli11-dev nlohmann-json3-dev libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
      libsentencepiece-dev libsentencepiece0 dataset-fashion-mnist)
[ "$(id -u)" -eq 0 ] && apt-get update -qq
apt-get download "${pkgs[@]}"
ls -la
