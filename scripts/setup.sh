#!/usr/bin/env bash
# Installs what is missing, builds posenc (library + CLI) and runs the demo on embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)" --target posenc_cli
./build/cli/posenc demo "$@"
