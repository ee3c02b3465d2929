#!/usr/bin/env bash
# DiLoCo figures of issue 6 from one run of tests/e2e/chaos_test (four groups of two
# diloco_trainer processes, the tiny model of the test, 36 outer steps of H=8 inner steps): the
# chaos run (kill -9 of trainers and agents, a lighthouse restart, a leave and a join) and its
# failure-free reference (same seeds and the same membership changes at the same steps: a killed
# group's return is a clean leave and return there, no kills, no lighthouse restart) run one
# after the other
# on this machine, and every figure is read from their trainers' --log lines:
#
#  - goodput: the inner-step time of committed outer steps, summed over all trainers, against
#    the run's wall time times the 8 trainer slots; also the committed trainer-steps times the
#    run's own median step time against the same, which divides out the machine's load (both
#    runs share 2 cores with whatever else runs); chaos against failure-free;
#  - coordination per outer step: time in Poll + Commit (+ joining a new quorum) against the
#    outer step's own wall time (commit to commit), steady steps of the failure-free run;
#  - bytes per outer step and trainer, counted from the kernel's TCP counters around each
#    collective (examples/diloco/net_bytes.h): the cross-group allreduce against what plain data
#    parallelism over the same 8 trainers would send for the same H inner steps (a ring
#    allreduce of the whole gradient every inner step; its size per byte of payload is taken
#    from the measured intra-group gradient allreduce, a ring of the same code).
#
#   bench/diloco_bench.sh [BUILD_DIR] [SEED]     (defaults: build-diloco, a random seed)
#
# Build first: ninja -C BUILD_DIR -j1 chaos_test diloco_trainer replica_agent lighthouse
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
build=$(cd "${1:-$root/build-diloco}" && pwd)
out=$(mktemp /tmp/lk-diloco-bench-XXXXXX.log)
# The chaos test removes its logs when it passes unless told to keep them; they are the data.
export LK_BIN_DIR=$build/bin LK_SOURCE_DIR=$root LK_KEEP_TEST_DIRS=1
if [ -n "${2:-}" ]; then export LK_CHAOS_SEED=$2; fi
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# The plain failure-free run: the four groups of the test, the same trainer flags and seed, no
# membership change at all.
plain_dir=$(mktemp -d /tmp/lk-diloco-bench-plain-XXXXXX)
lk_bench_lighthouse "$build" "$plain_dir" 2 2000
lh_addr=$LK_BENCH_LH_ADDR
agent_pids=() trainer_pids=()
for g in g0 g1 g2 g3; do
  "$build/bin/replica_agent" --lighthouse "http://$lh_addr" --job chaos --group-id $g \
    --socket "$plain_dir/$g.sock" --heartbeat-interval-ms 100 > "$plain_dir/agent-$g.log" 2>&1 &
  agent_pids+=($!)
done
for g in g0 g1 g2 g3; do
  for _ in $(seq 1 100); do [ -S "$plain_dir/$g.sock" ] && break; sleep 0.1; done
  for r in 0 1; do
    LK_AGENT_SOCKET="$plain_dir/$g.sock" LK_GROUP_ID=$g "$build/bin/diloco_trainer" \
      --group-rank $r --group-size 2 --inner-steps 8 --outer-steps 36 --seed 11 \
      --ckpt-dir "$plain_dir/ckpt-$g" --log "$plain_dir/trainer-$g-$r.0.jsonl" --model-width 32 \
      --layers 1 --heads 2 --seq-len 32 --batch 8 --corpus-bytes 16384 --op-timeout-ms 20000 \
      --eval-batches 8 2> "$plain_dir/trainer-$g-$r.stderr" &
    trainer_pids+=($!)
  done
done
lk_bench_wait_trainers "diloco_bench (the plain run)" "$plain_dir" "${trainer_pids[@]}"
lk_bench_stop "$LK_BENCH_LH_PID" "${agent_pids[@]}"
plain_eval=$(grep -h '"step":36,' "$plain_dir"/trainer-g0-0.0.jsonl | sed 's/.*"eval_loss":\([0-9.]*\).*/\1/')

# Only the float32 chaos test case (the binary also holds the int8 one).
if ! "$build/bin/chaos_test" --test-case='chaos four groups*' > "$out" 2>&1; then
  echo "diloco_bench: the chaos test failed, see $out" >&2
  exit 1
fi
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
chaos_dir=$(sed -n 's/^chaos logs in //p' "$out")
ref_dir=$(sed -n 's/^reference logs in //p' "$out")
echo "# $(grep -m1 '^chaos seed' "$out"), $(nproc) CPUs, load average before $load_before," \
  "after $load_after; test output in $out"
echo "# failure-free (no membership change): 36 steps, final eval loss $plain_eval; logs in $plain_dir"
grep -E '^(reference:|chaos:)' "$out" | sed 's/^/# /'
python3 - "$chaos_dir" "$ref_dir" "$plain_dir" <<'PY'
import glob, json, statistics, sys

SLOTS = 8  # four groups of two trainers throughout (a leave is followed by a join)


def lives(d):
    out = []
    for p in sorted(glob.glob(d + "/trainer-*.jsonl")):
        rows = []
        for line in open(p):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a killed trainer's torn last line
        if rows:
            out.append(rows)
    return out


