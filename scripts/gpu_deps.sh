#!/usr/bin/env bash
# Fetches, on a machine with the network, the Debian packages that posenc's C++ library needs to
# build on a GPU machine that has a compiler, CMake, Python, PyTorch and Triton but neither
# Highway nor nlohmann-json, and no network: libhwy-dev, libhwy1 and nlohmann-json3-dev, as .deb
# files in .gpu/ (ignored by git). scripts/gpu_check.sh unpacks them there (dpkg -x, no install).
#
#   bash scripts/gpu_deps.sh        # then carry .gpu/ to the GPU machine with the checkout
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
(cd .gpu && apt-get download libhwy-dev libhwy1 nlohmann-json3-dev)
ls -l .gpu
