#!/usr/bin/env bash
# Inner steps with denormals flushed to zero (diloco_trainer's default) against the same trainer
# with IEEE denormals (--keep-denormals), measured in this one run on this machine: one group of
# one diloco_trainer, alone in its job, the shaped-links benchmark's model (3.2 M parameters),
# the same seed and data both ways, ROUNDS rounds alternating which goes first. Reports each
# run's inner_ms per outer step, the median over steps 2..T and the mean of the last three, and
# the last step's eval loss and global_hash (whether flushing changed the trajectory at all).
#
#   bench/denormals_bench.sh [BUILD_DIR] [STEPS] [ROUNDS]     (build, 12, 2)
#
# Build first: ninja -C BUILD_DIR diloco_trainer replica_agent lighthouse
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-12}
rounds=${3:-2}
dir=$(mktemp -d "${TMPDIR:-/tmp}/lk-denormals-bench-XXXXXX")
model=(--model-width 256 --layers 4 --heads 4 --seq-len 16 --batch 2 --inner-steps 8
       --eval-batches 8 --seed 11)
load0=$(cut -d' ' -f1-3 /proc/loadavg)

run_one() {  # $1 name, then extra trainer flags
  local name=$1
  shift
  local d="$dir/$name"
  mkdir -p "$d"
  lk_bench_lighthouse "$build" "$d" 1 500
  "$build/bin/replica_agent" --lighthouse "http://$LK_BENCH_LH_ADDR" --job "$name" \
    --group-id g0 --socket "$d/agent.sock" --heartbeat-interval-ms 100 > "$d/agent.log" 2>&1 &
  local agent=$!
  for _ in $(seq 1 100); do [ -S "$d/agent.sock" ] && break; sleep 0.1; done
  LK_AGENT_SOCKET="$d/agent.sock" LK_GROUP_ID=g0 "$build/bin/diloco_trainer" --group-rank 0 \
    --group-size 1 --outer-steps "$steps" --log "$d/trainer.jsonl" "${model[@]}" "$@" \
    2> "$d/trainer.stderr" &
  local trainer=$!
  lk_bench_wait_trainers "denormals_bench: $name" "$d" "$trainer"
  lk_bench_stop "$LK_BENCH_LH_PID" "$agent"
}

for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order=(flush keep); else order=(keep flush); fi
  for how in "${order[@]}"; do
    if [ "$how" = keep ]; then run_one "keep-$r" --keep-denormals; else run_one "flush-$r"; fi
  done
done

/usr/bin/python3 - "$dir" "$rounds" "$load0" "$(cut -d' ' -f1-3 /proc/loadavg)" <<'PY'
import json, os, statistics, sys
d, rounds, load0, load1 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def rows(name):
    return [json.loads(l) for l in open(os.path.join(d, name, "trainer.jsonl"))]
T = len(rows("flush-1"))
print(f"# one diloco_trainer alone in its job, T={T}, H=8, {rounds} rounds; load average {load0} "
      f"before, {load1} after; logs in {d}\n")
print("| run | inner_ms per outer step, steps 1..T | median, steps 2..T | mean, last 3 steps | "
      "eval_loss at T | global_hash at T |")
print("|---|---|---|---|---|---|")
med = {"flush": [], "keep": []}
late = {"flush": [], "keep": []}
hashes = set()
for r in range(1, rounds + 1):
    for how in ("flush", "keep"):
        rs = rows(f"{how}-{r}")
        inner = [x["inner_ms"] for x in rs]
        m = statistics.median(inner[1:])
        l3 = statistics.mean(inner[-3:])
        med[how].append(m)
        late[how].append(l3)
        print(f"| {how}, round {r} | {' '.join(str(round(v)) for v in inner)} | {m:.0f} | "
              f"{l3:.0f} | {rs[-1].get('eval_loss', float('nan')):.6f} | "
              f"{rs[-1]['global_hash']} |")
        hashes.add(rs[-1]["global_hash"])
print()
print(f"- the last step's global weights are {'bitwise equal' if len(hashes) == 1 else 'different'}"
      f" in all {2 * rounds} runs")
for r in range(rounds):
    print(f"- round {r + 1}: flushed / IEEE denormals, inner_ms: median "
          f"{med['flush'][r] / med['keep'][r]:.3f}x, last 3 steps "
          f"{late['flush'][r] / late['keep'][r]:.3f}x")
PY
