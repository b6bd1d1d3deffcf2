#!/usr/bin/env bash
# On a GPU host: unpack the carried .debs into a prefix, build ferry (Release), run the whole
# suite with FERRY_REQUIRE_GPU=1 (GPU tests fail instead of skipping), then the GPU benchmarks.
# Results go to $OUT (or out/). Usage: scripts/gpu.sh [build|test|demo|bench|all|libtorch|images|images-loop|images-peers|multi|gather|rows|python|tokens|tar]
# tar: the tar stream against the indexed path and turboloader (see there; TAR_IMAGES, TAR_ARGS).
# tokens: the device gather's GPU tests over token files, then `ferry bench tokens` with the GPU
# gathering the windows and with the host path (TOKEN_BATCHES batches a row).
# python: the Python package as a user installs it (pip install --no-build-isolation ., into the
# host's Python environment, which has torch, torchvision, nanobind and scikit-build-core), its
# pytest suite with FERRY_REQUIRE_GPU=1, the demo in Python on the GPU,
# and bench/python_loop.py (Python against the C++ loop and PyTorch's DataLoader). It builds
# nothing else (PYTHON_BENCH=0 leaves the benchmark out; RESNET_BENCH=1 adds bench/resnet_loaders.py,
# ResNet-50 fed by each loader, with RESNET_ARGS; PYDS_BENCH=1 adds bench/python_datasets.py, a
# Python dataset through each loader, with PYDS_ARGS; PYOBJ_BENCH=1 adds bench/python_objects.py,
# a dataset of a million Python objects, first batch and memory, with PYOBJ_ARGS; CEILING_BENCH=1
# adds bench/recipe_ceiling.py, the ResNet recipe's own work with no loader, on RESNET_COPIES's folder,
# with CEILING_ARGS; PYTHON_INSTALL=0
# keeps the package an earlier call installed; PYTHON_DEMO=0 leaves the demo out).
# gather: the suite, then bench_gather (the device gather, the host path, the link) and PyTorch's
# DataLoader on the same workloads.
# rows: the device gather's GPU tests, the Fashion-MNIST demo and `ferry bench idx` with the
# gather (flip + normalize in its kernel, no workers) and with the host path, then bench_gather.
# images: the image path alone, most important first (for short device time): the GPU suite, GPU
# decode on the 500x375 set (image folder and indexed tar shards, with the training loop),
# `ferry bench image_folder|tar_index ...,decode=gpu`, and where build/old-src holds an older source
# tree, the CPU path before and after, built the same way, in one run. IMAGES_ARGS: more arguments
# for bench_gpu_decode (e.g. --step-kernels 40 --step-blocks 4 for fewer training-loop rows).
# images-loop: bench_gpu_decode's training loop alone (LOOP_ARGS: more arguments, e.g. --step matmul).
# BUILD_TARGETS (any mode): build only these.
# images-peers: torchvision's GPU decode and PyTorch's DataLoader on the 500x375 set, then ferry
# and both peers on the 1500x1000 tiles (build/bench-data/photos-1500).
# multi (a host with 2 GPUs): the host's NUMA and PCIe layout, the GPU suite with both GPUs
# required, dist_epoch and the data-parallel example under torchrun (and mpirun if there), then
# bench_multi_gpu (one GPU busy, both busy; one process, and one per GPU) beside PyTorch's
# DataLoader under torchrun (MULTI_TESTS=0 leaves the tests and the example out).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
prefix=/tmp/ferry-deps
for f in .debs/*.deb; do dpkg -x "$f" $prefix; done  # idempotent; picks up packages added since
export CMAKE_PREFIX_PATH=$prefix/usr
export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export CPATH=$prefix/usr/include:$prefix/usr/include/x86_64-linux-gnu
export PATH=/usr/local/cuda/bin:$PATH
{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv;
  nproc; lscpu | grep "Model name"; g++ --version | head -1; nvcc --version | tail -1; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# The unpacked zlib1g-dev's libz.so points at an absolute path this host lacks: link the host's
# own libz.so.1 (the headers come from the prefix; zlib keeps its ABI).
zlib=$(ls /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1 2>/dev/null | head -1)
# NCCL (the data-parallel example and test): the toolkit's, else PyPI's nvidia-nccl wheel's.
nccl_root=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
links() {  # links SRC DST N: N symbolic links to each tile of SRC, in DST's class folders
  [ -d "$2" ] && return
  for d in "$1"/*/; do c=$(basename "$d"); ls "$d"*.jpg > /dev/null 2>&1 || continue; mkdir -p "$2/$c"
    for i in $(seq "$3"); do for f in "$d"*.jpg; do ln -s "$PWD/$f" "$2/$c/${i}_$(basename "$f")"; done; done; done
}
if [ "$what" = python ]; then
  rc=0
  PY=$(command -v python3)  # the host's torch environment (a venv of its own: install into it)
  export CMAKE_BUILD_PARALLEL_LEVEL=16
  # The system compiler, whose libstdc++ is the one the Python process loads: this host's default
  # $CXX (/opt/gcc) links parts of its own libstdc++ into each library, and such a copy crashed
  # on the Python process's locale (in an ostringstream) where a C++ program did not.
  export CC=/usr/bin/gcc CXX=/usr/bin/g++
  if [ "${PYTHON_INSTALL:-1}" = 1 ]; then  # PYTHON_INSTALL=0: the package installed by an earlier call
  rm -rf build/python-gpu
  $PY -m pip install --no-build-isolation --no-deps -v . -C build-dir=build/python-gpu \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C cmake.define.CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    -C cmake.define.ZLIB_LIBRARY="$zlib" -C cmake.define.ZLIB_LIBRARY_RELEASE="$zlib" > "$OUT/pip-install.log" 2>&1 \
    || { grep -E "error|Error" -A3 "$OUT/pip-install.log" | head -60; exit 1; }
  fi
  $PY -c 'import ferry, torch, nanobind; print("ferry", ferry.__version__, "from", ferry.__file__, "torch", torch.__version__, "nanobind", nanobind.__version__)' | tee "$OUT/python-versions.txt"
  if [ "${PYTHON_TESTS:-1}" = 1 ]; then  # PYTHON_TESTS=0: install and run the benchmarks only
    # PYTEST_TIMEOUT: seconds for the suite (480; on the H200 host it ran past 300 s); PYTEST_FILES: test files to run, relative to python/tests.
    files=("$PWD/python/tests")
    [ -n "${PYTEST_FILES:-}" ] && files=($(for f in $PYTEST_FILES; do echo "$PWD/python/tests/$f"; done))
    (cd /tmp && FERRY_REQUIRE_GPU=1 timeout "${PYTEST_TIMEOUT:-480}" $PY -m pytest -q -p no:cacheprovider -rs --durations=10 "${files[@]}" 2>&1;
     echo "pytest exit status $?") | tee "$OUT/pytest.txt"
    grep -q "pytest exit status 0" "$OUT/pytest.txt" || rc=1
    if [ "${PYTHON_DEMO:-1}" = 1 ]; then
      timeout 120 $PY python/examples/fashion_mnist.py --data $prefix/usr/share/datasets/fashion-mnist --device 0 --epochs 3 \
        --min-accuracy 0.80 2>&1 | tee "$OUT/demo-python.txt" || rc=1
    fi
  fi
  if [ "${PYTHON_BENCH:-1}" = 1 ]; then
    links build/bench-data/photos /tmp/ferry-photos60 60
    PYTHONUNBUFFERED=1 timeout 420 $PY bench/python_loop.py --data /tmp/ferry-rows --images /tmp/ferry-photos60 \
      ${PYTHON_ARGS:-} 2>&1 | tee "$OUT/python_loop.md"
  fi
  if [ "${PYDS_BENCH:-0}" = 1 ]; then  # a Python dataset through ferry's threads and torch's processes
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 240 $PY "$OLDPWD/bench/python_datasets.py" ${PYDS_ARGS:-} 2>&1) \
      | tee "$OUT/python_datasets.md"
  fi
  if [ "${PYOBJ_BENCH:-0}" = 1 ]; then  # many Python objects through worker processes (bench/python_objects.py)
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 300 $PY "$OLDPWD/bench/python_objects.py" ${PYOBJ_ARGS:-} 2>&1) \
      | tee "$OUT/python_objects.md"
  fi
  if [ "${FIRST_LOADER:-0}" = 1 ]; then  # a process's first loader, ferry against PyTorch (bench/first_loader.py)
    links build/bench-data/photos /tmp/ferry-photos60 60
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 300 $PY "$OLDPWD/bench/first_loader.py" --images /tmp/ferry-photos60 \
      ${FIRST_LOADER_ARGS:-} 2>&1) | tee "$OUT/first_loader.md"
  fi
  if [ "${RESNET_BENCH:-0}" = 1 ]; then  # ResNet-50 fed by ferry and by PyTorch's DataLoader (bench/resnet_loaders.py)
    # RESNET_COPIES: links to each photo (60: 10,260 images, 40 batches an epoch; 300: 51,300, 200 batches)
    copies=${RESNET_COPIES:-60}
    links build/bench-data/photos /tmp/ferry-photos$copies $copies
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 300 $PY "$OLDPWD/bench/resnet_loaders.py" --images /tmp/ferry-photos$copies \
      ${RESNET_ARGS:-} 2>&1) | tee "$OUT/resnet.md"
  fi
  if [ "${CEILING_BENCH:-0}" = 1 ]; then  # the recipe's own work, no loader (bench/recipe_ceiling.py)
    copies=${RESNET_COPIES:-60}
    links build/bench-data/photos /tmp/ferry-photos$copies $copies
    (cd /tmp && PYTHONUNBUFFERED=1 timeout 300 $PY "$OLDPWD/bench/recipe_ceiling.py" --images /tmp/ferry-photos$copies \
      ${CEILING_ARGS:-} 2>&1) | tee "$OUT/ceiling.md"
  fi
  exit $rc
