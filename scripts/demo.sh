#!/usr/bin/env bash
# The README's first command: installs what is needed, builds, and runs a small DiLoCo training
# run under Lightkeeper on this machine: a lighthouse and three replica groups (one agent and two
# trainer processes each, a tiny GPT-style character model, CPU). Three stages, each while the
# others train: a trainer is killed with -9 and its group comes back as a new incarnation and
# heals from its peers; a fourth group joins and trains in a quorum of four; the lighthouse is
# killed with -9 and restarted, and issues quorums again. Then a reference run without failures
# repeats the run's membership changes at the same committed steps. Ends with a summary checked
# against the logs (each stage: what happened, at which committed step; the demo exits 1 when a
# stage did not happen mid-run) and a PNG plot. Everything listens on 127.0.0.1 and is stopped
# at the end. The dashboard is live meanwhile. A few minutes on 2 cores once built.
#
#   scripts/demo.sh [--trainer cpp|python]
#
# --trainer python runs the same demo with the PyTorch trainer (examples/python/diloco_trainer.py
# on Debian's /usr/bin/python3 with the lightkeeper package from build/python): the same model,
# flags and --log lines, so everything below reads the same.
# Environment: LK_DEMO_STEPS (outer steps, default 40), LK_DEMO_INNER_STEP_MIN_MS (each inner
# step lasts at least this long: the pace; default 100 for cpp, 200 for python),
# LK_DEMO_STAGE_TIMEOUT_S (how long a stage may take, default 180), LK_DEMO_SKIP_BUILD=1,
# LK_DEMO_BIN (the binaries, default build/bin), LK_DEMO_PYTHONPATH, LK_DEMO_DIR (an empty
# directory for the run's state and logs; default a new $TMPDIR/lightkeeper-demo.XXXXXX).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TRAINER=cpp
while [ $# -gt 0 ]; do
  case "$1" in
    --trainer) TRAINER=${2:-}; shift 2 || { echo "demo.sh: --trainer needs cpp or python" >&2; exit 2; } ;;
    --trainer=*) TRAINER=${1#--trainer=}; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (usage: demo.sh [--trainer cpp|python])" >&2; exit 2 ;;
  esac
done
case "$TRAINER" in
  cpp) TARGETS="lighthouse lkctl replica_agent diloco_trainer"; PACE_DEFAULT=100 ;;
  python) TARGETS="lighthouse lkctl replica_agent lightkeeper_python"; PACE_DEFAULT=200 ;;
  *) echo "demo.sh: --trainer must be cpp or python, not '$TRAINER'" >&2; exit 2 ;;
esac
STEPS=${LK_DEMO_STEPS:-40}              # outer steps (T)
PACE_MS=${LK_DEMO_INNER_STEP_MIN_MS:-$PACE_DEFAULT}
STAGE_S=${LK_DEMO_STAGE_TIMEOUT_S:-180}
INNER=8                                 # inner steps per outer step (H)
for v in STEPS PACE_MS STAGE_S; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "demo.sh: $v must be a whole number, not '${!v}'" >&2; exit 2; }
done
[ "$STEPS" -ge 12 ] || { echo "demo.sh: LK_DEMO_STEPS must be at least 12 (three stages)" >&2; exit 2; }
if [ "${LK_DEMO_SKIP_BUILD:-0}" != 1 ]; then
  bash scripts/install-deps.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  # shellcheck disable=SC2086
  cmake --build build -j"$(nproc)" --target $TARGETS
fi
BIN=${LK_DEMO_BIN:-$ROOT/build/bin}
PY=/usr/bin/python3   # Debian's: python3-torch and python3-matplotlib are installed for it
if [ "$TRAINER" = python ]; then
  TRAINER_CMD=("$PY" "$ROOT/examples/python/diloco_trainer.py")
  export PYTHONPATH="${LK_DEMO_PYTHONPATH:-$BIN/../python}${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONDONTWRITEBYTECODE=1
