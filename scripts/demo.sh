#!/usr/bin/env bash
# The README's first command: installs what is needed, builds, and runs a small DiLoCo training
# run under Lightkeeper on this machine: a lighthouse and three replica groups (one agent and two
# diloco_trainer processes each, a tiny GPT-style character model on LibTorch, CPU). One trainer
# is killed with -9 mid-run, its group comes back as a new incarnation and heals from its peers,
# and a fourth group joins halfway. A failure-free reference run with the same seeds runs first.
# Ends with a summary and a PNG plot of loss against outer step with the membership changes
# marked. Everything listens on 127.0.0.1 and is stopped at the end. The dashboard is live
# meanwhile. About a minute on 2 cores once built.
#
#   scripts/demo.sh [--trainer cpp|python]
#
# --trainer python runs the same demo with the PyTorch trainer (examples/python/diloco_trainer.py
# on Debian's /usr/bin/python3 with the lightkeeper package from build/python): the same model,
# flags and --log lines, so everything below reads the same.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TRAINER=cpp
while [ $# -gt 0 ]; do
  case "$1" in
    --trainer) TRAINER=${2:-}; shift 2 || { echo "demo.sh: --trainer needs cpp or python" >&2; exit 2; } ;;
    --trainer=*) TRAINER=${1#--trainer=}; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (usage: demo.sh [--trainer cpp|python])" >&2; exit 2 ;;
  esac
done
case "$TRAINER" in
  cpp) TARGETS="lighthouse lkctl replica_agent diloco_trainer" ;;
  python) TARGETS="lighthouse lkctl replica_agent lightkeeper_python" ;;
  *) echo "demo.sh: --trainer must be cpp or python, not '$TRAINER'" >&2; exit 2 ;;
esac
if [ "${LK_DEMO_SKIP_BUILD:-0}" != 1 ]; then
  bash scripts/install-deps.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  # shellcheck disable=SC2086
  cmake --build build -j"$(nproc)" --target $TARGETS
fi
BIN=${LK_DEMO_BIN:-$ROOT/build/bin}
if [ "$TRAINER" = python ]; then
  TRAINER_CMD=(/usr/bin/python3 "$ROOT/examples/python/diloco_trainer.py")
  export PYTHONPATH="${LK_DEMO_PYTHONPATH:-$BIN/../python}${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONDONTWRITEBYTECODE=1
else
  TRAINER_CMD=("$BIN/diloco_trainer")
fi
RUN=$(mktemp -d /tmp/lightkeeper-demo.XXXXXX)
STEPS=${LK_DEMO_STEPS:-40}       # outer steps (T)
KILL_AT=$((STEPS / 4))           # kill a trainer once the job committed this step
JOIN_AT=$((STEPS / 2))           # a fourth group joins here
LH_AT=$((STEPS * 3 / 4))         # the lighthouse is killed with -9 and restarted here
SEED=7
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
wait_log() {  # wait_log FILE TEXT [COUNT]: wait until TEXT appears COUNT times in FILE
  for _ in $(seq 1 300); do
    [ "$(grep -c -- "$2" "$1" 2>/dev/null || true)" -ge "${3:-1}" ] && return 0; sleep 0.1
  done
  echo "timed out waiting for '$2' in $1" >&2; return 1
}
lines() { cat "$@" 2>/dev/null | wc -l; }  # committed outer steps logged in these files
last_step() {  # the highest step any of these logs committed (0 if none)
  local s; s=$({ cat "$@" 2>/dev/null || true; } | grep -o '"step":[0-9]*' | cut -d: -f2 | sort -n | tail -1)
  echo "${s:-0}"
}
wait_until() {  # wait_until SECONDS COMMAND...: poll every 0.1 s
  local end=$(( $(date +%s) + $1 )); shift
  until "$@"; do
    [ "$(date +%s)" -lt "$end" ] || { echo "timed out waiting for: $*" >&2; return 1; }
    sleep 0.1
  done
}
step_reached() { [ "$(last_step "${@:2}")" -ge "$1" ]; }

start_lighthouse() {  # start_lighthouse DATA_DIR LOG [BIND]: a restart passes the old address
  local before
  before=$(grep -c "listening address=" "$2" 2>/dev/null || true)
  "$BIN/lighthouse" --bind "${3:-127.0.0.1:0}" --data-dir "$1" --min-replicas 2 \
    --heartbeat-timeout-ms 2000 --join-timeout-ms 2000 >>"$2" 2>&1 &
  LH_PID=$!; PIDS+=("$LH_PID")
  wait_log "$2" "listening address=" $((before + 1))
  ADDR=$(grep -o 'listening address=[^ ]*' "$2" | tail -1 | cut -d= -f2)
}
quorum_id() { curl -s "http://$ADDR/status" | python3 -c \
  'import json,sys; j=json.load(sys.stdin)["jobs"]; print(j[0]["quorum_id"] if j else 0)' 2>/dev/null || echo "?"; }