fi
# The Python module is built and tested by `python` (with the system compiler; see there).
# GPU_BUILD (default build/gpu) and GPU_CUDA_ARCHITECTURES (default 90; "80-virtual": PTX alone, as
# a build on a machine without a GPU makes it, compiled by the driver at its first launch).
gpu_build=${GPU_BUILD:-build/gpu}
cmake -S . -B "$gpu_build" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DFERRY_TEST_INSTALL=OFF -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DFERRY_BUILD_PYTHON=OFF \
  -DFERRY_NCCL_ROOT="$nccl_root" \
  -DCMAKE_CUDA_ARCHITECTURES="${GPU_CUDA_ARCHITECTURES:-90}" -DFERRY_FASHION_MNIST_DIR=$prefix/usr/share/datasets/fashion-mnist -DZLIB_LIBRARY="$zlib" -DZLIB_LIBRARY_RELEASE="$zlib" > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build "$gpu_build" -j 16 ${BUILD_TARGETS:+--target $BUILD_TARGETS} > "$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -60; exit 1; }
rc=0
if [ "$what" = build ]; then exit 0; fi
if [ "$what" = test ] || [ "$what" = all ] || [ "$what" = gather ]; then
  (cd build/gpu && FERRY_REQUIRE_GPU=1 ctest --output-on-failure --timeout 240 -j 4 2>&1 | tee "$OUT/ctest.log" | tail -25)
  grep -q "100% tests passed" "$OUT/ctest.log" || rc=1
