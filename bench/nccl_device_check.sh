#!/usr/bin/env bash
# The NCCL communicator on a GPU machine, in one short run: builds what it needs, runs the NCCL
# test case of comm_test (one rank per GPU), then a small bandwidth figure with one
# comm_test_peer per GPU rendezvousing through a file store.
# Usage, from the repository root: bench/nccl_device_check.sh [BUILD_DIR] [MIB]
set -euo pipefail
build=${1:-build-comm}
mib=${2:-256}
gpus=$(nvidia-smi -L | wc -l)
echo "gpus=$gpus build=$build"
cmake -S . -B "$build" -G Ninja >/dev/null
ninja -C "$build" comm_test comm_test_peer lighthouse >/dev/null
export NCCL_SOCKET_IFNAME=lo LK_TEST_GPUS=$gpus LK_BIN_DIR=$PWD/$build/bin
export LK_SOURCE_DIR=$PWD

# Tests: the NCCL case (it skips only when no device is usable).
"$build/bin/comm_test" --test-case='nccl*' --success=false

# Bandwidth: float32 sum allreduce of MIB MiB, 20 rounds after 2 warm-up rounds.
store=$(mktemp -d)
count=$((mib * 1024 * 1024 / 4))
for ((r = 0; r < gpus; r++)); do
  printf 'reconfigure 1 %d %d\nbench %d 2\nbench %d 20\nexit\n' "$r" "$gpus" "$count" "$count" |
    "$build/bin/comm_test_peer" --backend nccl --device "$r" --store "file:$store" \
      >"$store/out$r" 2>"$store/log$r" &
done
wait
us=$(grep -h 'ok bench us=' "$store/out0" | tail -1 | sed 's/.*us=//')
[ -n "$us" ] || { cat "$store/out0" "$store/log0"; exit 1; }
awk -v us="$us" -v mib="$mib" -v n="$gpus" 'BEGIN {
  t = us / 20 / 1e6; bytes = mib * 1048576;
  bus = (n > 1) ? bytes * 2 * (n - 1) / n / t / 1e9 : 0;
  printf "nccl allreduce f32 %d MiB x %d GPUs: %.3f ms, algbw %.1f GB/s, busbw %.1f GB/s\n",
         mib, n, t * 1e3, bytes / t / 1e9, bus }'
rm -rf "$store"
