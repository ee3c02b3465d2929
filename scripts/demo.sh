#!/usr/bin/env bash
# The README's first command: installs what is needed, builds, and runs a small Lightkeeper run
# on this machine: a lighthouse, three replica groups (one agent and two trainers each), a group
# that leaves, a lighthouse that is killed with -9 and restarted, and a group that joins.
# Everything listens on 127.0.0.1 and is stopped at the end. The dashboard is live meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ "${LK_DEMO_SKIP_BUILD:-0}" != 1 ]; then
  bash scripts/install-deps.sh
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build -j"$(nproc)" --target lighthouse lkctl replica_agent test_trainer
fi
BIN=$ROOT/build/bin
RUN=$(mktemp -d /tmp/lightkeeper-demo.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
wait_log() {  # wait_log FILE TEXT [COUNT]: wait until TEXT appears COUNT times in FILE
  for _ in $(seq 1 300); do
    [ "$(grep -c -- "$2" "$1" 2>/dev/null || true)" -ge "${3:-1}" ] && return 0; sleep 0.1
  done
  echo "timed out waiting for '$2' in $1" >&2; return 1
}
start_lighthouse() {
  "$BIN/lighthouse" --bind "${1:-127.0.0.1:0}" --data-dir "$RUN/lighthouse-data" \
    --heartbeat-timeout-ms 2000 --join-timeout-ms 500 >>"$RUN/lighthouse.log" 2>&1 &
  LH_PID=$!; PIDS+=("$LH_PID")
  wait_log "$RUN/lighthouse.log" "listening address=" "$2"
  ADDR=$(grep -o 'listening address=[^ ]*' "$RUN/lighthouse.log" | tail -1 | cut -d= -f2)
}
start_group() {  # start_group NAME
  local g=$1 sock="$RUN/$1.sock"
  "$BIN/replica_agent" --lighthouse "http://$ADDR" --job demo --group-id "$g" --socket "$sock" \
    --serve 127.0.0.1:0 --heartbeat-interval-ms 200 >>"$RUN/agent-$g.log" 2>&1 &
  PIDS+=("$!"); eval "AGENT_$g=$!"
  wait_log "$RUN/agent-$g.log" agent_listening
  for r in 0 1; do
    LK_AGENT_SOCKET=$sock "$BIN/test_trainer" --group-rank $r --group-size 2 --steps 100000 \
      --step-sleep-ms 200 --log "$RUN/trainer-$g-$r.jsonl" >>"$RUN/trainer-$g-$r.err" 2>&1 &
    PIDS+=("$!")
  done
}
status() { "$BIN/lkctl" --lighthouse "http://$ADDR" status; }

say "starting a lighthouse"
start_lighthouse 127.0.0.1:0 1
echo "dashboard: http://$ADDR/   (state in $RUN)"
say "three replica groups join (one agent + two trainers each)"
for g in g0 g1 g2; do start_group $g; done
sleep 3; status
say "g2 is cancelled (SIGTERM to its agent): it leaves at once, the quorum shrinks"
kill -TERM "$AGENT_g2"; sleep 1.5; status
say "the lighthouse is killed with -9 and restarted on the same address: nothing is lost"
kill -9 "$LH_PID"; sleep 1
start_lighthouse "$ADDR" 2
sleep 2; status
say "a new group g3 joins the running job and is told to heal"
start_group g3
sleep 3; status
grep -h '"event":"heal"' "$RUN"/trainer-g3-*.jsonl | head -2 || true
say "done: every trainer's allreduce results were checked"
bad=$(grep -h '"correct":false' "$RUN"/trainer-*.jsonl | grep -vc '"ok":false' || true)
echo "outer steps committed: $(grep -h '"event":"allreduce"' "$RUN"/trainer-*.jsonl | grep -c '"ok":true')," \
  "wrong allreduce results: $bad; logs in $RUN"