fi
if [ "$what" = demo ] || [ "$what" = all ]; then
  # The demo on the GPU, then the ferry tool on the GPU workloads (its report names the bottleneck).
  D=${FASHION_MNIST:-/tmp/ferry-deps/usr/share/datasets/fashion-mnist}
  timeout 240 build/gpu/examples/fashion_mnist/train_fashion_mnist --data "$D" --epochs 3 2>&1 | tee "$OUT/demo.txt"
  { for w in "-w 1 --intra-threads 8" "-w 8"; do
      timeout 60 build/gpu/ferry bench synthetic -c n=2048,shape=3x224x224 -b 256 $w --device 0 --warmup 20 -n 400 2>/dev/null
      echo; done
    timeout 60 build/gpu/ferry bench idx -c "images=$D/train-images-idx3-ubyte.gz,labels=$D/train-labels-idx1-ubyte.gz,flip=1,mean=0.286,std=0.353" \
      -b 256 -w 8 --device 0 --epochs 3 2>/dev/null
    echo
    timeout 60 build/gpu/ferry bench synthetic -c n=2048,shape=3x224x224 -b 256 -w 1 --intra-threads 8 --device 0 --consumer-ms 10 -n 200 2>/dev/null
    echo
    timeout 120 build/gpu/ferry tune synthetic -c n=2048,shape=3x224x224 -b 256 --device 0 --seconds 1
    timeout 60 build/gpu/ferry trace synthetic -c n=2048,shape=3x224x224 -b 256 -w 2 --intra-threads 4 --device 0 -n 12 -o "$OUT/trace.json" 2>/dev/null
  } 2>&1 | tee "$OUT/ferry-tool.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 200 build/gpu/bench/bench_pin ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_pin.md"
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/peers_torch.py ${PEERS_ARGS:-} 2>&1 | tee "$OUT/peers_torch.md"
fi
if { [ "$what" = bench ] || [ "$what" = all ]; } && [ -d build/bench-data/photos ]; then
  # The loaders on this host's cores (tiles made here by scripts/bench-loaders.sh and carried).
  timeout 120 build/gpu/bench/bench_loaders --photos build/bench-data/photos --runs 3 2>&1 | tee "$OUT/bench_loaders.md"
  # GPU decode and fault handling on 10,260 images: the 171 tiles, 60 links to each.
  P=/tmp/ferry-photos60
  links build/bench-data/photos $P 60
  timeout 200 build/gpu/bench/bench_gpu_decode --photos $P --runs 3 --step-ms 20 --steps 100 2>&1 | tee "$OUT/bench_gpu_decode.md"
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/peers_gpu_decode.py $P --runs 3 2>&1 | tee "$OUT/peers_gpu_decode.md"
  timeout 110 build/gpu/bench/bench_faults --photos $P --runs 3 --trials 12 2>&1 | grep -v "\[warning\]" | tee "$OUT/bench_faults.md"
