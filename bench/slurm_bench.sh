#!/usr/bin/env bash
# Slurm figures on the local Slurm (scripts/slurm-local.sh, started by the test if needed):
# runs the warning case of slurm_e2e_test RUNS times (two groups, real replica_agent and
# test_trainer, lighthouse on 127.0.0.1) with LK_SLURM_BENCH_OUT set, and prints the
# min / median / max of each figure. The clocks are the agent's and the batch shell's log
# timestamps (one host, one clock) against the moment the test sends
# `scancel --batch --signal=USR2`; the restart figures start at the batch shell's
# `event=start` of the requeued life.
#
#   bench/slurm_bench.sh [BUILD_DIR] [RUNS]     (defaults: build-se2e, 5)
#
# Build first: ninja -C BUILD_DIR -j1 slurm_e2e_test lighthouse replica_agent test_trainer lkctl
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build-se2e}" && pwd)
runs=${2:-5}
out=$(mktemp /tmp/lk-slurm-bench-XXXXXX.jsonl)
export LK_BIN_DIR=$build/bin LK_SOURCE_DIR=$root LK_SLURM_BENCH_OUT=$out
export SLURM_CONF=${SLURM_CONF:-${SLURM_BASE:-/tmp/lk-slurm}/slurm.conf}
for i in $(seq 1 "$runs"); do
  if ! "$build/bin/slurm_e2e_test" -tc='*warning*' > "$out.run$i.log" 2>&1; then
    echo "slurm_bench: run $i failed, see $out.run$i.log" >&2
    exit 1
  fi
done
echo "# $runs runs, $(nproc) CPUs, $(sinfo --version), figures in ms (min / median / max)"
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
names = {
    "warning_to_trap_ms": "warning -> batch shell trap",
    "warning_to_classified_ms": "warning -> agent classified the leave (scontrol show job)",
    "warning_to_saved_ms": "warning -> durable checkpoint (trainer exited after drain)",
    "warning_to_left_ms": "warning -> group left the quorum (reason preempted)",
    "warning_to_requeued_ms": "warning -> scontrol requeue done",
    "restart_to_quorum_ms": "restart -> in the quorum with a heal plan",
    "restart_to_healed_allreduce_ms": "restart -> first healed allreduce with the other group",
}
print("| figure | min | median | max |")
print("|---|---|---|---|")
for key, label in names.items():
    v = sorted(r[key] for r in rows)
    print(f"| {label} | {v[0]} | {statistics.median(v):.0f} | {v[-1]} |")
PY
echo "# raw: $out"
