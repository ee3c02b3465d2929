# Shared by the benchmark scripts that run a whole job on loopback (source it): start a
# lighthouse, wait for a job's trainers, let its agents leave. Each script keeps its own
# command lines for agents and trainers, which are what differ between them.

# lk_bench_lighthouse BUILD DIR MIN_REPLICAS JOIN_TIMEOUT_MS: a lighthouse on a free port with
# its state in DIR/lh; sets LK_BENCH_LH_PID and LK_BENCH_LH_ADDR (HOST:PORT).
lk_bench_lighthouse() {
  local build=$1 dir=$2
  "$build/bin/lighthouse" --bind 127.0.0.1:0 --data-dir "$dir/lh" --min-replicas "$3" \
    --join-timeout-ms "$4" > "$dir/lighthouse.log" 2>&1 &
  LK_BENCH_LH_PID=$!
  for _ in $(seq 1 100); do grep -q 'listening address=' "$dir/lighthouse.log" && break; sleep 0.1; done
  LK_BENCH_LH_ADDR=$(sed -n 's/.*listening address=\([0-9.:]*\).*/\1/p' "$dir/lighthouse.log" | head -1)
}

# lk_bench_wait_trainers WHAT DIR PID...: waits for every trainer; the first that fails ends
# the benchmark with a pointer to DIR.
lk_bench_wait_trainers() {
  local what=$1 dir=$2
  shift 2
  for p in "$@"; do
    if ! wait "$p"; then echo "$what: a trainer failed, see $dir" >&2; exit 1; fi
  done
}

# lk_bench_agents_leave AGENT_PID...: gives the agents up to 10 s to leave after their trainers
# finished, then stops whatever still runs (for scripts that run several jobs on one lighthouse).
lk_bench_agents_leave() {
  for _ in $(seq 1 100); do
    local alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  kill "$@" 2>/dev/null || true
}

# lk_bench_stop LH_PID AGENT_PID...: lk_bench_agents_leave, then stops the lighthouse and waits
# for every child of the script.
lk_bench_stop() {
  local lh=$1
  shift
  lk_bench_agents_leave "$@"
  kill "$lh" 2>/dev/null || true
  wait 2>/dev/null || true
}
