#!/usr/bin/env bash
# Installs the Debian packages posenc needs, only those that are missing.
set -euo pipefail
pkgs=(g++ cmake ninja-build ccache pkg-config libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
      libhwy-dev libopenblas-dev libcairo2-dev
      fonts-dejavu-core
      # The Python package (python/, docs/python.md): the interpreter's headers and venv with pip;
      # torch, NumPy, pybind11 and the rest come from the Python package index into .venv
      # (scripts/python-env.sh).
      python3-dev python3-venv
      # The extrapolation experiment (docs/extrapolation.md): its corpus, the King James Bible
      # (the text, bible-kjv-text, and the program that prints it, bible-kjv).
      bible-kjv-text bible-kjv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "posenc: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Headless Chromium renders the `posenc demo` page in tests/test_plot.cc (the test skips without
# it). Large (~350 MB installed), so only on request (scripts/test.sh: POSENC_WITH_CHROMIUM=1) and
# best effort: a failed install only warns.
if [ "${POSENC_WITH_CHROMIUM:-0}" = 1 ] && [ ! -x /usr/bin/chromium ]; then
  echo "posenc: installing chromium (for the demo-page browser test)"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  { $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium; } ||
    echo "posenc: warning: chromium could not be installed; the demo-page browser test will skip" >&2
fi