start_group() {  # start_group DIR NAME TAG: an agent and two trainers; logs DIR/trainer-NAME-R.TAG.jsonl
  local dir=$1 g=$2 tag=$3 sock="$1/$2.$3.sock"
  "$BIN/replica_agent" --lighthouse "http://$ADDR" --job demo --group-id "$g" --socket "$sock" \
    --serve 127.0.0.1:0 --serve-dir "$dir/live-$g" --heartbeat-interval-ms 100 \
    >>"$dir/agent-$g.$tag.log" 2>&1 &
  PIDS+=("$!"); eval "AGENT_$g=$!"
  wait_log "$dir/agent-$g.$tag.log" agent_listening
  for r in 0 1; do
    LK_AGENT_SOCKET=$sock LK_GROUP_ID=$g "${TRAINER_CMD[@]}" --group-rank $r --group-size 2 \
      --inner-steps 8 --outer-steps "$STEPS" --seed $SEED --ckpt-dir "$dir/ckpt-$g" \
      --live-dir "$dir/live-$g" --log "$dir/trainer-$g-$r.$tag.jsonl" \
      --model-width 32 --layers 1 --heads 2 --seq-len 32 --batch 8 --corpus-bytes 16384 \
      --op-timeout-ms 20000 >>"$dir/trainer-$g-$r.$tag.err" 2>&1 &
    PIDS+=("$!"); eval "TRAINER_${g}_$r=$!"
  done
}
wait_rc() {  # wait_rc PID: sets RC to its exit code (in this shell: it must be our child)
  RC=0; { wait "$1"; } 2>/dev/null || RC=$?
}
wait_groups() {  # wait_groups G...: waits for each group's trainers and agent, prints exit codes
  local g codes
  for g in "$@"; do
    codes=""
    for r in 0 1; do wait_rc "$(eval echo \$TRAINER_${g}_$r)"; codes+=" $RC"; done
    wait_rc "$(eval echo \$AGENT_$g)"
    echo "  $g: trainers exited${codes}, agent $RC"
  done
}
status() { "$BIN/lkctl" --lighthouse "http://$ADDR" status || true; }

T0=$(now)
say "trainer: $TRAINER (${TRAINER_CMD[*]})"
say "reference: three groups, no failures, same seeds ($STEPS outer steps)"
mkdir -p "$RUN/ref"
start_lighthouse "$RUN/ref/lighthouse-data" "$RUN/ref/lighthouse.log"
for g in g0 g1 g2; do start_group "$RUN/ref" $g 1; done
wait_until 150 step_reached "$STEPS" "$RUN"/ref/trainer-g0-0.1.jsonl
wait_groups g0 g1 g2
kill "$LH_PID" 2>/dev/null || true; wait "$LH_PID" 2>/dev/null || true
REF_S=$(since "$T0")
echo "  reference took $REF_S s"

say "the run: a lighthouse and three replica groups (one agent + two trainers each)"
start_lighthouse "$RUN/lighthouse-data" "$RUN/lighthouse.log"
echo "dashboard: http://$ADDR/   (state and logs in $RUN)"
EVENTS=$RUN/events.txt; : >"$EVENTS"
for g in g0 g1 g2; do start_group "$RUN" $g 1; done
wait_until 120 step_reached "$KILL_AT" "$RUN"/trainer-g0-0.1.jsonl
status

say "kill -9 of trainer g1/1 at step $(last_step "$RUN"/trainer-g0-0.1.jsonl): its agent ends the group"
KILL_STEP=$(last_step "$RUN"/trainer-g0-0.1.jsonl)
echo "$KILL_STEP kill g1" >>"$EVENTS"
survivor_lines=$(lines "$RUN"/trainer-g0-0.1.jsonl)
KILL_T=$(now)
kill -9 "$TRAINER_g1_1"; wait_rc "$TRAINER_g1_1"
wait_rc "$AGENT_g1"; echo "  g1's agent exited with $RC (3: a trainer of the group died)"
wait_rc "$TRAINER_g1_0"; echo "  ... and stopped g1's other trainer (exit $RC)"
wait_until 60 bash -c "[ \$(wc -l <'$RUN/trainer-g0-0.1.jsonl') -gt $survivor_lines ]"
RESUME_S=$(since "$KILL_T")
echo "  g0 and g2 go on without g1: next step committed $RESUME_S s after the kill"
status

