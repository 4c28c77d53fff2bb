#!/usr/bin/env bash
# Builds the library, the CLI, the whole C++ test suite and the Python extension posenc._posenc
# with AddressSanitizer + UndefinedBehaviorSanitizer (g++, -O1, ccache) in build-asan/, runs ctest
# there, then runs pytest over the Python tests that drive the extension hardest against the
# sanitized package staged in build-asan/python/stage. CI runs it after the README's test command
# (.ci/run). Any sanitizer report fails the test that triggered it:
#   - UBSan aborts on the first report (-fno-sanitize-recover=all);
#   - LeakSanitizer is on for the C++ tests; leaks of third-party libraries we cannot fix
#     (fontconfig's caches, reached through cairo's text API) are suppressed by name in
#     tests/sanitizers/lsan.supp, never by turning leak detection off. The Python process is the
#     exception: CPython, NumPy and torch keep allocations until exit by design, so leak detection
#     is off there (every other ASan check stays on).
#
#   bash scripts/sanitize.sh [ctest arguments, e.g. -R Hostile]   # C++ tests, then Python tests
#   POSENC_SANITIZE=cpp bash scripts/sanitize.sh [ctest arguments] # the C++ tests only
#   POSENC_SANITIZE=python bash scripts/sanitize.sh [pytest arguments, e.g. -k paged]
#                                      # the Python tests only; builds only what they need
set -euo pipefail
cd "$(dirname "$0")/.."
part="${POSENC_SANITIZE:-all}"
case "$part" in
  all | cpp | python) ;;
  *) echo "sanitize.sh: POSENC_SANITIZE must be all, cpp or python (got '$part')" >&2; exit 2 ;;
esac
bash scripts/deps.sh
# The extension is built against .venv's interpreter and pybind11, as scripts/test.sh does (CI
# made .venv there already; made here only when missing).
py="$PWD/.venv/bin/python"
"$py" -c "import torch, numpy, pytest, pybind11" 2>/dev/null || bash scripts/python-env.sh
build=build-asan
# The SIMD kernels are compiled for this machine's best target only (-march=native with
# HWY_COMPILE_ONLY_STATIC) instead of every x86 target: the sanitized run checks the code paths
# this machine executes, and the build fits CI's time budget. scripts/test.sh runs every target.
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
flags+=" -march=native -DHWY_COMPILE_ONLY_STATIC=1"
# One configuration for both parts, whichever runs: the library, the figures and the bench harness
# compile once and link into the CLI, the C++ tests and the extension alike.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
  -DCMAKE_SHARED_LINKER_FLAGS="$flags" -DCMAKE_MODULE_LINKER_FLAGS="$flags" \
  -DPOSENC_BUILD_TESTS=ON -DPOSENC_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py" \
  -Dpybind11_DIR="$("$py" -m pybind11 --cmakedir)" >/dev/null
if [ "$part" = python ]; then
  # The staged package only (the extension, the Python modules and the CLI): no C++ tests.
  cmake --build "$build" -j"$(nproc)" --target posenc_python_stage
else
  cmake --build "$build" -j"$(nproc)"
fi

if [ "$part" != python ]; then
  supp="$(pwd)/tests/sanitizers/lsan.supp"
  # The install test builds examples/ against this build: outside the sanitized scope. The
  # Python tests (ctest's python_tests: every file, an interpreter without the sanitizer runtime)
  # run below instead, a chosen subset with the runtime preloaded.
  ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1" \
    LSAN_OPTIONS="suppressions=$supp:print_suppressions=0" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    OMP_WAIT_POLICY=passive ctest --test-dir "$build" --output-on-failure -j"$(nproc)" \
    -E '^(install_and_consume|python_tests|add_a_scheme)$' --timeout 600 "$@"
  if [ "$part" = cpp ]; then
    exit 0
  fi
  set --  # the arguments were ctest's
fi

# The Python tests under ASan + UBSan: the files that call the extension's native entry points
# the most (array validation and conversion, paged caches and block tables, half-precision
# buffers, the fused attention kernels and their backward, the torch custom ops and autograd
# functions, sinks and soft-capping, the figures, hostile and fuzzed arguments): about 600 tests,
# under 2 minutes with ASan on CI's 2 cores. Left out: the Hugging Face, distributed and
# extrapolation tests (minutes in torch and transformers, not in posenc's code: they would not fit
# CI's time budget under ASan), test_flex.py (torch's FlexAttention and torch.compile against
# kernels the files below already run), test_testing.py (transformers' implementations) and
# test_docs.py.
pytests=(test_numpy_api.py test_paged.py test_half.py test_attention.py test_torch_ops.py
         test_torch.py test_engine.py test_sinks.py test_model_inputs.py test_extras.py
         test_hostile.py test_fuzz_api.py)
stage="$PWD/$build/python/stage"
# CPython is not instrumented: the ASan runtime must be the first library loaded, so it is
# preloaded (the extension links libasan and libubsan dynamically: g++'s default), and libstdc++
# with it: ASan intercepts __cxa_throw and finds the real one when it starts, so without
# libstdc++ loaded by then (CPython does not link it) the first C++ exception aborts the process.
# Leak detection off (see above). abort_on_error: a report ends in SIGABRT, on which Python's
# faulthandler (pytest turns it on) prints the Python stack, naming the test. The CLI the tests
# run (POSENC_CLI) is the sanitized one; subprocesses (python -c, the CLI) inherit the preload
# and the options.
env=(LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so.6)"
     ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
     UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1"
     PYTHONPATH="$stage" POSENC_TEST_CONFIGS_DIR="$PWD/tests/configs"
     POSENC_CLI="$stage/posenc/bin/posenc" OMP_WAIT_POLICY=passive
     # The differential fuzzer: 300 examples per property under ASan (1000 in scripts/test.sh);
     # a longer run sets it (docs/reliability.md).
     POSENC_FUZZ_EXAMPLES="${POSENC_FUZZ_EXAMPLES:-300}")
# The tests must import the sanitized extension, not the package pip installed into .venv.
ext=$(env "${env[@]}" "$py" -c "import posenc._posenc as m; print(m.__file__)")
case "$ext" in
  "$stage"/*) ;;
  *) echo "sanitize.sh: posenc._posenc imported from $ext, not $stage" >&2; exit 1 ;;
esac
# ldd's whole output first: `ldd | grep -q` under pipefail fails whenever grep stops reading
# before ldd has written everything (ldd then dies of SIGPIPE), though libasan is there.
libs=$(ldd "$ext")
case "$libs" in
  *libasan*) ;;
  *) echo "sanitize.sh: $ext is not instrumented" >&2; exit 1 ;;
esac
echo "== pytest under ASan + UBSan: ${#pytests[@]} files, $ext"
t0=$(date +%s)
# pytest captures sys.stdout and sys.stderr only (--capture=sys), not the file descriptors: a
# sanitizer report is written to fd 2 as the process dies and would be lost in a capture file.
# A hang gets SIGABRT (faulthandler's stacks) after 10 minutes, as ctest's --timeout above.
timeout -s ABRT -k 30 600 env "${env[@]}" "$py" -m pytest -q -p no:cacheprovider \
  --capture=sys "${pytests[@]/#/tests/python/}" "$@"
echo "== pytest under ASan + UBSan: $(($(date +%s) - t0)) s"