else
  TRAINER_CMD=("$BIN/diloco_trainer")
fi
RUN=${LK_DEMO_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/lightkeeper-demo.XXXXXX")}
mkdir -p "$RUN"
[ -z "$(ls -A "$RUN")" ] || { echo "demo.sh: LK_DEMO_DIR $RUN is not empty" >&2; exit 2; }
# Where each stage is meant to start; a stage starts later when the one before it took longer,
# because each waits for the effect of the one before.
KILL_AT=$((STEPS / 4))
JOIN_AT=$((STEPS / 2))
LH_AT=$((STEPS * 3 / 4))
SEED=7
PIDS=()
STARTED=()  # the groups started in the current run (or reference), for reap
cleanup() { local p; for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
trap 'exit 130' INT   # so that an interrupted demo stops what it started (the EXIT trap)
trap 'exit 143' TERM

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
now_ms() { date +%s%3N; }
since() { awk -v a="$1" -v b="$(now_ms)" 'BEGIN { printf "%.1f", (b - a) / 1000 }'; }
# Every wait below polls a condition until a deadline; none orders events by sleeping.
wait_until() {  # wait_until SECONDS COMMAND...: 0 once COMMAND succeeds, 1 at the deadline
  local end=$(( $(date +%s) + $1 )); shift
  until "$@"; do
    [ "$(date +%s)" -lt "$end" ] || return 1
    sleep 0.1
  done
}
log_has() { [ "$(grep -c -- "$2" "$1" 2>/dev/null || true)" -ge "${3:-1}" ]; }  # FILE TEXT [COUNT]
wait_log() {  # wait_log FILE TEXT [COUNT]: a process's start; fatal if it never comes
  wait_until 60 log_has "$@" && return 0
  echo "demo.sh: timed out waiting for '$2' in $1" >&2; exit 1
}
committed() {  # committed DIR: the highest outer step any trainer in DIR logged (0 if none)
  local s
  s=$({ tail -qn1 "$1"/trainer-*.jsonl 2>/dev/null || true; } | grep -o '"step":[0-9]*' |
      cut -d: -f2 | sort -n | tail -1)
  echo "${s:-0}"
}
reached() { [ "$(committed "$2")" -ge "$1" ]; }                   # reached STEP DIR
ended() { reached "$STEPS" "$1"; }                                # ended DIR: the run is over
reached_or_ended() { reached "$1" "$2" || ended "$2"; }
wait_step() {  # wait_step DIR STEP: until the job committed STEP (or ended), at most a stage
  wait_until "$STAGE_S" reached_or_ended "$2" "$1" || echo "  ** step $2 not reached within ${STAGE_S} s **"
}
gone() {  # gone PID: exited (a zombie counts: it waits for us to reap it)
  local s; s=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || true
  [ -z "$s" ] || [ "$s" = Z ]
}
# wait_effect DIR WHAT COMMAND...: waits for a stage's effect; 0 once it shows, 1 when the run
# ended first or the stage outlasted LK_DEMO_STAGE_TIMEOUT_S (both said; the summary reports
# the stage as not done mid-run).
wait_effect() {
  local dir=$1 what=$2 end=$(( $(date +%s) + STAGE_S )); shift 2
  until "$@"; do
    if ended "$dir"; then "$@" && return 0; echo "  ** the run ended before $what **"; return 1; fi
    [ "$(date +%s)" -lt "$end" ] || { echo "  ** no $what within ${STAGE_S} s **"; return 1; }
    sleep 0.2
  done
}
act() {  # act DIR WHAT...: records an action with the time and the committed step
  local dir=$1; shift
  echo "$(now_ms) $(committed "$dir") $*" >>"$dir/actions.txt"
}

start_lighthouse() {  # start_lighthouse DIR [BIND]: a restart passes the old address
  local log=$1/lighthouse.log before
  before=$(grep -c "listening address=" "$log" 2>/dev/null || true)
  # At debug level the lighthouse logs every quorum it issues and every commit it records
  # (not only changes): the summary reads them to say when the job went on after a restart.
  # Failures reach the lighthouse at once (an agent leaves when a trainer dies), so the
  # heartbeat timeout only has to outlast a stall of a busy machine; a group that lapses is
  # not lost (it rejoins), but it would change the membership the stages below narrate.
  "$BIN/lighthouse" --bind "${2:-127.0.0.1:0}" --data-dir "$1/lighthouse-data" --min-replicas 2 \
    --heartbeat-timeout-ms 5000 --join-timeout-ms 2000 --log-level debug >>"$log" 2>&1 &
  LH_PID=$!; PIDS+=("$LH_PID")
  wait_log "$log" "listening address=" $((before + 1))
  ADDR=$(grep -o 'listening address=[^ ]*' "$log" | tail -1 | cut -d= -f2)
}
start_group() {  # start_group DIR NAME LIFE: an agent and two trainers; logs DIR/trainer-NAME-R.LIFE.jsonl
  local dir=$1 g=$2 life=$3 sock="$1/$2.$3.sock"
  "$BIN/replica_agent" --lighthouse "http://$ADDR" --job demo --group-id "$g" --socket "$sock" \
    --serve 127.0.0.1:0 --serve-dir "$dir/live-$g" --heartbeat-interval-ms 100 \
    >>"$dir/agent-$g.$life.log" 2>&1 &
  PIDS+=("$!"); eval "AGENT_$g=$!"
  wait_log "$dir/agent-$g.$life.log" agent_listening
  for r in 0 1; do
    LK_AGENT_SOCKET=$sock LK_GROUP_ID=$g "${TRAINER_CMD[@]}" --group-rank $r --group-size 2 \
      --inner-steps $INNER --inner-step-min-ms "$PACE_MS" --outer-steps "$STEPS" --seed $SEED \
      --ckpt-dir "$dir/ckpt-$g" --live-dir "$dir/live-$g" --log "$dir/trainer-$g-$r.$life.jsonl" \
      --model-width 32 --layers 1 --heads 2 --seq-len 32 --batch 8 --corpus-bytes 16384 \
      --eval-batches 8 --op-timeout-ms 20000 >>"$dir/trainer-$g-$r.$life.err" 2>&1 &
    PIDS+=("$!"); eval "TRAINER_${g}_$r=$!"
  done
  [[ " ${STARTED[*]} " == *" $g "* ]] || STARTED+=("$g")
}
group_pids() { eval echo "\$TRAINER_${1}_0 \$TRAINER_${1}_1 \$AGENT_$1"; }
all_gone() { local p; for p in "$@"; do gone "$p" || return 1; done; }
forget() {  # forget PID: reaped, so never signalled again (its number may be reused)
  local i; for i in "${!PIDS[@]}"; do [ "${PIDS[$i]}" != "$1" ] || unset 'PIDS[i]'; done
}
reap() {  # reap SECONDS G...: waits for the groups' processes; kills what outlives SECONDS
  local g p pids=() codes rc
  for g in "${@:2}"; do for p in $(group_pids "$g"); do pids+=("$p"); done; done
  wait_until "$1" all_gone "${pids[@]}" || echo "  ** still running after $1 s: killed **"
  for g in "${@:2}"; do
    codes=""
    for p in $(group_pids "$g"); do
      gone "$p" || kill -9 "$p" 2>/dev/null || true
      rc=0; { wait "$p"; } 2>/dev/null || rc=$?
      codes+=" $rc"; forget "$p"
    done
    [ -z "$codes" ] || echo "  $g: trainers and agent exited with$codes"
    eval "TRAINER_${g}_0= TRAINER_${g}_1= AGENT_$g="
  done
}
stop_lighthouse() {  # stop_lighthouse [SIGNAL]
  kill "-${1:-TERM}" "$LH_PID" 2>/dev/null || true; wait "$LH_PID" 2>/dev/null || true; forget "$LH_PID"
}
status() { "$BIN/lkctl" --lighthouse "http://$ADDR" status || true; }
has_line() { grep -q -- "$2" "$1" 2>/dev/null; }
world_of() { grep -q -- "\"replica_world_size\":$2," "$1" 2>/dev/null; }  # FILE N

T0=$(now_ms)
say "trainer: $TRAINER (${TRAINER_CMD[*]}), $STEPS outer steps of $INNER inner steps (each at least $PACE_MS ms)"
echo "state and logs in $RUN"

say "the run: a lighthouse and three replica groups (one agent + two trainers each)"
start_lighthouse "$RUN"
echo "dashboard: http://$ADDR/"
: >"$RUN/actions.txt"
for g in g0 g1 g2; do start_group "$RUN" $g 1; done
if ! wait_until "$STAGE_S" reached "$KILL_AT" "$RUN" || ended "$RUN"; then
  echo "demo.sh: no commit of step $KILL_AT within ${STAGE_S} s; logs in $RUN" >&2; exit 1
fi
status

say "kill -9 of trainer g1/1 at committed step $(committed "$RUN"): its agent ends the group, the others go on"
in_two() { grep -c '"replica_world_size":2,' "$RUN/trainer-g0-0.1.jsonl" || true; }
IN_TWO=$(in_two)  # the first quorum may have had two groups: one started late
act "$RUN" kill g1/1
kill -9 "$TRAINER_g1_1"; { wait "$TRAINER_g1_1"; } 2>/dev/null || true  # at once: no "Killed" notice
forget "$TRAINER_g1_1"; TRAINER_g1_1=
wait_effect "$RUN" "exit of g1's agent" all_gone $(group_pids g1) || true
reap 10 g1
echo "  (the agent's 3: a trainer of its group died; it stopped the other trainer)"
went_on() { [ "$(in_two)" -gt "$IN_TWO" ]; }
wait_effect "$RUN" "commit without g1" went_on || true
echo "  g0 and g2 committed step $(committed "$RUN") without g1"
status

if ended "$RUN"; then
  echo "  ** the run ended before g1 could come back **"
else
  say "g1 comes back at step $(committed "$RUN") (a new incarnation: fresh agent and trainers) and heals from its peers"
  act "$RUN" relaunch g1
  start_group "$RUN" g1 2
  wait_effect "$RUN" "commit of g1's new incarnation" has_line "$RUN/trainer-g1-0.2.jsonl" '"step"' &&
    echo "  g1 is back: $(head -c 120 "$RUN/trainer-g1-0.2.jsonl")..."
  status
fi

wait_step "$RUN" "$JOIN_AT"
if ended "$RUN"; then
  echo "  ** the run ended before g3 could join **"
else
  say "a fourth group g3 joins at step $(committed "$RUN") and heals from the others"
  act "$RUN" launch g3
  start_group "$RUN" g3 1
  wait_effect "$RUN" "quorum of four" world_of "$RUN/trainer-g3-0.1.jsonl" 4 &&
    echo "  g3 trains in a quorum of four from step $(committed "$RUN")"
  status
fi

# The agents notice the outage (a failed heartbeat) before it ends, so that it is one.
outages() { cat "$RUN"/agent-*.log | grep -c 'heartbeat_failed\|lighthouse_unreachable' || true; }
outage_seen() { [ "$(outages)" -gt "$OUTAGES" ]; }
# The restarted lighthouse is back in the job once it issued a quorum (the groups asked it
# again) and recorded a commit in it.
since_start() {  # the lines of the lighthouse's last life
  awk '/ lighthouse_start /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$RUN/lighthouse.log"
}
lh_back() { local l; l=$(since_start); grep -q ' quorum_issued ' <<<"$l" && grep -q ' commit .* ok=true' <<<"$l"; }
wait_step "$RUN" "$LH_AT"
if ended "$RUN"; then
  echo "  ** the run ended before the lighthouse's restart **"
else
  say "the lighthouse is killed with -9 at step $(committed "$RUN") and restarted on $ADDR"
  OUTAGES=$(outages)
  LH_STEP=$(committed "$RUN")
  act "$RUN" kill lighthouse
  stop_lighthouse KILL
  # It stays down until the agents noticed and the groups committed a step without it (two
  # past the step of the kill: the one after it may have reached the lighthouse before it died).
  wait_effect "$RUN" "agent noticing the outage" outage_seen || true
  wait_effect "$RUN" "step without the lighthouse" reached $((LH_STEP + 2)) "$RUN" &&
    echo "  the groups committed step $(committed "$RUN") without it"
  start_lighthouse "$RUN" "$ADDR"
  act "$RUN" restart lighthouse
  wait_effect "$RUN" "quorum from the restarted lighthouse" lh_back &&
    echo "  the restarted lighthouse issued a quorum and recorded a commit at step $(committed "$RUN")"
  status
fi

say "every group trains to step $STEPS"
reap "$STAGE_S" "${STARTED[@]}"
curl -s "http://$ADDR/status" >"$RUN/status.json" || true
stop_lighthouse

# The reference: the same job and seeds without failures, repeating the run's membership
# changes at the committed steps where the run made them (g1's return as a drain at the kill's
# step and a relaunch at the relaunch's; g3's start). A group that comes back is a new process
# whose inner optimizer starts afresh, which changes the loss (examples/diloco/README.md), so a
# reference without them would not be the same run. The lighthouse restart changes no member.
step_of() { awk -v w="$1" '($3 " " $4) == w { print $2; exit }' "$RUN/actions.txt"; }
say "reference: the same job without failures, with the run's membership changes at the same steps"
REF=$RUN/ref; mkdir -p "$REF"; : >"$REF/actions.txt"
STARTED=()
start_lighthouse "$REF"
for g in g0 g1 g2; do start_group "$REF" $g 1; done
wait_step "$REF" "$(step_of "kill g1/1")"
echo "  g1 drains and leaves at step $(committed "$REF")"
act "$REF" drain g1
kill -TERM "$AGENT_g1" || true
reap "$STAGE_S" g1
if [ -n "$(step_of "relaunch g1")" ]; then
  wait_step "$REF" "$(step_of "relaunch g1")"
  echo "  g1 comes back at step $(committed "$REF")"
  act "$REF" relaunch g1
  start_group "$REF" g1 2
  wait_effect "$REF" "commit of g1's new incarnation" has_line "$REF/trainer-g1-0.2.jsonl" '"step"' || true
fi
if [ -n "$(step_of "launch g3")" ]; then
  wait_step "$REF" "$(step_of "launch g3")"
  echo "  g3 joins at step $(committed "$REF")"
  act "$REF" launch g3
  start_group "$REF" g3 1
fi
reap "$STAGE_S" "${STARTED[@]}"
curl -s "http://$ADDR/status" >"$REF/status.json" || true
stop_lighthouse

say "summary (from the logs in $RUN)"
RC=0
"$PY" scripts/demo_summary.py "$RUN" "$STEPS" --trainer "$TRAINER" --events "$RUN/events.txt" || RC=$?
"$PY" scripts/plot_run.py "$RUN/loss.png" "$RUN/events.txt" "$RUN"/trainer-*.jsonl \
  --reference "$REF"/trainer-*.jsonl --reference-label "reference (no failures, same changes)" &&
  echo "  plot: $RUN/loss.png" || { echo "  ** no plot **"; RC=1; }
echo "  logs: $RUN   (whole demo $(since "$T0") s)"
exit "$RC"