fi
if [ "$what" = tar ]; then
  # The tar stream (mapped, and decoded into the batch) against the indexed path on the same shards,
  # 1, 4, 11 and 64 of them, over the 500x375 photographs' tiles repeated to TAR_IMAGES (10260:
  # each of 171 tiles 60 times), float, mean/std, 16 workers, batch 256, drop_last; then turboloader
  # (its wheel carried in .whl/) on the 1-shard tar. BUILD_TARGETS=bench_object_store suffices;
  # TAR_ARGS: more arguments for bench_object_store.
  # TAR_SHARDS: the shard counts (default "1 4 11 64"); TAR_ONLY: the rows (bench_object_store --only).
  n=${TAR_IMAGES:-10260}
  { for k in ${TAR_SHARDS:-1 4 11 64}; do per=$(( (n + k - 1) / k )); mkdir -p /tmp/tar-$n-$k
      echo "### $k shards: bench_object_store --photos build/bench-data/photos --images $n --per-shard $per" \
        "--workers 16 --batch 256 --drop-last --float --runs 3 --local-only --no-cache-row ${TAR_ARGS:-}"
      timeout -s KILL 200 build/gpu/bench/bench_object_store --photos build/bench-data/photos --images $n --per-shard $per \
        --workers 16 --batch 256 --drop-last --float --runs 3 --local-only --no-cache-row --keep-shards /tmp/tar-$n-$k \
        --only "${TAR_ONLY:-indexed (TarImages)|stream (TarShards)|TarDecodeStream}" ${TAR_ARGS:-} 2>&1 | grep -v "^object store"; done
    if ls .whl/turboloader-*.whl > /dev/null 2>&1; then
      [ -d /tmp/tl ] || python3 -m pip install -q --no-deps --target /tmp/tl .whl/turboloader-*.whl
      echo "### turboloader: bench/tar_peers.py /tmp/tar-$n-1/train-000.tar --batch 256 --workers 16 --runs 3"
      PYTHONPATH=/tmp/tl timeout -s KILL 200 python3 bench/tar_peers.py /tmp/tar-$n-1/train-000.tar --batch 256 --workers 16 --runs 3 2>&1
    fi; } | tee "$OUT/tar-stream-$n.md"
