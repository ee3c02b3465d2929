#!/usr/bin/env bash
# A sharded group against a replicated group of the same size and model, measured in this one
# run: the same job three times on a model of about 100M parameters (width 1024, 8 layers, 8
# heads; seq 16, batch 1, one inner step per outer step, STEPS outer steps), the same seed and
# data: one group of N examples/python/diloco_trainer.py trainers each holding the whole model;
# the same group with --shard-model (each trainer its rows of every parameter and of AdamW's
# state, ZeRO-3 by hand; DiLoCo over the rows); and a group of one trainer (the whole outer
# state in one process: the yardstick of the outer state's 1/N). Reports per trainer the
# library's outer state (outer_state_bytes, its own accounting), the parameters it holds
# (model_bytes) and the process's peak RSS, and per run the outer step's time (outer_ms, the
# library's: the exchange, the update and, replicated, the in-group all-gather; gather_ms that
# all-gather with the commit hash's in-group sum), as ratios. Timing is reported, never
# asserted. With CHUNK=1 a fourth run shards by torch.chunk's rule (--shard-rule chunk: the
# library moves the rows where it differs from the even split inside the group at each outer
# step), set beside the even-split sharded run; take an N that does not divide the rows (3).
#
#   bench/sharded_bench.sh [BUILD_DIR] [STEPS] [N] [WIDTH] [LAYERS] [CHUNK]
#                                                         (build, 3, 2, 1024, 8, 0)
#
# Build first: ninja -C BUILD_DIR replica_agent lighthouse lightkeeper_python.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
build=$(cd "${1:-$root/build}" && pwd)
steps=${2:-3}
n=${3:-2}
width=${4:-1024}
layers=${5:-8}
chunk=${6:-0}
export PYTHONPATH="$build/python"
dir=$(mktemp -d "${TMPDIR:-/tmp}/lk-sharded-bench-XXXXXX")
load0=$(cut -d' ' -f1-3 /proc/loadavg)

# The trainer under a parent that reports its peak RSS (the largest resident set it reached)
# on its last stderr line.
peak_rss() {
  /usr/bin/python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:])
sys.stderr.write("peak_rss_kb=%d\n" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(rc)' "$@"
}

run_job() {  # $1 name, $2 trainers in the group, then more trainer flags
  local name=$1 size=$2 d="$dir/$1"
  shift 2
  mkdir -p "$d"
  lk_bench_lighthouse "$build" "$d" 1 1000
  "$build/bin/replica_agent" --lighthouse "http://$LK_BENCH_LH_ADDR" --job "$name" \
    --group-id g0 --socket "$d/g0.sock" --heartbeat-interval-ms 100 > "$d/agent.log" 2>&1 &
  local agent=$! pids=()
  for _ in $(seq 1 100); do [ -S "$d/g0.sock" ] && break; sleep 0.1; done
  for r in $(seq 0 $((size - 1))); do
    LK_AGENT_SOCKET="$d/g0.sock" LK_GROUP_ID=g0 peak_rss /usr/bin/python3 \
      "$root/examples/python/diloco_trainer.py" --group-rank "$r" --group-size "$size" \
      --outer-steps "$steps" --inner-steps 1 --seed 7 --model-width "$width" \
      --layers "$layers" --heads 8 --seq-len 16 --batch 1 --corpus-bytes 65536 \
      --op-timeout-ms 600000 --log "$d/rank-$r.jsonl" "$@" 2> "$d/rank-$r.stderr" &
    pids+=($!)
  done
  lk_bench_wait_trainers "sharded_bench: $name" "$d" "${pids[@]}"
  lk_bench_stop "$LK_BENCH_LH_PID" "$agent"
}

run_job one 1
run_job replicated "$n"
run_job sharded "$n" --shard-model
[ "$chunk" = 1 ] && run_job sharded-chunk "$n" --shard-model --shard-rule chunk

