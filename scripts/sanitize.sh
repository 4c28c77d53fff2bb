#!/usr/bin/env bash
# Builds the library, the CLI and the whole test suite with AddressSanitizer + UndefinedBehavior-
# Sanitizer (g++, -O1, ccache) in build-asan/ and runs ctest there. CI runs it after the README's
# test command (.ci/run). Any sanitizer report fails the test that triggered it:
#   - UBSan aborts on the first report (-fno-sanitize-recover=all);
#   - LeakSanitizer is on; leaks of third-party libraries we cannot fix (fontconfig's caches,
#     reached through cairo's text API) are suppressed by name in tests/sanitizers/lsan.supp,
#     never by turning leak detection off.
#   bash scripts/sanitize.sh [ctest arguments, e.g. -R Hostile]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
build=build-asan
# The SIMD kernels are compiled for this machine's best target only (-march=native with
# HWY_COMPILE_ONLY_STATIC) instead of every x86 target: the sanitized run checks the code paths
# this machine executes, and the build fits CI's time budget. scripts/test.sh runs every target.
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
flags+=" -march=native -DHWY_COMPILE_ONLY_STATIC=1"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
  -DCMAKE_SHARED_LINKER_FLAGS="$flags" -DPOSENC_BUILD_TESTS=ON -DPOSENC_BUILD_PYTHON=OFF \
  >/dev/null
cmake --build "$build" -j"$(nproc)"
supp="$(pwd)/tests/sanitizers/lsan.supp"
export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1"
export LSAN_OPTIONS="suppressions=$supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# The install test builds examples/ against this build: outside the sanitized scope.
OMP_WAIT_POLICY=passive ctest --test-dir "$build" --output-on-failure -j"$(nproc)" \
  -E '^install_and_consume$' --timeout 600 "$@"