fi
if [ "$what" = tokens ]; then
  # Token windows: the GPU tests of the device gather over token files (a registration that never
  # returns is killed, not waited for), then `ferry bench tokens` on 200M uint16 tokens with the
  # GPU gathering the windows and with the host path. BUILD_TARGETS="test_gpu ferry_cli" suffices.
  (FERRY_REQUIRE_GPU=1 timeout -s KILL 180 build/gpu/tests/test_gpu "[tokens]" 2>&1 | tail -20) | tee "$OUT/test_gpu_tokens.txt"
  grep -q "All tests passed" "$OUT/test_gpu_tokens.txt" || rc=1
  T=/tmp/tokens-200000000.bin
  [ -f $T ] || python3 -c "import numpy as np; np.random.default_rng(0).integers(0, 50257, 200_000_000, dtype=np.uint16).tofile('$T')"
  { for shape in "1024 64" "2048 32" "8192 8"; do set -- $shape
      for how in "--gather device -w 0" "--gather host -w 4"; do
        echo "## ferry bench tokens -c path=$T,dtype=uint16,seq_len=$1 -b $2 --device 0 $how -n ${TOKEN_BATCHES:-4000}"
        timeout -s KILL 120 build/gpu/ferry bench tokens -c path=$T,dtype=uint16,seq_len=$1 -b $2 --device 0 $how -n ${TOKEN_BATCHES:-4000} 2>&1
        echo; done; done; } | tee "$OUT/ferry-bench-tokens.txt"
fi
if [ "$what" = images ]; then
  # GPU_TESTS: a Catch filter for the suite (e.g. "[decode]"), for short device time.
  (FERRY_REQUIRE_GPU=1 timeout 150 build/gpu/tests/test_gpu ${GPU_TESTS:-"~[multi]"} 2>&1 | tail -20) | tee "$OUT/test_gpu.txt"
  grep -q "All tests passed" "$OUT/test_gpu.txt" || rc=1
  links build/bench-data/photos /tmp/ferry-photos60 60
  timeout 300 build/gpu/bench/bench_gpu_decode --photos /tmp/ferry-photos60 --tar /tmp/ferry-shards60 --runs 3 --step-ms 20 --steps 200 \
    ${IMAGES_ARGS:-} 2>&1 | tee "$OUT/bench_gpu_decode.md"
  M=random_crop=1,mean=0.485:0.456:0.406,std=0.229:0.224:0.225,decode=gpu
  { timeout 40 build/gpu/ferry bench image_folder -b 256 -w 2 --device 0 -n 30 -c root=/tmp/ferry-photos60,$M; echo
    timeout 40 build/gpu/ferry bench tar_index -b 256 -w 2 --device 0 -n 30 -c dir=/tmp/ferry-shards60,$M; } 2>&1 | tee "$OUT/ferry-gpu-decode.txt"
  if [ -d build/old-src ]; then
    timeout 60 build/gpu/bench/bench_loaders --photos build/bench-data/photos --runs 3 --fmnist /none 2>&1 | tee "$OUT/bench_loaders.md"
    cmake -S build/old-src -B build/old-gpu -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release -DFERRY_WITH_CUDA=OFF -DFERRY_TEST_INSTALL=OFF \
      -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DZLIB_LIBRARY="$zlib" -DZLIB_LIBRARY_RELEASE="$zlib" > "$OUT/old-configure.log" 2>&1 &&
      cmake --build build/old-gpu -j 16 --target bench_loaders > "$OUT/old-build.log" 2>&1 &&
      timeout 60 build/old-gpu/bench/bench_loaders --photos build/bench-data/photos --runs 3 --fmnist /none 2>&1 | tee "$OUT/bench_loaders-old.md"
  fi
