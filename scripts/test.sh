#!/usr/bin/env bash
# Installs what is missing, builds everything the tests need and runs the whole suite with ctest:
# the C++ tests and the Python tests (pytest over tests/python, the ctest test python_tests, run
# against the package staged in the build). Then installs the package with pip into .venv from
# the same build (nothing recompiled) and imports it from there.
set -euo pipefail
cd "$(dirname "$0")/.."
POSENC_WITH_CHROMIUM=1 bash scripts/deps.sh
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=Release -DPOSENC_BUILD_TESTS=ON \
  -DPOSENC_BUILD_PYTHON=ON >/dev/null
cmake --build build-test -j"$(nproc)"
# The SIMD targets this processor lets the suite run, and those compiled but skipped here
# (docs/architecture.md, "Lane order at every vector width").
build-test/tests/test_simd_coverage 2>&1 | grep '^SimdCoverage:' || true
# Tests run side by side (-j): idle OpenMP threads should sleep, not spin on the shared cores.
OMP_WAIT_POLICY=passive ctest --test-dir build-test --output-on-failure -j"$(nproc)" "$@"
# The README's install path: pip into .venv (system site packages), from build-test.
[ -x .venv/bin/python ] || /usr/bin/python3 -m venv --system-site-packages .venv
POSENC_CMAKE_BUILD_DIR=build-test .venv/bin/pip install --no-build-isolation --no-index --quiet .
(cd /tmp && "$OLDPWD/.venv/bin/python" -c "
import numpy as np, posenc, posenc.torch, torch
q = np.ones((1, 4, 2, 8), np.float32)
assert posenc.attention(q, q, q, 'alibi', causal=True).shape == q.shape
t = torch.ones(1, 4, 2, 8, requires_grad=True)
posenc.torch.attention(t, t, t, 'rope', causal=True).sum().backward()
print('posenc: pip-installed package OK:', posenc.__file__)")
