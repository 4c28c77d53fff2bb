#!/usr/bin/env bash
# Installs what is missing, builds everything the tests need and runs the whole suite with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
POSENC_WITH_CHROMIUM=1 bash scripts/deps.sh
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_TESTS=ON >/dev/null
cmake --build build-test -j"$(nproc)"
# Tests run side by side (-j): idle OpenMP threads should sleep, not spin on the shared cores.
OMP_WAIT_POLICY=passive ctest --test-dir build-test --output-on-failure -j"$(nproc)" "$@"
