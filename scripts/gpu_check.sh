#!/usr/bin/env bash
# The GPU check, in one run on a machine with a CUDA GPU (no network needed): builds posenc's core
# Python extension (no CLI, tests, figures or bench suite), runs posenc.triton's tests on the GPU
# (tests/python/test_triton.py with POSENC_TRITON_DEVICE=cuda: every case on CUDA tensors, the
# kernels compiled, bf16 through native bf16 dot products; tests/python/test_cuda.py: every op
# with a CUDA form against the CPU, eager, compiled and exported) and the benchmark table
# (bench/gpu_bench.py), and writes everything into one folder:
#
#   bash scripts/gpu_check.sh [OUT_DIR]     # default: gpu-results/
#     OUT_DIR/env.txt     GPU, driver, torch, triton, python
#     OUT_DIR/tests.txt   pytest's output
#     OUT_DIR/bench.md    the benchmark table (docs/gpu.md, "Speed")
#
# Highway and nlohmann-json come from the system, or from .deb files in .gpu/ (scripts/
# gpu_deps.sh fetches them where there is a network), unpacked under /tmp. The interpreter is
# POSENC_GPU_PYTHON (default python3: the one holding PyTorch and Triton). Designed to finish in
# under 8 minutes on an H100 / H200 class GPU (the build takes most of it on 16 cores).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
py=${POSENC_GPU_PYTHON:-python3}
start=$(date +%s)
step() { echo "== $1 ($(($(date +%s) - start)) s)"; }

prefix=/tmp/posenc-gpu-deps
extra=()
if compgen -G ".gpu/*.deb" >/dev/null; then
  mkdir -p "$prefix"
  for f in .gpu/*.deb; do dpkg -x "$f" "$prefix"; done
  extra+=("-DCMAKE_PREFIX_PATH=$prefix/usr;$prefix/usr/lib/x86_64-linux-gnu/cmake")
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

step "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$py" -c "import sys, torch, triton; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); print('triton', triton.__version__)"
  nproc
} 2>&1 | tee "$out/env.txt"

step "build"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_CLI=OFF \
  -DPOSENC_BUILD_TESTS=OFF -DPOSENC_PYTHON_EXTRAS=OFF -DPOSENC_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$(command -v "$py")" -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" \
  "${extra[@]}" >"$out/build.txt" 2>&1 &&
  cmake --build build-gpu --target posenc_python_stage -j"$(nproc)" >>"$out/build.txt" 2>&1
status=$?
tail -5 "$out/build.txt"
[ $status -eq 0 ] || { echo "build failed (see $out/build.txt)"; exit 1; }
export PYTHONPATH="$PWD/build-gpu/python/stage"

step "tests on the GPU"
POSENC_TRITON_DEVICE=cuda timeout 240 "$py" -m pytest -q -p no:cacheprovider \
  tests/python/test_triton.py tests/python/test_cuda.py \
  "tests/python/test_distributed.py::test_context_parallel_on_the_triton_kernels[cuda]" \
  2>&1 | tee "$out/tests.txt"
tests=${PIPESTATUS[0]}

step "benchmarks"
timeout 240 "$py" bench/gpu_bench.py --out "$out/bench.md" 2>&1 | tail -40
bench=${PIPESTATUS[0]}
step "done (tests: exit $tests, bench: exit $bench)"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