fi
if [ "$what" = images-loop ]; then  # the training loop alone (steps of 1 and 40 kernels, priority off and on)
  links build/bench-data/photos /tmp/ferry-photos60 60
  timeout 200 build/gpu/bench/bench_gpu_decode --photos /tmp/ferry-photos60 --loop-only --step-ms 20 --steps 200 ${LOOP_ARGS:-} 2>&1 | tee "$OUT/bench_gpu_decode-loop.md"
fi
if [ "$what" = images-peers ]; then
  # The peers on the 500x375 set, then ferry and the peers on the 1500x1000 tiles (build/bench-data/photos-1500).
  links build/bench-data/photos /tmp/ferry-photos60 60
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/peers_gpu_decode.py /tmp/ferry-photos60 --runs 3 2>&1 | tee "$OUT/peers_gpu_decode.md"
  if [ -d build/bench-data/photos-1500 ]; then
    links build/bench-data/photos-1500 /tmp/ferry-photos1500 40
    timeout 120 build/gpu/bench/bench_gpu_decode --photos /tmp/ferry-photos1500 --runs 3 --steps 0 2>&1 | tee "$OUT/bench_gpu_decode-1500.md"
    PYTHONUNBUFFERED=1 timeout 150 python3 bench/peers_gpu_decode.py /tmp/ferry-photos1500 --runs 3 2>&1 | tee "$OUT/peers_gpu_decode-1500.md"
  fi
fi
if [ "$what" = gather ]; then
  # The device gather beside the host path and the link, then PyTorch's DataLoader on (a) and (b).
  timeout 300 build/gpu/bench/bench_gather ${GATHER_ARGS:-} 2>&1 | tee "$OUT/bench_gather.md"
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/peers_torch.py ${PEERS_ARGS:---workers 8} 2>&1 | tee "$OUT/peers_torch.md"
fi
if [ "$what" = rows ]; then
  (FERRY_REQUIRE_GPU=1 timeout 200 build/gpu/tests/test_gpu "[gather]" 2>&1 | tail -20) | tee "$OUT/test_gpu.txt"
  grep -q "All tests passed" "$OUT/test_gpu.txt" || rc=1
  D=/tmp/ferry-deps/usr/share/datasets/fashion-mnist
  for g in host device host device; do
    timeout 120 build/gpu/examples/fashion_mnist/train_fashion_mnist --data "$D" --epochs 3 --gather $g 2>&1
  done | tee "$OUT/demo.txt"
  I="images=$D/train-images-idx3-ubyte.gz,labels=$D/train-labels-idx1-ubyte.gz,flip=1,mean=0.286,std=0.353"
  for w in "-w 8 --gather host" "-w 14 --gather host" "-w 0 --gather device" "-w 1 --gather device"; do
    timeout 60 build/gpu/ferry bench idx -c "$I" -b 256 $w --device 0 --epochs 10 2>/dev/null; echo
  done | tee "$OUT/ferry-idx.txt"
  timeout 300 build/gpu/bench/bench_gather ${GATHER_ARGS:-} 2>&1 | tee "$OUT/bench_gather.md"
