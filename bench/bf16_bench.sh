#!/usr/bin/env bash
# bf16 (or fp16) model weights against float32 DiLoCo, measured in this one run: the same job
# twice, two groups of one diloco_trainer each on the example trainer's default model (width
# 64, 2 layers, 4 heads, seq 64, batch 16, H=20), the same seed and data, once with
# --param-dtype float32 and once with --param-dtype DTYPE. Reports, per outer step, the
# group-mean train loss and the eval loss (the global weights on 8 fixed batches) of both runs
# and their relative difference, the largest of them, and the bytes the trainer and the library
# hold (model_bytes, outer_state_bytes). Timing is reported, never asserted.
#
#   bench/bf16_bench.sh [BUILD_DIR] [STEPS] [DTYPE]     (build, 10, bf16)
#
# Build first: ninja -C BUILD_DIR diloco_trainer replica_agent lighthouse
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-10}
dtype=${3:-bf16}
dir=$(mktemp -d "${TMPDIR:-/tmp}/lk-bf16-bench-XXXXXX")
load0=$(cut -d' ' -f1-3 /proc/loadavg)

run_job() {  # $1 name, $2 param dtype
  local name=$1 pd=$2 d="$dir/$1"
  mkdir -p "$d"
  lk_bench_lighthouse "$build" "$d" 2 5000
  local pids=() agents=()
  for g in g0 g1; do
    "$build/bin/replica_agent" --lighthouse "http://$LK_BENCH_LH_ADDR" --job "$name" \
      --group-id "$g" --socket "$d/$g.sock" --heartbeat-interval-ms 100 > "$d/agent-$g.log" 2>&1 &
    agents+=($!)
  done
  for g in g0 g1; do
    for _ in $(seq 1 100); do [ -S "$d/$g.sock" ] && break; sleep 0.1; done
    LK_AGENT_SOCKET="$d/$g.sock" LK_GROUP_ID=$g "$build/bin/diloco_trainer" --group-rank 0 \
      --group-size 1 --outer-steps "$steps" --seed 7 --eval-batches 8 --param-dtype "$pd" \
      --log "$d/$g.jsonl" 2> "$d/$g.stderr" &
    pids+=($!)
  done
  lk_bench_wait_trainers "bf16_bench: $name" "$d" "${pids[@]}"
  lk_bench_stop "$LK_BENCH_LH_PID" "${agents[@]}"
}

run_job float32 float32
run_job "$dtype" "$dtype"

/usr/bin/python3 - "$dir" "$dtype" "$load0" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, os, sys
d, dtype, load0, load1 = sys.argv[1:5]
def rows(run, g):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(d, run, g + ".jsonl")))}
f = {g: rows("float32", g) for g in ("g0", "g1")}
h = {g: rows(dtype, g) for g in ("g0", "g1")}
steps = sorted(f["g0"])
print(f"# two groups of one diloco_trainer, default model, H=20, T={len(steps)}; float32 vs "
      f"{dtype} weights; load average {load0} before, {load1} after; logs in {d}\n")
print(f"| step | train loss f32 | train loss {dtype} | diff | eval loss f32 | eval loss {dtype} "
      f"| diff |")
print("|---|---|---|---|---|---|---|")
worst_train = worst_eval = 0.0
for s in steps:
    # The group-mean loss of the step's inner steps, averaged over the two groups.
    lf = (f["g0"][s]["loss"] + f["g1"][s]["loss"]) / 2
    lh = (h["g0"][s]["loss"] + h["g1"][s]["loss"]) / 2
    ef, eh = f["g0"][s]["eval_loss"], h["g0"][s]["eval_loss"]
    dt, de = (lh - lf) / lf, (eh - ef) / ef
    worst_train, worst_eval = max(worst_train, abs(dt)), max(worst_eval, abs(de))
    print(f"| {s} | {lf:.4f} | {lh:.4f} | {100 * dt:+.2f}% | {ef:.4f} | {eh:.4f} | "
          f"{100 * de:+.2f}% |")
last_f, last_h = f["g0"][steps[-1]], h["g0"][steps[-1]]
agree = all(h["g0"][s]["global_hash"] == h["g1"][s]["global_hash"] and
            h["g0"][s]["model_hash"] == h["g1"][s]["model_hash"] for s in steps)
print()
print(f"- largest |difference|: train loss {100 * worst_train:.2f}%, eval loss "
      f"{100 * worst_eval:.2f}% (bar: 1% at every step)")
print(f"- {dtype} run: both groups' float32 global weights and {dtype} model weights bitwise "
      f"equal at every step: {agree}")
print(f"- params {last_f['params']}: model_bytes float32 {last_f['model_bytes']}, {dtype} "
      f"{last_h['model_bytes']}; outer_state_bytes float32 {last_f['outer_state_bytes']}, "
      f"{dtype} {last_h['outer_state_bytes']} (the float32 staging buffer)")
mean = lambda rs, k: sum(r[k] for r in rs.values()) / len(rs)
print(f"- inner_ms per outer step (mean, g0): float32 {mean(f['g0'], 'inner_ms'):.0f}, {dtype} "
      f"{mean(h['g0'], 'inner_ms'):.0f}; outer_ms: float32 {mean(f['g0'], 'outer_ms'):.1f}, "
      f"{dtype} {mean(h['g0'], 'outer_ms'):.1f}")
PY
