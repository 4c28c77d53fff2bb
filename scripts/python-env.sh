#!/usr/bin/env bash
# Makes .venv/: a plain virtual environment (no system site packages) with the newest torch 2.x
# and NumPy 2.x from the Python package index, pytest, hypothesis (the Python API's differential
# fuzzer, tests/python/test_fuzz_api.py), matplotlib (the extrapolation experiment's
# figures), transformers (posenc.hf and the tests that run Hugging Face models) and the package's
# build requirements (scikit-build-core, pybind11: the test build compiles the extension against
# this pybind11). pip keeps the downloaded wheels in its cache, so
# a second run downloads nothing unless a newer release appeared.
set -euo pipefail
cd "$(dirname "$0")/.."
# A venv that sees the system's packages (an older layout of this project) is made anew.
if [ -f .venv/pyvenv.cfg ] && grep -q "include-system-site-packages = true" .venv/pyvenv.cfg; then
  echo "posenc: replacing .venv (it saw the system's site packages)"
  rm -rf .venv
fi
[ -x .venv/bin/python ] || /usr/bin/python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet --upgrade "torch>=2.4,<3" "numpy>=2,<3" pytest hypothesis matplotlib \
  "transformers>=5" "scikit-build-core>=0.10" "pybind11>=2.12"
.venv/bin/python -c "import torch, numpy; print('posenc: .venv has torch', torch.__version__, \
'and NumPy', numpy.__version__)"
