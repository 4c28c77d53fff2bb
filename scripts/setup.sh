#!/usr/bin/env bash
# Installs what is missing, builds posenc (library + CLI), installs the Python package into .venv
# (a virtual environment that sees Debian's NumPy and PyTorch) and runs the demo on embedded
# defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target posenc_cli
# Python: pip drives the same CMake build directory (POSENC_CMAKE_BUILD_DIR), so the library is
# not compiled twice; build requirements are Debian's, hence --no-build-isolation.
[ -x .venv/bin/python ] || /usr/bin/python3 -m venv --system-site-packages .venv
POSENC_CMAKE_BUILD_DIR=build CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  .venv/bin/pip install --no-build-isolation --no-index --quiet .
echo "posenc: Python package installed in .venv ($(.venv/bin/python -c 'import posenc; print(posenc.__version__)'))"
./build/cli/posenc demo "$@"