def figures(d):
    ls = lives(d)
    start = min(r[0]["t_ms"] - r[0]["step_ms"] for r in ls)
    end = max(r[-1]["t_ms"] for r in ls)
    useful = sum(x["inner_ms"] for r in ls for x in r)
    # Steady steps: not a life's first (process start, first quorum) nor a healed one.
    steady = [x for r in ls for x in r[1:] if not x["healed"]]
    f = {
        "wall_s": (end - start) / 1000,
        "goodput": useful / (SLOTS * (end - start)),
        "step_ms": statistics.median(x["step_ms"] for x in steady),
        "poll_ms": statistics.median(x["poll_ms"] for x in steady),
        "commit_ms": statistics.median(x["commit_ms"] for x in steady),
        # The committed trainer-steps at the run's own steady pace, over the slots' wall time:
        # the share of the run that went into steps that counted, with the machine's load (the
        # same in both terms) divided out.
        "paced_goodput": sum(len(r) for r in ls)
        * statistics.median(x["step_ms"] for x in steady) / (SLOTS * (end - start)),
        "steady_goodput": sum(x["inner_ms"] for x in steady) / sum(x["step_ms"] for x in steady),
        "coord_ms": statistics.median(x["poll_ms"] + x["commit_ms"] + x["join_ms"] for x in steady),
        "coord_share": sum(x["poll_ms"] + x["commit_ms"] + x["join_ms"] for x in steady)
        / sum(x["step_ms"] for x in steady),
        "allreduce_ms": statistics.median(x["allreduce_ms"] for x in steady),
        "inner_ms": statistics.median(x["inner_ms"] for x in steady),
        "cross_bytes": statistics.median(x["cross_bytes"] for x in steady),
        "group_bytes": statistics.median(x["group_bytes"] for x in steady),
        "world": statistics.median(x["replica_world_size"] for x in steady),
        "P": steady[0]["params"],
        "shard": steady[0]["shard"],
        "H": steady[0]["inner_steps"],
        "N": steady[0]["group_size"],
        "lines": sum(len(r) for r in ls),
    }
    return f


ch, ff, pl = figures(sys.argv[1]), figures(sys.argv[2]), figures(sys.argv[3])
print()
print("failure-free: no membership change; reference: the chaos run's changes without failures;")
print("ratios are chaos / failure-free and reference / failure-free.")
print()
print("| figure | failure-free | reference | chaos | reference / ff | chaos / ff |")
print("|---|---|---|---|---|---|")
for k, name, fmt in [("wall_s", "wall time of the run (s)", ".1f"),
                     ("goodput", f"goodput: inner-step time of committed steps / ({SLOTS} slots x wall)", ".3f"),
                     ("paced_goodput", f"goodput at the run's own pace: committed trainer-steps x median step time / ({SLOTS} slots x wall)", ".3f"),
                     ("steady_goodput", "steady steps only: inner-step time / step time", ".3f")]:
    print(f"| {name} | {pl[k]:{fmt}} | {ff[k]:{fmt}} | {ch[k]:{fmt}} | {ff[k]/pl[k]:.2f} | {ch[k]/pl[k]:.2f} |")
print()
print("Per outer step, one trainer, median over steady steps (not a life's first, not healed):")
print()
print("| figure | failure-free | reference | chaos |")
print("|---|---|---|---|")
for k, name in [("step_ms", "outer step, commit to commit (ms)"), ("inner_ms", "H inner steps (ms)"),
                ("allreduce_ms", "cross-group allreduce (ms)"), ("poll_ms", "Poll (ms)"),
                ("commit_ms", "Commit (ms)"), ("coord_ms", "Poll + Commit + join (ms)")]:
    f = ".1f" if k in ("step_ms", "inner_ms", "allreduce_ms") else ".3f"  # poll/commit: microseconds
    print(f"| {name} | {pl[k]:{f}} | {ff[k]:{f}} | {ch[k]:{f}} |")
print(f"| coordination / outer step (medians) | {pl['coord_ms']/pl['step_ms']:.6f} | {ff['coord_ms']/ff['step_ms']:.6f} | {ch['coord_ms']/ch['step_ms']:.6f} |")
print(f"| coordination / outer step (sums over steady steps) | {pl['coord_share']:.4f} | {ff['coord_share']:.4f} | {ch['coord_share']:.4f} |")
print()
# Bytes, plain failure-free run (world 4 groups, N trainers each).
f = pl
W, N, H, P = f["world"], f["N"], f["H"], f["P"]
M = W * N
per_inner_group = f["group_bytes"] / (H + 1)  # H gradient allreduces + 1 all-gather, same size
ring_payload_group = 2 * (N - 1) / N * 4 * (P + 2)
overhead = per_inner_group / ring_payload_group
dp = H * 2 * (M - 1) / M * 4 * (P + 2) * overhead
dp_cross = H * f["cross_bytes"]
print(f"Bytes per outer step and trainer (plain failure-free run, {int(W)} groups of {N}, {P} parameters, shard {f['shard']}, H={H}):")
print()
print("| figure | bytes | yardstick | ratio |")
print("|---|---|---|---|")
print(f"| DiLoCo cross-group allreduce (measured) | {f['cross_bytes']:.0f} | plain DP over the same {int(M)} trainers, H ring allreduces of the gradient: {dp:.0f} | {f['cross_bytes']/dp:.4f} |")
print(f"| DiLoCo cross-group allreduce (measured) | {f['cross_bytes']:.0f} | DP with the same group/slot layout (HSDP): H x the same allreduce: {dp_cross:.0f} | {f['cross_bytes']/dp_cross:.4f} |")
print(f"| DiLoCo all bytes: cross-group + intra-group (measured) | {f['cross_bytes'] + f['group_bytes']:.0f} | plain DP: {dp:.0f} | {(f['cross_bytes'] + f['group_bytes'])/dp:.3f} |")
print(f"| intra-group allreduce, bytes per byte of ring payload (measured framing) | {per_inner_group:.0f} | {ring_payload_group:.0f} | {overhead:.3f} |")
PY
