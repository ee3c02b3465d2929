#!/bin/bash
# The portable bundle's figures: its size, the time to unpack it, and the time from starting the
# bundled lighthouse (bin/ script -> bundled loader -> program) to its first /healthz answer,
# beside the same for the build tree's lighthouse (the host's loader and libraries) in the same
# run. Medians of ROUNDS (default 5). Usage: bench/bundle_bench.sh BUILD_DIR [TARBALL]
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-5}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-bundle-bench-XXXXXX")
trap 'rm -rf "$TMP"' EXIT
if [ $# -ge 2 ]; then
  TARBALL=$2
else
  bash "$SRC/scripts/bundle.sh" "$BUILD" "$TMP/out" > "$TMP/bundle.log" 2>&1
  TARBALL=$(tail -1 "$TMP/bundle.log")
fi
now_ms() { date +%s%3N; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

# Starts a lighthouse (the command line in "$@"), returns the ms until /healthz answered.
time_to_answer() {
  local log=$TMP/lh.log t0 addr pid
  rm -rf "$TMP/lh"
  t0=$(now_ms)
  "$@" --bind 127.0.0.1:0 --data-dir "$TMP/lh" > "$log" 2>&1 &
  pid=$!
  until addr=$(grep -o 'listening address=[^ ]*' "$log" | cut -d= -f2) && [ -n "$addr" ] &&
        curl -sf "http://$addr/healthz" > /dev/null; do
    kill -0 "$pid" 2> /dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.005
  done
  echo $(( $(now_ms) - t0 ))
  kill "$pid"; wait "$pid" 2> /dev/null || true
}

unpack=() bundled=() plain=()
for _ in $(seq "$ROUNDS"); do
  rm -rf "$TMP/u"; mkdir "$TMP/u"
  t0=$(now_ms); tar -C "$TMP/u" -xzf "$TARBALL"; unpack+=($(( $(now_ms) - t0 )))
  B=$(echo "$TMP"/u/lightkeeper-*)
  bundled+=("$(time_to_answer "$B/bin/lighthouse")")
  plain+=("$(time_to_answer "$BUILD/bin/lighthouse")")
done
packed=$(du -m "$TARBALL" | cut -f1)
unpacked=$(du -sm "$B" | cut -f1)
bm=$(printf '%s\n' "${bundled[@]}" | median)
pm=$(printf '%s\n' "${plain[@]}" | median)
um=$(printf '%s\n' "${unpack[@]}" | median)
echo "bundle_size packed_mb=$packed unpacked_mb=$unpacked"
echo "unpack_ms median=$um rounds=$ROUNDS"
echo "lighthouse_answers_ms bundled=$bm build_tree=$pm ratio=$(awk -v a="$bm" -v b="$pm" 'BEGIN {printf "%.2f", a / b}')"
echo "unpack_to_answer_ms median=$((um + bm))"
