#!/usr/bin/env bash
# scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Builds the libFuzzer targets of fuzz/ with clang-14 (-fsanitize=fuzzer,address,undefined) in
# their own build directory ($LK_FUZZ_BUILD, default build-fuzz), then runs each target for
# SECONDS_PER_TARGET (default 60) from the corpus kept in the repo (fuzz/corpus/TARGET/, read
# only: inputs found on the way go to a scratch directory). Prints one line per target with its
# executions and exits non-zero when any target crashed, leaked or timed out; the input that did
# it is kept as $LK_FUZZ_BUILD/artifacts/TARGET-crash-... (replay: run the target on that file).
# Exits 77 (CTest's SKIP_RETURN_CODE) where clang-14 or libFuzzer is missing. With
# LK_FUZZ_RUNS=N each target stops after N executions (or SECONDS_PER_TARGET, whichever is first).
# LK_FUZZ_OPT=0 builds at -O0 instead of -O1: faster to build, slower to run (CTest's short runs).
# Targets: the parsers http_head codec range safetensors manifest hostlist, and the route
# fuzzers lighthouse_routes agent_socket_routes agent_serve_routes gateway_routes, which drive
# whole requests through a listener's handlers (default: all). A target with a dictionary
# (fuzz/TARGET.dict: routes, JSON fields, reason codes) gets it.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
[ $# -gt 0 ] && shift
all=(http_head codec range safetensors manifest hostlist lighthouse_routes agent_socket_routes
  agent_serve_routes gateway_routes)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")
build=${LK_FUZZ_BUILD:-build-fuzz}

if ! command -v clang++-14 >/dev/null || ! command -v clang-14 >/dev/null ||
   ! compgen -G "/usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a" >/dev/null; then
  echo "fuzz: clang-14 and libfuzzer-14-dev are needed (scripts/install-deps.sh): skipped"
  exit 77
fi

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
cmake -S fuzz -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang-14 \
  -DCMAKE_CXX_COMPILER=clang++-14 -DLK_FUZZ_OPT="${LK_FUZZ_OPT:-1}" "${launcher[@]}" >/dev/null
ninja -C "$build" -j"${LK_FUZZ_JOBS:-2}" "${targets[@]/#/fuzz_}"

mkdir -p "$build/artifacts"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/lk-fuzz-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
failed=0
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t"
  log="$build/artifacts/$t.log"
  start=$(date +%s.%N)
  rc=0
  # -timeout: one input running past it is a hang, reported like a crash. -rss_limit_mb: one
  # input that makes the parser hold more than this is a finding too.
  runs=()
  [ -n "${LK_FUZZ_RUNS:-}" ] && runs=(-runs="$LK_FUZZ_RUNS")
  [ -f "fuzz/$t.dict" ] && runs+=(-dict="fuzz/$t.dict")
  # The agent targets' own threads (heartbeat, quorum, watch, workers), and the gateway
  # target's relay and lighthouse threads, allocate between inputs, so libFuzzer's leak check
  # after each input cannot tell an input's leak from theirs: it re-runs the input and scans the
  # whole heap (hundreds of MB with ASan's quarantine) for each of its first thousand suspects
  # before it turns itself off, which took more than the first ten minutes of an
  # agent_serve_routes run. Leaks are still found by LeakSanitizer at exit, after the fixture
  # has stopped the agent (or the gateway and its lighthouse).
  case "$t" in agent_* | gateway_routes) runs+=(-detect_leaks=0) ;; esac
  mkdir -p "fuzz/corpus/$t"
  "$build/fuzz_$t" -max_total_time="$seconds" "${runs[@]}" -timeout=60 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$t-" "$scratch/$t" "fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  end=$(date +%s.%N)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  rate=$(awk -v n="${execs:-0}" -v s="$secs" 'BEGIN { printf "%d", (s > 0) ? n / s : 0 }')
  echo "fuzz_result target=$t executions=${execs:-0} seconds=$secs per_second=$rate rc=$rc" |
    tee -a "$build/artifacts/results.txt"
  if [ "$rc" -ne 0 ]; then
    failed=1
    echo "fuzz: $t failed (rc $rc); its log: $log"
    grep -m5 -E "ERROR|Check failed|SUMMARY|Test unit written" "$log" || tail -20 "$log"
  fi
done
exit "$failed"
