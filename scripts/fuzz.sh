#!/usr/bin/env bash
# Builds posenc's libFuzzer targets (fuzz/) with clang + ASan + UBSan and runs each for a while.
#
#   bash scripts/fuzz.sh                 # every target, 60 s each
#   bash scripts/fuzz.sh 20              # 20 s each (what CI runs: .ci/run)
#   bash scripts/fuzz.sh 600 npy         # one target (npy, safetensors, config, cli) for 10 min
#
# New inputs go to build-fuzz/corpus/<target>/ (not into the repository); the checked-in seeds
# fuzz/corpus/<target>/ and the dictionary fuzz/dict/<target>.dict are read-only. A crash writes
# build-fuzz/crash-* and fails the script; reproduce with build-fuzz/fuzz_<target> FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(npy safetensors config cli)

bash scripts/deps.sh  # the libraries posenc itself needs
# clang 14 with libFuzzer and the sanitizer runtimes (Debian: clang, libclang-rt-14-dev).
for p in clang libclang-rt-14-dev; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev
    break
  fi
done

build=build-fuzz
CXX=clang++ cmake -S fuzz -B "$build" -G Ninja >/dev/null
cmake --build "$build" -j"$(nproc)" --target $(printf 'fuzz_%s ' "${targets[@]}")

status=0
for t in "${targets[@]}"; do
  mkdir -p "$build/corpus/$t"
  echo "fuzz_$t: ${seconds} s"
  # -rss_limit_mb: posenc refuses what exceeds POSENC_MAX_BYTES (64M in the targets) long before.
  if ! (cd "$build" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
        "./fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -max_len=65536 \
        -print_final_stats=1 -dict="../fuzz/dict/$t.dict" "corpus/$t" "../fuzz/corpus/$t" \
        2>"fuzz_$t.log"); then
    echo "fuzz_$t: FAILED (log: $build/fuzz_$t.log)"
    tail -40 "$build/fuzz_$t.log"
    status=1
  else
    grep -E "^stat::number_of_executed_units|^stat::new_units_added" "$build/fuzz_$t.log" |
      sed "s/^/  /"
  fi
done
exit $status
