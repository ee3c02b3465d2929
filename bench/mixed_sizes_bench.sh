#!/usr/bin/env bash
# Groups of different sizes (issue 15): the outer step of a quorum whose groups have 1, 2 and 3
# trainers (the fragment-wise exchange on one communicator over all six trainers, AllReduceRuns)
# against a quorum of three groups of 2 (the equal-layout exchange, one ring per shard slot),
# with the same six diloco_trainer processes' worth of work, the same model and the same steps,
# one run after the other here. Per trainer and outer step, from the --log lines (the first two
# steps left out): allreduce_ms (the cross-group exchange, waiting on the slowest member
# included), sync_ms (the whole outer step after the inner steps: step_ms - inner_ms) and
# cross_bytes (what it sent to other groups). Both runs also check that every trainer logged the
# same global_hash at every step.
#
#   bench/mixed_sizes_bench.sh [BUILD_DIR] [OUTER_STEPS] [MODEL_WIDTH]   (defaults: build, 8, 128)
#
# Build first: ninja -C BUILD_DIR -j2 diloco_trainer replica_agent lighthouse
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-8}
width=${3:-128}
work=$(mktemp -d "${TMPDIR:-/tmp}/lk-mixed-bench-XXXXXX")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# One run: a lighthouse and groups g0 g1 g2 with the trainer counts in $2 ("2 2 2").
run() {
  local name=$1 sizes=($2) dir=$work/$1
  mkdir -p "$dir"
  lk_bench_lighthouse "$build" "$dir" 3 5000
  local agents=() trainers=()
  for i in 0 1 2; do
    "$build/bin/replica_agent" --lighthouse "http://$LK_BENCH_LH_ADDR" --job mixed --group-id g$i \
      --socket "$dir/g$i.sock" --heartbeat-interval-ms 100 > "$dir/agent-g$i.log" 2>&1 &
    agents+=($!)
  done
  for i in 0 1 2; do
    for _ in $(seq 1 100); do [ -S "$dir/g$i.sock" ] && break; sleep 0.1; done
    for r in $(seq 0 $((sizes[i] - 1))); do
      LK_AGENT_SOCKET="$dir/g$i.sock" LK_GROUP_ID=g$i "$build/bin/diloco_trainer" \
        --group-id g$i --group-rank "$r" --group-size "${sizes[i]}" --outer-steps "$steps" \
        --inner-steps 4 --seed 11 --log "$dir/trainer-g$i-$r.jsonl" --model-width "$width" \
        --layers 2 --heads 4 --seq-len 32 --batch 4 --corpus-bytes 65536 \
        --op-timeout-ms 120000 2> "$dir/trainer-g$i-$r.stderr" &
      trainers+=($!)
    done
  done
  lk_bench_wait_trainers "mixed_sizes_bench ($name)" "$dir" "${trainers[@]}"
  lk_bench_stop "$LK_BENCH_LH_PID" "${agents[@]}"
}

run uniform "2 2 2"
run mixed "1 2 3"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

/usr/bin/python3 - "$work" "$steps" "$load_before" "$load_after" <<'EOF'
import glob, json, statistics, sys
work, steps, load_before, load_after = sys.argv[1:]
steps = int(steps)

def run_lines(run):
    out = {}
    for path in sorted(glob.glob(f"{work}/{run}/trainer-*.jsonl")):
        with open(path) as f:
            out[path] = [json.loads(l) for l in f if l.strip()]
    return out

rows = {}
for run in ("uniform", "mixed"):
    logs = run_lines(run)
    assert len(logs) == 6, f"{run}: {len(logs)} trainer logs"
    by_step = {}
    for path, ls in logs.items():
        assert [l["step"] for l in ls] == list(range(1, steps + 1)), f"{path}: steps"
        for l in ls:
            by_step.setdefault(l["step"], set()).add(l["global_hash"])
    assert all(len(h) == 1 for h in by_step.values()), f"{run}: global hashes differ"
    body = [l for ls in logs.values() for l in ls[2:]]
    med = lambda k: statistics.median(l[k] for l in body)
    sync = statistics.median(l["step_ms"] - l["inner_ms"] for l in body)
    bytes_step = sum(l["cross_bytes"] for l in body) / (steps - 2)
    rows[run] = (med("allreduce_ms"), sync, med("inner_ms"), bytes_step, body[0]["params"])

print(f"# mixed_sizes_bench: groups 2,2,2 against 1,2,3, {steps} outer steps of H=4, "
      f"{rows['uniform'][4]} parameters, load average before {load_before}, after {load_after}")
print("| run | allreduce_ms (median) | sync_ms (median) | inner_ms (median) | "
      "cross-group bytes per outer step, all trainers |")
print("|---|---|---|---|---|")
for run, (ar, sync, inner, b, _) in rows.items():
    print(f"| {run} | {ar:.1f} | {sync:.1f} | {inner:.1f} | {b:.0f} |")
u, m = rows["uniform"], rows["mixed"]
print(f"\nmixed / uniform: allreduce {m[0] / u[0]:.2f}x, sync {m[1] / u[1]:.2f}x, "
      f"cross-group bytes {m[3] / u[3]:.2f}x")
EOF
echo "logs in $work"
