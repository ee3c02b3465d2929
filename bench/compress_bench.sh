#!/usr/bin/env bash
# Compressed outer steps (--outer-compress, issue 15): bytes per outer step on the cross-group
# links and the loss at equal steps, per setting, all measured in this one run on this machine:
#
#  - four DiLoCo jobs, one per setting (none = float32, bf16, int8, int4), each of W groups of
#    one diloco_trainer with the same seeds, model, data and membership (the lighthouse waits for
#    all W groups: --min-replicas W), run one after the other;
#  - the plain data-parallel yardstick: one group of W trainers of the same model, whose
#    in-group traffic is a ring allreduce of the whole gradient every inner step, i.e. what W
#    sites would send with plain data parallelism (its group_bytes hold H such allreduces and the
#    library's one all-gather of the weights per outer step, the same size: H / (H + 1) of it is
#    the yardstick).
# Bytes are each trainer's cross_bytes (the kernel's TCP counters around the cross-group
# exchange, framing included; examples/diloco/net_bytes.h), median over the steady steps (step 2
# on). The loss is eval_loss: the global weights on fixed evaluation batches, the same in every
# member, at each step.
#
#   bench/compress_bench.sh [BUILD_DIR] [STEPS] [INNER_STEPS] [GROUPS] [SEED] [MODEL]
#                                         (build, 30, 16, 3, 5, default)
#
# MODEL: small (the chaos test's character model with a second block, 28,381 parameters) or
# default (diloco_trainer's default shape, 107,933 parameters). The fixed framing of a step
# (about 1.3 kB) weighs less against the larger model's payload.
#
# Build first: ninja -C BUILD_DIR diloco_trainer replica_agent lighthouse
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-30}
inner=${3:-16}
groups=${4:-3}
seed=${5:-5}
model_name=${6:-default}
dir=$(mktemp -d "${TMPDIR:-/tmp}/lk-compress-bench-XXXXXX")
case "$model_name" in
  # Small enough that five jobs run in a few minutes on 2 shared cores.
  small) model=(--model-width 32 --layers 2 --heads 2 --seq-len 32 --batch 8 --corpus-bytes 32768) ;;
  default) model=(--model-width 64 --layers 2 --heads 4 --seq-len 64 --batch 8 --corpus-bytes 65536) ;;
  *) echo "compress_bench: MODEL is small or default, not $model_name" >&2; exit 2 ;;
esac
model+=(--eval-batches 16 --op-timeout-ms 60000)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT

# $1: name, $2: min replicas; sets lh_addr.
start_lighthouse() {
  mkdir -p "$dir/$1"
  lk_bench_lighthouse "$build" "$dir/$1" "$2" 60000
  pids+=("$LK_BENCH_LH_PID")
  lh_addr=$LK_BENCH_LH_ADDR
}

# One job: $1 name, $2 groups, $3 trainers per group, then extra trainer flags.
run_job() {
  local job=$1 ngroups=$2 size=$3
  shift 3
  local agents=() trainers=()
  for g in $(seq 0 $((ngroups - 1))); do
    "$build/bin/replica_agent" --lighthouse "http://$lh_addr" --job "$job" --group-id "g$g" \
      --socket "$dir/$job-g$g.sock" --heartbeat-interval-ms 100 > "$dir/agent-$job-g$g.log" 2>&1 &
    agents+=($!)
    pids+=($!)
  done
  for g in $(seq 0 $((ngroups - 1))); do
    for _ in $(seq 1 100); do [ -S "$dir/$job-g$g.sock" ] && break; sleep 0.1; done
    for r in $(seq 0 $((size - 1))); do
      LK_AGENT_SOCKET="$dir/$job-g$g.sock" LK_GROUP_ID="g$g" "$build/bin/diloco_trainer" \
        --group-rank "$r" --group-size "$size" --inner-steps "$inner" --outer-steps "$steps" \
        --seed "$seed" --log "$dir/$job-g$g-$r.jsonl" "${model[@]}" "$@" 2> "$dir/$job-g$g-$r.stderr" &
      trainers+=($!)
    done
  done
  lk_bench_wait_trainers "compress_bench: $job" "$dir" "${trainers[@]}"
  lk_bench_agents_leave "${agents[@]}"
}

started=$(date +%s)
start_lighthouse diloco "$groups"
for codec in none bf16 int8 int4; do
  run_job "$codec" "$groups" 1 --outer-compress "$codec"
done
start_lighthouse dp 1
run_job dp 1 "$groups"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "# $(nproc) CPUs, load average before $load_before, after $load_after;" \
  "$(( $(date +%s) - started )) s; logs in $dir"
echo "# $groups groups of 1 trainer, T=$steps outer steps of H=$inner inner steps, seed $seed; model ${model[*]}"
/usr/bin/python3 - "$dir" "$groups" "$inner" <<'PY'
import glob, json, statistics, sys

d, W, H = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


def rows(job):
    out = []
    for p in sorted(glob.glob(f"{d}/{job}-g*-*.jsonl")):
        out.append([json.loads(line) for line in open(p)])
    return out


def steady(job, key):
    return statistics.median(x[key] for r in rows(job) for x in r if x["step"] >= 2)


def evals(job):
    # eval_loss is the same in every member (the same weights on the same batches).
    return {x["step"]: x["eval_loss"] for x in rows(job)[0]}


none_bytes = steady("none", "cross_bytes")
dp_bytes = steady("dp", "group_bytes") * H / (H + 1)
P = rows("none")[0][0]["params"]
ring = 2 * (W - 1) / W * 4 * P
ev = {c: evals(c) for c in ("none", "bf16", "int8", "int4")}
T = max(ev["none"])
print()
print(f"Bytes per outer step and trainer on the cross-group links ({P} parameters, W={W}; "
      f"float32 ring payload 2(W-1)/W x 4 x P = {ring:.0f}):")
print()
print("| setting | bytes / outer step | / float32 DiLoCo | / plain DP (H allreduces of the gradient) |")
print("|---|---|---|---|")
print(f"| plain data parallelism (measured, group of {W}) | {dp_bytes:.0f} | {dp_bytes / none_bytes:.2f} | 1 |")
for c in ("none", "bf16", "int8", "int4"):
    b = steady(c, "cross_bytes")
    print(f"| DiLoCo {c} | {b:.0f} | {b / none_bytes:.4f} | {b / dp_bytes:.5f} |")
print()
print(f"eval_loss (fixed batches) at equal steps against float32 DiLoCo:")
print()
# The goal is how much worse a setting trains: its largest excess over float32's loss. The
# largest difference also counts the steps where it is lower. Beside them, how much float32's
# loss wanders by itself: its largest rise from one step to the next.
n = ev["none"]
wander = max(max(0.0, (n[s] - n[s - 1]) / n[s - 1]) for s in range(5, T + 1))
print("| setting | step 10 | step 20 | final (step %d) | final vs none | largest excess over none, "
      "steps 5..%d | largest difference vs none |" % (T, T))
print("|---|---|---|---|---|---|---|")
for c in ("none", "bf16", "int8", "int4"):
    e = ev[c]
    rel = [(e[s] - n[s]) / n[s] for s in range(5, T + 1)]
    print(f"| {c} | {e.get(10, float('nan')):.4f} | {e.get(20, float('nan')):.4f} | {e[T]:.4f} | "
          f"{100 * (e[T] - n[T]) / n[T]:+.2f}% | {100 * max(0.0, max(rel)):.2f}% | "
          f"{100 * max(abs(r) for r in rel):.2f}% |")
print()
print(f"float32's own largest rise from one step to the next, steps 5..{T}: {100 * wander:.2f}%")
PY
