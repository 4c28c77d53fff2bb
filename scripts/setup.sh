#!/usr/bin/env bash
# Installs what is missing (Debian packages for the C++ build; torch, NumPy and the build
# requirements from the Python package index into .venv/), builds posenc (library + CLI),
# installs the Python package into .venv with pip and runs the demo on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_TESTS=OFF \
  -DPOSENC_BUILD_PYTHON=OFF >/dev/null
cmake --build build -j"$(nproc)" --target posenc_cli
bash scripts/python-env.sh
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/pip install --quiet .
echo "posenc: Python package installed in .venv ($(.venv/bin/python -c 'import posenc; print(posenc.__version__)'))"
./build/cli/posenc demo "$@"
