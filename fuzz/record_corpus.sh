#!/usr/bin/env bash
# fuzz/record_corpus.sh BIN_DIR: records real traffic into the route fuzzers' seed corpora.
# Runs a lighthouse with token files, two replica groups (an agent and a test_trainer each, 8
# outer steps), lkctl's and curl's calls, with fuzz/record_relay.py between the agents and the
# lighthouse (-> fuzz/corpus/lighthouse_routes/), between group a's trainer and its agent's
# Unix socket (-> agent_socket_routes/), and in front of group a's --serve, which serves a live
# directory with a real checkpoint (-> agent_serve_routes/). Each request becomes one corpus
# file; gateway_routes/ is then derived from lighthouse_routes/ (fuzz/gateway_seeds.py).
# Loopback only; everything it starts is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build/bin}
RUN=$(mktemp -d "${TMPDIR:-/tmp}/lk-record-XXXXXX")
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; [ -n "${LK_RECORD_KEEP:-}" ] || rm -rf "$RUN"; }
trap cleanup EXIT
wait_log() { for _ in $(seq 1 300); do grep -q -- "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }

echo "j secret-j" >"$RUN/tokens"
echo "secret-j" >"$RUN/job-token"
echo "root-token" >"$RUN/admin"
"$BIN/lighthouse" --bind 127.0.0.1:0 --data-dir "$RUN/lh" --token-file "$RUN/tokens" \
  --admin-token-file "$RUN/admin" --min-replicas 1 >"$RUN/lh.log" 2>&1 &
PIDS+=("$!")
wait_log "$RUN/lh.log" "listening address="
LH=$(grep -o 'listening address=[^ ]*' "$RUN/lh.log" | cut -d= -f2)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 fuzz/record_relay.py "127.0.0.1:$PORT" "$LH" fuzz/corpus/lighthouse_routes lighthouse \
  >"$RUN/relay.log" 2>&1 &
PIDS+=("$!")
wait_log "$RUN/relay.log" relay_listening
# Group a serves an empty live directory: the reads below are recorded as a peer sends them;
# the target's served directory holds the checkpoint they name (fuzz/agent_fixture.h).
mkdir -p "$RUN/live"
TR=()
for g in a b; do
  serve=()
  [ "$g" = a ] && serve=(--serve 127.0.0.1:0 --serve-dir "$RUN/live")
  "$BIN/replica_agent" --lighthouse "http://127.0.0.1:$PORT" --job j --group-id "$g" \
    --token-file "$RUN/job-token" --socket "$RUN/$g.sock" --heartbeat-interval-ms 100 \
    "${serve[@]}" >"$RUN/agent-$g.log" 2>&1 &
  PIDS+=("$!")
  wait_log "$RUN/agent-$g.log" agent_listening
  sock="$RUN/$g.sock"
  if [ "$g" = a ]; then
    python3 fuzz/record_relay.py "unix:$RUN/a-relay.sock" "unix:$RUN/a.sock" \
      fuzz/corpus/agent_socket_routes agent_socket >"$RUN/relay-a.log" 2>&1 &
    PIDS+=("$!")
    wait_log "$RUN/relay-a.log" relay_listening
    sock="$RUN/a-relay.sock"
  fi
  LK_AGENT_SOCKET="$sock" LK_GROUP_ID=$g "$BIN/test_trainer" --group-rank 0 \
    --group-size 1 --steps 8 --log "$RUN/trainer-$g.jsonl" >"$RUN/trainer-$g.err" 2>&1 &
  TR+=("$!")
  PIDS+=("$!")
done
# A peer's reads on group a's --serve while the group trains: health, status, the checkpoint
# list, a file in ranges.
SERVE=$(grep agent_listening "$RUN/agent-a.log" | grep -o ' serve=[^ ]*' | cut -d= -f2)
SPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 fuzz/record_relay.py "127.0.0.1:$SPORT" "$SERVE" fuzz/corpus/agent_serve_routes \
  agent_serve >"$RUN/relay-serve.log" 2>&1 &
PIDS+=("$!")
wait_log "$RUN/relay-serve.log" relay_listening
for auth in "Bearer secret-j" "Bearer wrong" ""; do
  for t in /healthz /v1/agent/status /v1/shards/checkpoints \
           /v1/shards/files/rank-00000/step-000000000003/shard-00000-of-00001.safetensors \
           /v1/shards/files/rank-00000/step-000000000003/MANIFEST \
           /v1/trainer/hello; do
    for range in "" "bytes=0-99" "bytes=-16" "bytes=8-"; do
      curl -s ${auth:+-H "Authorization: $auth"} ${range:+-H "Range: $range"} \
        "http://127.0.0.1:$SPORT$t" >/dev/null || true
    done
  done
done
for p in "${TR[@]}"; do wait "$p"; done
# The operator's side: status, metrics, checkpoints, a drain and a forget.
echo "root-token" >"$RUN/admin-token"
for cmd in status "drain j a" ; do
  "$BIN/lkctl" --lighthouse "http://127.0.0.1:$PORT" --token-file "$RUN/admin-token" $cmd \
    >/dev/null 2>&1 || true
done
for t in /status /metrics "/v1/checkpoints?job=j" "/v1/watch?job=j&quorum_id=0&timeout_ms=0" /healthz; do
  curl -s -H "Authorization: Bearer root-token" "http://127.0.0.1:$PORT$t" >/dev/null || true
done
curl -s -X PUT -H "Authorization: Bearer secret-j" --data-binary x \
  "http://127.0.0.1:$PORT/v1/kv/j/1/nccl/0" >/dev/null || true
curl -s -H "Authorization: Bearer secret-j" "http://127.0.0.1:$PORT/v1/kv/j/1/nccl/0?timeout_ms=0" \
  >/dev/null || true
# A launcher's reports of a life (the Slurm batch script's crash branch).
for ev in "trainer_crashed rc=1" "requeue_refused scontrol: refused"; do
  "$BIN/lkctl" --lighthouse "http://127.0.0.1:$PORT" --token-file "$RUN/job-token" \
    event j a recorded-life $ev >/dev/null 2>&1 || true
done
curl -s -X POST -H "Authorization: Bearer root-token" -H "Content-Type: application/json" \
  -d '{"job":"j"}' "http://127.0.0.1:$PORT/v1/admin/forget" >/dev/null || true
sleep 0.5
for t in lighthouse_routes agent_socket_routes agent_serve_routes; do
  echo "recorded $(ls fuzz/corpus/$t | wc -l) requests for $t"
done
# The gateway relays the agents' lighthouse calls: its seeds are those calls, re-encoded.
python3 fuzz/gateway_seeds.py