say "g1 comes back (a new incarnation: fresh agent and trainers) and heals from its peers"
start_group "$RUN" g1 2
wait_until 90 bash -c "[ -s '$RUN/trainer-g1-0.2.jsonl' ]"
HEAL_S=$(since "$KILL_T")
BACK_STEP=$(last_step "$RUN"/trainer-g1-0.2.jsonl)
echo "$BACK_STEP g1 back" >>"$EVENTS"
echo "  g1 committed step $BACK_STEP again $HEAL_S s after the kill:" \
  "$(head -1 "$RUN/trainer-g1-0.2.jsonl")"
status

wait_until 120 step_reached "$JOIN_AT" "$RUN"/trainer-g0-0.1.jsonl
say "a fourth group g3 joins at step $(last_step "$RUN"/trainer-g0-0.1.jsonl) and heals from the others"
JOIN_T=$(now)
start_group "$RUN" g3 1
wait_until 90 bash -c "[ -s '$RUN/trainer-g3-0.1.jsonl' ]"
JOIN_S=$(since "$JOIN_T")
JOIN_STEP=$(last_step "$RUN"/trainer-g3-0.1.jsonl)
echo "$JOIN_STEP g3 joins" >>"$EVENTS"
echo "  g3 committed its first step ($JOIN_STEP) $JOIN_S s after it started"
status

wait_until 120 step_reached "$LH_AT" "$RUN"/trainer-g0-0.1.jsonl
LH_STEP=$(last_step "$RUN"/trainer-g0-0.1.jsonl)
QID_BEFORE=$(quorum_id)
say "the lighthouse is killed with -9 at step $LH_STEP (quorum_id $QID_BEFORE) and restarted on $ADDR"
kill -9 "$LH_PID"; wait "$LH_PID" 2>/dev/null || true
echo "$LH_STEP lighthouse restart" >>"$EVENTS"
sleep 1
start_lighthouse "$RUN/lighthouse-data" "$RUN/lighthouse.log" "$ADDR"
sleep 2
echo "  after the restart: quorum_id $(quorum_id) (ids never go back), the job went on:"
status

say "every group trains to step $STEPS"
wait_groups g0 g1 g2 g3
curl -s "http://$ADDR/status" >"$RUN/status.json" || true
python3 scripts/plot_run.py "$RUN/loss.png" "$EVENTS" "$RUN"/trainer-*.jsonl \
  --reference "$RUN"/ref/trainer-*.jsonl

say "summary"
python3 - "$RUN" "$STEPS" "$RESUME_S" "$HEAL_S" "$JOIN_S" <<'EOF'
import glob, json, sys
run, steps, resume_s, heal_s, join_s = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:])
def load(pattern):
    out = {}
    for p in glob.glob(pattern):
        out[p] = [json.loads(l) for l in open(p) if l.strip()]
    return out
logs, ref = load(run + "/trainer-*.jsonl"), load(run + "/ref/trainer-*.jsonl")
hashes, qids = {}, {}
for lines in logs.values():
    for d in lines:
        hashes.setdefault((d["step"], d["group_rank"]), set()).add(d["param_hash"])
        qids.setdefault(d["quorum_id"], set()).add(d["replica_world_size"])
def final_loss(lg):
    v = [d["loss"] for lines in lg.values() for d in lines if d["step"] == steps]
    return sum(v) / len(v) if v else float("nan")
st = json.load(open(run + "/status.json"))["jobs"][0]
loss, ref_loss = final_loss(logs), final_loss(ref)
bad = sum(1 for h in hashes.values() if len(h) > 1)
print(f"  outer steps committed      {st['committed_step']} of {steps}")
print(f"  quorum changes             {st['quorum_changes']} (quorum ids {min(qids)}..{max(qids)}, "
      f"world sizes {sorted(set().union(*qids.values()))})")
print(f"  kill -9 of a trainer       others resumed in {resume_s:.1f} s, "
      f"its group back and healed in {heal_s:.1f} s")
print(f"  group joining halfway      first commit {join_s:.1f} s after it started")
print(f"  replicas identical         {len(hashes) - bad} of {len(hashes)} (step, shard) pairs agree "
      f"across groups" + ("" if bad == 0 else f"  ** {bad} DIFFER **"))
print(f"  final loss                 {loss:.4f}  (failure-free reference {ref_loss:.4f}, "
      f"{100 * (loss - ref_loss) / ref_loss:+.1f}%)")
print(f"  plot                       {run}/loss.png")
EOF
echo "  logs                       $RUN   (whole demo $(since "$T0") s)"
