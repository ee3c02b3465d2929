#!/usr/bin/env bash
# The Python trainer's outer step against the C++ trainer's on the same model, in one run of this
# script (issue 13's benchmark; goal: within 10%). Each round runs the same job twice, once with
# C++ diloco_trainers and once with examples/python/diloco_trainer.py (Debian's python3, the
# lightkeeper package from BUILD_DIR/python): a lighthouse, two groups of one trainer, the
# trainers' default model (width 64, 2 layers, 4 heads, 64 characters, batch 16), H inner steps
# per outer step, the same seed. The rounds alternate the two kinds (C++ first, then Python,
# then Python first), so the machine's load, which moves, falls on both alike. Every figure is
# read from the trainers' --log lines; steady steps only (not a trainer's first two).
#
#  - step_ms: one whole outer step, commit to commit (H inner steps + the outer step);
#  - inner_ms: the H inner steps (the model's forward, backward and AdamW);
#  - sync_ms: the rest of the step (poll, allreduce, outer update, publish, commit);
#  - coord_ms: poll + commit + join, the coordination the library does around the sync.
#
#   bench/python_trainer_bench.sh [BUILD_DIR] [ROUNDS] [OUTER_STEPS] [INNER_STEPS]
#     (defaults: build, 2, 12, 20)
#
# Build first: ninja -C BUILD_DIR lighthouse replica_agent diloco_trainer lightkeeper_python
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
rounds=${2:-2}
steps=${3:-12}
inner=${4:-20}
work=$(mktemp -d "${TMPDIR:-/tmp}/lk-pytrainer-bench-XXXXXX")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

run_job() {  # run_job KIND DIR: one job of two groups of one trainer; logs DIR/trainer-gN.jsonl
  local kind=$1 dir=$2 g addr agent_pids=() trainer_pids=()
  mkdir -p "$dir"
  lk_bench_lighthouse "$build" "$dir" 2 2000
  pids+=("$LK_BENCH_LH_PID")
  addr=$LK_BENCH_LH_ADDR
  for g in g0 g1; do
    "$build/bin/replica_agent" --lighthouse "http://$addr" --job bench --group-id $g \
      --socket "$dir/$g.sock" --heartbeat-interval-ms 100 >"$dir/agent-$g.log" 2>&1 &
    agent_pids+=($!); pids+=($!)
  done
  for g in g0 g1; do
    for _ in $(seq 1 100); do [ -S "$dir/$g.sock" ] && break; sleep 0.1; done
    local cmd=("$build/bin/diloco_trainer")
    [ "$kind" = python ] && cmd=(/usr/bin/python3 "$root/examples/python/diloco_trainer.py")
    PYTHONPATH="$build/python" LK_AGENT_SOCKET="$dir/$g.sock" LK_GROUP_ID=$g "${cmd[@]}" \
      --group-rank 0 --group-size 1 --inner-steps "$inner" --outer-steps "$steps" --seed 1 \
      --log "$dir/trainer-$g.jsonl" 2>"$dir/trainer-$g.stderr" &
    trainer_pids+=($!); pids+=($!)
  done
  lk_bench_wait_trainers "python_trainer_bench ($kind)" "$dir" "${trainer_pids[@]}"
  lk_bench_stop "$LK_BENCH_LH_PID" "${agent_pids[@]}"
}

for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="cpp python"; else order="python cpp"; fi
  for kind in $order; do run_job "$kind" "$work/$kind-$r"; done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# $(nproc) CPUs, load average before $load_before, after $load_after; logs in $work"
echo "# $rounds rounds of two jobs (C++, Python), 2 groups x 1 trainer, $steps outer steps of H=$inner"
/usr/bin/python3 - "$work" <<'PY'
import glob, json, statistics, sys

work = sys.argv[1]


def steady(kind):
    rows = []
    for p in glob.glob(f"{work}/{kind}-*/trainer-*.jsonl"):
        lines = [json.loads(l) for l in open(p) if l.strip()]
        rows += lines[2:]  # not the first two: process start, first quorum
    return rows


def fig(rows, f):
    return statistics.median(f(x) for x in rows)


out = {}
for kind in ("cpp", "python"):
    rows = steady(kind)
    out[kind] = {
        "step_ms": fig(rows, lambda x: x["step_ms"]),
        "inner_ms": fig(rows, lambda x: x["inner_ms"]),
        "sync_ms": fig(rows, lambda x: x["step_ms"] - x["inner_ms"] - x["eval_ms"]),
        "coord_ms": fig(rows, lambda x: x["poll_ms"] + x["commit_ms"] + x["join_ms"]),
        "n": len(rows), "params": rows[0]["params"],
    }
c, p = out["cpp"], out["python"]
print(f"model: {c['params']} parameters; steady steps: C++ {c['n']}, Python {p['n']}")
print(f"{'median per outer step':24} {'C++':>10} {'Python':>10} {'Python/C++':>11}")
for k in ("step_ms", "inner_ms", "sync_ms", "coord_ms"):
    print(f"{k:24} {c[k]:10.2f} {p[k]:10.2f} {p[k] / c[k]:10.3f}x")
goal = "met" if p["step_ms"] <= 1.10 * c["step_ms"] else "NOT met"
print(f"goal (Python outer step within 10% of C++): {goal}")
PY