fi
if [ "$what" = multi ]; then
  [ -n "$nccl_root" ] && export LD_LIBRARY_PATH=$nccl_root/lib:$LD_LIBRARY_PATH
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # keep multicast off (KINDS.md)
  { nvidia-smi -L; nvidia-smi topo -m; echo; numactl -H 2>/dev/null || echo "numactl: none"; lscpu | grep -i -E "numa|socket|^CPU\(s\)";
    echo "online nodes: $(cat /sys/devices/system/node/online 2>/dev/null)";
    for g in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader); do
      a=$(echo "$g" | tr 'A-Z' 'a-z' | sed 's/^0000//'); echo "GPU $g: numa_node $(cat /sys/bus/pci/devices/$a/numa_node 2>/dev/null)"; done
  } 2>&1 | tee "$OUT/topology.txt"
  TR="torchrun --standalone --no-python"
  if [ "${MULTI_TESTS:-1}" = 1 ]; then  # MULTI_TESTS=0: the layout and the benchmarks only
    (FERRY_REQUIRE_GPU=1 FERRY_REQUIRE_GPUS=2 timeout 200 build/gpu/tests/test_gpu 2>&1 | tail -20) | tee "$OUT/test_gpu.txt"
    grep -q "All tests passed" "$OUT/test_gpu.txt" || rc=1
    { timeout 90 $TR --nproc-per-node 2 build/gpu/tests/dist_epoch || rc=1
      timeout 60 build/gpu/tests/dist_epoch || rc=1
      if command -v mpirun > /dev/null; then timeout 90 mpirun --allow-run-as-root -np 2 build/gpu/tests/dist_epoch || rc=1; else echo "mpirun: not on this host"; fi
    } 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*\*" | tee "$OUT/dist_epoch.txt"
    D=/tmp/ferry-deps/usr/share/datasets/fashion-mnist
    { timeout 120 $TR --nproc-per-node 2 build/gpu/examples/ddp/train_ddp --data $D --epochs 3 --min-accuracy 0.80 || rc=1
      timeout 120 $TR --nproc-per-node 1 build/gpu/examples/ddp/train_ddp --data $D --epochs 3 || rc=1
    } 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*\*" | tee "$OUT/train_ddp.txt"
  fi
  links build/bench-data/photos /tmp/ferry-photos60 60
  B="build/gpu/bench/bench_multi_gpu --photos /tmp/ferry-photos60 ${MULTI_ARGS:-}"
  { timeout 100 $B --devices 0; timeout 100 $B --devices 0,1
    timeout 100 $TR --nproc-per-node 1 $B --cpu-slices 2; timeout 100 $TR --nproc-per-node 2 $B --cpu-slices 2
  } 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*\*" | tee "$OUT/bench_multi_gpu.log" | grep "^|" | tee "$OUT/bench_multi_gpu.md"
  { PYTHONUNBUFFERED=1 timeout 150 torchrun --standalone --nproc-per-node 1 bench/peers_torch_ddp.py --cpu-slices 2
    PYTHONUNBUFFERED=1 timeout 150 torchrun --standalone --nproc-per-node 2 bench/peers_torch_ddp.py --cpu-slices 2
  } 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*\*" | tee "$OUT/peers_torch_ddp.md"
fi
if [ "$what" = bench ] || [ "$what" = all ] || [ "$what" = libtorch ]; then
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  if cmake -S bench/peers_libtorch -B build/libtorch -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
       > "$OUT/libtorch-configure.log" 2>&1 && cmake --build build/libtorch -j 16 > "$OUT/libtorch-build.log" 2>&1; then
    timeout 240 build/libtorch/peers_libtorch 2>&1 | tee "$OUT/peers_libtorch.md"
  else
    echo "peers_libtorch: build failed"; tail -20 "$OUT/libtorch-configure.log" "$OUT/libtorch-build.log"
  fi
fi
exit $rc
