#!/usr/bin/env bash
# Overlapped outer steps (--outer-overlap, issue 15): the loss at equal steps against the
# blocking outer step, both measured in this one run on this machine:
#
#  - a job of W groups of one diloco_trainer, blocking, and the same job overlapped (same seeds,
#    model, data; the lighthouse waits for all W groups: --min-replicas W);
#  - the same pair with a single group, whose overlapped run must equal the blocking one bit
#    for bit (its stand-in for the average is the average): global_hash at every step.
# The loss is eval_loss: the global weights on fixed evaluation batches, the same in every
# member. Wall time on slow links is bench/netns/shaped_links.sh's (setting overlap).
#
#   bench/overlap_bench.sh [BUILD_DIR] [STEPS] [INNER_STEPS] [GROUPS] [SEED] [MOMENTUM]
#   (build, 30, 8, 4, 11, 0.9)
#
# Build first: ninja -C BUILD_DIR diloco_trainer replica_agent lighthouse
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-30}
inner=${3:-8}
groups=${4:-4}
seed=${5:-11}
momentum=${6:-0.9}
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
dir=$(mktemp -d "${TMPDIR:-/tmp}/lk-overlap-bench-XXXXXX")
# The tests' character model (examples/diloco/trainer.h defaults), evaluated at every commit.
model=(--eval-batches 8 --op-timeout-ms 60000 --outer-momentum "$momentum")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# One job: $1 name, $2 groups, then extra trainer flags.
run_job() {
  local job=$1 ngroups=$2
  shift 2
  local jdir="$dir/$job" agents=() trainers=()
  mkdir -p "$jdir"
  lk_bench_lighthouse "$build" "$jdir" "$ngroups" 60000
  for g in $(seq 0 $((ngroups - 1))); do
    "$build/bin/replica_agent" --lighthouse "http://$LK_BENCH_LH_ADDR" --job "$job" \
      --group-id "g$g" --socket "$jdir/g$g.sock" --heartbeat-interval-ms 100 \
      > "$jdir/agent-g$g.log" 2>&1 &
    agents+=($!)
  done
  for g in $(seq 0 $((ngroups - 1))); do
    for _ in $(seq 1 100); do [ -S "$jdir/g$g.sock" ] && break; sleep 0.1; done
    LK_AGENT_SOCKET="$jdir/g$g.sock" LK_GROUP_ID="g$g" "$build/bin/diloco_trainer" \
      --group-rank 0 --group-size 1 --inner-steps "$inner" --outer-steps "$steps" \
      --seed "$seed" --log "$jdir/g$g.jsonl" "${model[@]}" "$@" 2> "$jdir/g$g.stderr" &
    trainers+=($!)
  done
  lk_bench_wait_trainers overlap_bench "$jdir" "${trainers[@]}"
  lk_bench_stop "$LK_BENCH_LH_PID" "${agents[@]}"
}

started=$(date +%s)
run_job solo-blocking 1
run_job solo-overlap 1 --outer-overlap
run_job blocking "$groups"
run_job overlap "$groups" --outer-overlap
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# $(nproc) CPUs, load average before $load_before, after $load_after;" \
  "$(( $(date +%s) - started )) s; logs in $dir"
echo "# T=$steps outer steps of H=$inner inner steps, seed $seed, outer momentum $momentum"
/usr/bin/python3 - "$dir" "$steps" <<'PY'
import json, sys

d, T = sys.argv[1], int(sys.argv[2])


def lines(job, g=0):
    return {x["step"]: x for x in map(json.loads, open(f"{d}/{job}/g{g}.jsonl"))}


a, b = lines("solo-blocking"), lines("solo-overlap")
same = all(a[s]["global_hash"] == b[s]["global_hash"] for s in a) and a.keys() == b.keys()
print(f"\nOne group: overlapped global_hash equal to blocking at all {len(a)} steps: {same}")
bl, ov = lines("blocking"), lines("overlap")
print(f"\neval_loss (fixed batches) of the global weights, {T} steps:\n")
print("| step | blocking | overlapped | overlapped / blocking |")
print("|---|---|---|---|")
for s in sorted(set(range(5, T + 1, 5)) | {T}):
    if s in bl and s in ov:
        x, y = bl[s]["eval_loss"], ov[s]["eval_loss"]
        print(f"| {s} | {x:.4f} | {y:.4f} | {y / x:.3f} |")
# The step at which blocking first reaches the overlapped run's final loss: the lag in steps.
final = ov[T]["eval_loss"]
reach = next((s for s in sorted(bl) if bl[s]["eval_loss"] <= final), None)
print(f"\nblocking reaches the overlapped run's final loss {final:.4f} at step {reach} of {T}")
PY