/usr/bin/python3 - "$dir" "$n" "$load0" "$(cut -d' ' -f1-3 /proc/loadavg)" "$chunk" <<'PY'
import json, os, re, sys
d, n, load0, load1 = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = ("one", "replicated", "sharded") + (("sharded-chunk",) if sys.argv[5] == "1" else ())
def run(name):
    out = []
    for r in range(1 if name == "one" else n):
        rows = [json.loads(x) for x in open(os.path.join(d, name, f"rank-{r}.jsonl"))]
        err = open(os.path.join(d, name, f"rank-{r}.stderr")).read()
        rss = int(re.findall(r"peak_rss_kb=(\d+)", err)[-1]) * 1024
        out.append((rows, rss))
    return out
R = {k: run(k) for k in runs}
params = R["replicated"][0][0][-1]["params"]
steps = len(R["replicated"][0][0])
print(f"# one group of {n} diloco_trainer.py, {params / 1e6:.1f}M parameters (float32), "
      f"{steps} outer steps of one inner step; load average {load0} before, {load1} after; "
      f"logs in {d}\n")
print("| run | rank | model_bytes | outer_state_bytes | peak RSS | outer_ms (last step) | gather_ms |")
print("|---|---|---|---|---|---|---|")
M = 1 << 20
for k in runs:
    for r, (rows, rss) in enumerate(R[k]):
        last = rows[-1]
        print(f"| {k} | {r} | {last['model_bytes'] / M:.0f} MiB | "
              f"{last['outer_state_bytes'] / M:.0f} MiB | {rss / M:.0f} MiB | "
              f"{last['outer_ms']} | {last['gather_ms']:.1f} |")
def mean(k, f):
    return sum(f(rows, rss) for rows, rss in R[k]) / len(R[k])
outer = lambda k: mean(k, lambda rows, rss: rows[-1]["outer_state_bytes"])
rss = lambda k: mean(k, lambda rows, rss: rss)
ms = lambda k: mean(k, lambda rows, rss: sum(x["outer_ms"] for x in rows[1:]) / max(1, len(rows) - 1))
print()
print(f"- outer state per trainer, sharded / one trainer holding all of it (a group of one): "
      f"{outer('sharded') / outer('one'):.3f} (1/n = {1 / n:.3f}); sharded / replicated group "
      f"of {n}: {outer('sharded') / outer('replicated'):.3f} (the library shards the outer state "
      f"over the group's trainers either way)")
print(f"- parameters held per trainer, sharded / replicated: "
      f"{mean('sharded', lambda rows, rss: rows[-1]['model_bytes']) / mean('replicated', lambda rows, rss: rows[-1]['model_bytes']):.3f}")
print(f"- peak RSS per trainer, sharded / replicated: {rss('sharded') / rss('replicated'):.3f}; "
      f"sharded / one: {rss('sharded') / rss('one'):.3f}")
print(f"- outer step time (mean over steps 2..{steps}), sharded / replicated: "
      f"{ms('sharded') / ms('replicated'):.3f} ({ms('sharded'):.0f} ms / {ms('replicated'):.0f} ms)")
same = all(R["sharded"][r][0][-1]["global_hash"] == R["replicated"][0][0][-1]["global_hash"]
           for r in range(n))
print(f"- the same global weights at the last step in both runs (global_hash): {same}")
if "sharded-chunk" in R:
    moved = [re.findall(r"elements_moved_per_step=(\d+)", open(os.path.join(d, "sharded-chunk",
             f"rank-{r}.stderr")).read()) for r in range(n)]
    print(f"- torch.chunk's rows, outer step time / the even split's: "
          f"{ms('sharded-chunk') / ms('sharded'):.3f} ({ms('sharded-chunk'):.0f} ms / "
          f"{ms('sharded'):.0f} ms); elements moved inside the group per move: "
          f"{moved[0][-1] if moved[0] else 'none logged'}")
    same = all(R["sharded-chunk"][r][0][-1]["global_hash"] ==
               R["sharded"][0][0][-1]["global_hash"] for r in range(n))
    print(f"- torch.chunk's run ends with the even split's global weights: {same}")
PY
