#!/usr/bin/env bash
# Installs the Debian packages posenc needs, only those that are missing.
set -euo pipefail
pkgs=(g++ cmake ninja-build ccache pkg-config libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
      libhwy-dev libopenblas-dev libcairo2-dev)
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
