#!/usr/bin/env bash
# bf16 (or fp16) model weights against float32 DiLoCo, measured in this one run: the same job
# three times, two groups of one diloco_trainer each on the example trainer's default model
# (width 64, 2 layers, 4 heads, seq 64, batch 16, H=20), the same seed and data: with
# --param-dtype float32, with --param-dtype DTYPE (AdamW on a float32 master copy, the model
# holding its rounding: mixed precision, the trainer's default) and with --param-dtype DTYPE
# --inner-master=false (AdamW's updates rounded into the 16-bit weights: pure 16-bit training).
# Reports, per outer step, the train loss (mean over both groups of the step's inner steps) and
# the eval loss (the global weights as the model holds them, 8 fixed batches) of each run and
# the relative difference to float32, the largest of them, whether both groups held bitwise the
# same float32 global weights and 16-bit model weights at every commit, and the bytes the
# trainer and the library hold (model_bytes, outer_state_bytes). Timing is reported, never
# asserted.
#
#   bench/bf16_bench.sh [BUILD_DIR] [STEPS] [DTYPE] [TRAINER]     (build, 10, bf16, cpp)
#
# TRAINER python runs examples/python/diloco_trainer.py instead (the model cast to DTYPE and
# trained in it; with the master, MasterAdamW). Build first: ninja -C BUILD_DIR diloco_trainer
# replica_agent lighthouse (and lightkeeper_python for python).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-10}
dtype=${3:-bf16}
trainer=${4:-cpp}
if [ "$trainer" = python ]; then
  program=(/usr/bin/python3 "$root/examples/python/diloco_trainer.py")
  export PYTHONPATH="$build/python"
else
  program=("$build/bin/diloco_trainer")
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/lk-bf16-bench-XXXXXX")
load0=$(cut -d' ' -f1-3 /proc/loadavg)

run_job() {  # $1 name, $2 param dtype, then more trainer flags
  local name=$1 pd=$2 d="$dir/$1"
  shift 2
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
    LK_AGENT_SOCKET="$d/$g.sock" LK_GROUP_ID=$g "${program[@]}" --group-rank 0 \
      --group-size 1 --outer-steps "$steps" --seed 7 --eval-batches 8 --param-dtype "$pd" \
      --log "$d/$g.jsonl" "$@" 2> "$d/$g.stderr" &
    pids+=($!)
  done
  lk_bench_wait_trainers "bf16_bench: $name" "$d" "${pids[@]}"
  lk_bench_stop "$LK_BENCH_LH_PID" "${agents[@]}"
}

run_job float32 float32
run_job "$dtype" "$dtype"
run_job "$dtype-pure" "$dtype" --inner-master=false

/usr/bin/python3 - "$dir" "$dtype" "$load0" "$(cut -d' ' -f1-3 /proc/loadavg)" "$trainer" <<'PY'
import json, os, sys
d, dtype, load0, load1, trainer = sys.argv[1:6]
runs = ["float32", dtype, dtype + "-pure"]
def rows(run, g):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(d, run, g + ".jsonl")))}
R = {run: {g: rows(run, g) for g in ("g0", "g1")} for run in runs}
steps = sorted(R["float32"]["g0"])
train = lambda run, s: (R[run]["g0"][s]["loss"] + R[run]["g1"][s]["loss"]) / 2
evals = lambda run, s: R[run]["g0"][s]["eval_loss"]
names = {"float32": "float32", dtype: f"{dtype}, f32 master", dtype + "-pure": f"{dtype}, pure"}
program = "diloco_trainer.py" if trainer == "python" else "diloco_trainer"
print(f"# two groups of one {program}, default model, H=20, T={len(steps)}; load average "
      f"{load0} before, {load1} after; logs in {d}\n")
head = "| step | " + " | ".join(f"train {names[r]}" for r in runs) + " | " + \
       " | ".join(f"eval {names[r]}" for r in runs) + " |"
print(head)
print("|---" * (1 + 2 * len(runs)) + "|")
worst = {r: [0.0, 0.0] for r in runs[1:]}
for s in steps:
    cells = []
    for kind, f in (("train", train), ("eval", evals)):
        base = f("float32", s)
        for r in runs:
            v = f(r, s)
            if r == "float32":
                cells.append(f"{v:.4f}")
            else:
                rel = (v - base) / base
                worst[r][kind == "eval"] = max(worst[r][kind == "eval"], abs(rel))
                cells.append(f"{v:.4f} ({100 * rel:+.2f}%)")
    print(f"| {s} | " + " | ".join(cells) + " |")
print()
for r in runs[1:]:
    agree = all(R[r]["g0"][s]["global_hash"] == R[r]["g1"][s]["global_hash"] and
                R[r]["g0"][s]["model_hash"] == R[r]["g1"][s]["model_hash"] for s in steps)
    print(f"- {names[r]}: largest |difference| to float32 at a step: train loss "
          f"{100 * worst[r][0]:.2f}%, eval loss {100 * worst[r][1]:.2f}% (bar: 1%); both groups' "
          f"float32 global weights and {dtype} model weights bitwise equal at every step: {agree}")
last = {r: R[r]["g0"][steps[-1]] for r in runs}
print(f"- params {last['float32']['params']}: model_bytes " +
      ", ".join(f"{names[r]} {last[r]['model_bytes']}" for r in runs) +
      "; outer_state_bytes " +
      ", ".join(f"{names[r]} {last[r]['outer_state_bytes']}" for r in runs))
mean = lambda run, k: sum(x[k] for x in R[run]["g0"].values()) / len(steps)
print("- g0's mean per outer step: inner_ms " +
      ", ".join(f"{names[r]} {mean(r, 'inner_ms'):.0f}" for r in runs) + "; outer_ms " +
      ", ".join(f"{names[r]} {mean(r, 'outer_ms'):.1f}" for r in runs))
PY
