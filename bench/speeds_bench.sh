#!/usr/bin/env bash
# Groups of different speeds (issue 15): the goodput of the fast group, with time budgets per
# outer step against the blocking run where it waits for the slow one. Two groups of one
# diloco_trainer each (the tests' tiny model), the slow group's inner steps twice as long as the
# fast group's (--inner-step-min-ms: each step padded to F ms and 2F ms by a sleep, so that the
# ratio holds on a loaded machine), one lighthouse, both runs one after the other here:
#
#  - blocking: both groups run exactly --inner-steps H; the fast group waits for the slow one
#    in every outer allreduce;
#  - budgets: both groups run inner steps for --outer-step-s (H slow steps' worth) and sync
#    then; the fast group runs about twice the inner steps, and the average weighs each group's
#    pseudo-gradient by its tokens.
#
# Goodput = the fast group's tokens (samples x seq_len, from its --log lines) per second of
# wall time between its first and its last commit. Beside it, in the same run, the fast group's
# own inner-step rate (its tokens per second of inner-step time, no waiting, no outer step):
# the most it could reach.
#
#   bench/speeds_bench.sh [BUILD_DIR] [OUTER_STEPS] [FAST_STEP_MS]   (defaults: build, 10, 50)
#
# Build first: ninja -C BUILD_DIR -j2 diloco_trainer replica_agent lighthouse
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-10}
fast_ms=${3:-50}
slow_ms=$((2 * fast_ms))
inner=10
budget_s=$(/usr/bin/python3 -c "print($inner * $slow_ms / 1000)")
work=$(mktemp -d "${TMPDIR:-/tmp}/lk-speeds-bench-XXXXXX")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# One run: a lighthouse, the fast group g0 and the slow group g1; extra trainer flags in $2.
run() {
  local name=$1 flags=$2 dir=$work/$1
  mkdir -p "$dir"
  lk_bench_lighthouse "$build" "$dir" 2 2000
  local agents=() trainers=()
  for g in g0 g1; do
    "$build/bin/replica_agent" --lighthouse "http://$LK_BENCH_LH_ADDR" --job speeds --group-id $g \
      --socket "$dir/$g.sock" --heartbeat-interval-ms 100 > "$dir/agent-$g.log" 2>&1 &
    agents+=($!)
  done
  for g in g0 g1; do
    local ms=$fast_ms
    [ $g = g1 ] && ms=$slow_ms
    for _ in $(seq 1 100); do [ -S "$dir/$g.sock" ] && break; sleep 0.1; done
    # shellcheck disable=SC2086
    LK_AGENT_SOCKET="$dir/$g.sock" LK_GROUP_ID=$g "$build/bin/diloco_trainer" \
      --group-id $g --group-rank 0 --group-size 1 --outer-steps "$steps" --seed 11 \
      --log "$dir/trainer-$g.jsonl" --model-width 32 --layers 1 --heads 2 --seq-len 32 \
      --batch 8 --corpus-bytes 16384 --op-timeout-ms 60000 --inner-step-min-ms $ms \
      $flags 2> "$dir/trainer-$g.stderr" &
    trainers+=($!)
  done
  lk_bench_wait_trainers "speeds_bench ($name)" "$dir" "${trainers[@]}"
  lk_bench_stop "$LK_BENCH_LH_PID" "${agents[@]}"
}

run blocking "--inner-steps $inner"
run budgets "--inner-steps 1000 --outer-step-s $budget_s"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$work" "$steps" "$fast_ms" "$slow_ms" "$budget_s" "$load_before" "$load_after" <<'EOF'
import json, sys
work, steps, fast_ms, slow_ms, budget_s, load_before, load_after = sys.argv[1:]

def lines(run, group):
    with open(f"{work}/{run}/trainer-{group}.jsonl") as f:
        return [json.loads(l) for l in f if l.strip()]

def goodput(run, group):
    ls = lines(run, group)
    assert len(ls) == int(steps), f"{run}/{group}: {len(ls)} commits"
    # From the first commit to the last: steady outer steps, start-up and join left out.
    body = ls[1:]
    wall_s = (ls[-1]["t_ms"] - ls[0]["t_ms"]) / 1000
    tokens = sum(l["tokens"] for l in body)
    inner_s = sum(l["inner_ms"] for l in body) / 1000
    runs = [l["inner_steps_run"] for l in body]
    return tokens / wall_s, tokens / inner_s, sum(runs) / len(runs), wall_s / len(body)

rows = {}
for run in ("blocking", "budgets"):
    for g in ("g0", "g1"):
        rows[run, g] = goodput(run, g)
# The global weights agree across the groups at every step in both runs.
for run in ("blocking", "budgets"):
    a, b = lines(run, "g0"), lines(run, "g1")
    assert [l["global_hash"] for l in a] == [l["global_hash"] for l in b], f"{run}: hashes differ"
    assert all(l["weighted"] for l in a + b), f"{run}: an unweighted step"

print(f"# speeds_bench: {steps} outer steps, fast inner step {fast_ms} ms, slow {slow_ms} ms, "
      f"budget {budget_s} s, load average before {load_before}, after {load_after}")
print("| run | group | inner steps per outer step | outer step s | goodput tokens/s | "
      "its inner-step rate tokens/s |")
print("|---|---|---|---|---|---|")
for (run, g), (gp, rate, per, step_s) in rows.items():
    print(f"| {run} | {g} ({'fast' if g == 'g0' else 'slow'}) | {per:.1f} | {step_s:.3f} | "
          f"{gp:.0f} | {rate:.0f} |")
ratio = rows["budgets", "g0"][0] / rows["blocking", "g0"][0]
print(f"\nfast group goodput, budgets / blocking: {ratio:.2f}x (goal >= 1.8x); with budgets it "
      f"reaches {rows['budgets', 'g0'][0] / rows['budgets', 'g0'][1]:.2f}x of its own inner-step "
      f"rate, blocking {rows['blocking', 'g0'][0] / rows['blocking', 'g0'][1]:.2f}x")
EOF
echo "logs in $work"
