#!/usr/bin/env bash
# The lighthouse benchmark in one command: builds the lighthouse and the load generator, starts
# nginx as the heartbeat peer with a config of its own under a temp dir (never the system one),
# runs every mode of lighthouse_bench, runs wrk against both as a second opinion, stops all it
# started, and prints markdown tables. All traffic stays on 127.0.0.1; every wait is bounded.
#
#   bench/lighthouse_bench.sh                 # everything, ~2-3 minutes on 2 cores
#   LK_BENCH_MODES=formation bench/lighthouse_bench.sh   # one mode (see lighthouse_bench --help)
#
# Environment: LK_BENCH_BUILD_DIR (default build-bench), LK_BENCH_JOBS (ninja -j, default 1),
# LK_BENCH_KEEP=1 keeps the temp dir (logs, nginx config), plus every LK_BENCH_* flag of
# lighthouse_bench.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${LK_BENCH_BUILD_DIR:-$root/build-bench}
jobs=${LK_BENCH_JOBS:-1}
cd "$root"

echo "building lighthouse and lighthouse_bench in $build (ninja -j$jobs)..." >&2
cmake -S . -B "$build" -G Ninja >/dev/null
ninja -C "$build" -j"$jobs" lighthouse lighthouse_bench >"$build/lighthouse_bench_build.log" 2>&1 || {
  tail -40 "$build/lighthouse_bench_build.log" >&2
  exit 1
}
bench="$build/bin/lighthouse_bench"
for tool in nginx wrk; do
  command -v "$tool" >/dev/null || { echo "$tool is missing: run scripts/install-deps.sh" >&2; exit 1; }
done

work=$(mktemp -d /tmp/lk-lighthouse-bench.XXXXXX)
nginx_pid=""
wrk_lh_pid=""
stop_pid() {  # pid, signal: signal it, wait up to 5 s, then SIGKILL
  local pid=$1 sig=$2
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
  kill "-$sig" "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}
cleanup() {
  stop_pid "$wrk_lh_pid" TERM
  stop_pid "$nginx_pid" QUIT
  if [[ ${LK_BENCH_KEEP:-0} == 1 ]]; then echo "kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() {  # port: until something accepts on 127.0.0.1:port, at most 10 s
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on 127.0.0.1:$1" >&2
  return 1
}

# ---- nginx: one worker (the lighthouse serves on one thread), a static 204 for any request ----
nginx_port=$("$bench" --free-port)
mkdir -p "$work/nginx"
user_line=""
[[ $(id -u) == 0 ]] && user_line="user nobody nogroup;"
cat >"$work/nginx/nginx.conf" <<EOF
$user_line
worker_processes 1;
worker_rlimit_nofile 20000;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 16384; multi_accept on; }
http {
  access_log off;
  client_body_temp_path $work/nginx/body;
  proxy_temp_path $work/nginx/proxy;
  fastcgi_temp_path $work/nginx/fastcgi;
  uwsgi_temp_path $work/nginx/uwsgi;
  scgi_temp_path $work/nginx/scgi;
  keepalive_requests 1000000000;
  keepalive_timeout 120s;
  tcp_nodelay on;
  server {
    listen 127.0.0.1:$nginx_port backlog=4096;
    location / { return 204; }
  }
}
EOF
nginx -p "$work/nginx/" -c "$work/nginx/nginx.conf" -e "$work/nginx/error.log" \
  -g 'daemon off;' &
nginx_pid=$!
wait_port "$nginx_port"
nginx_worker=$(cat "/proc/$nginx_pid/task/$nginx_pid/children" 2>/dev/null | awk '{print $1}')

echo "## Lighthouse benchmark"
echo
echo "- machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "$(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), Linux $(uname -r);" \
  "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "- peers: $(nginx -v 2>&1 | cut -d: -f2 | xargs) (1 worker, static 204), a raw TCP barrier" \
  "in the load generator's process; lighthouse $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
echo
"$bench" --bin-dir "$build/bin" --work-dir "$work" --nginx "127.0.0.1:$nginx_port" \
  --nginx-pid "${nginx_worker:-0}" 2>"$work/bench.err" || {
  echo "lighthouse_bench failed:" >&2
  cat "$work/bench.err" >&2
  exit 1
}

# ---- wrk, a second opinion on the heartbeat rate: JSON bodies, one thread, 1,000 connections ----
if [[ ${LK_BENCH_WRK:-1} == 1 ]]; then
  mkdir -p "$work/wrk-lh"
  "$build/bin/lighthouse" --bind 127.0.0.1:0 --data-dir "$work/wrk-lh/data" \
    >"$work/wrk-lh/log" 2>&1 &
  wrk_lh_pid=$!
  lh_addr=""
  for _ in $(seq 200); do
    lh_addr=$(grep -o 'listening address=[0-9.:]*' "$work/wrk-lh/log" | head -1 | cut -d= -f2 ||
      true)
    [[ -n $lh_addr ]] && break
    sleep 0.05
  done
  [[ -n $lh_addr ]] || { echo "wrk's lighthouse did not start" >&2; exit 1; }
  cat >"$work/post.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"job":"wrk","group_id":"group-00001","incarnation":"inc-1","node_rank":0,"nodes":1,"step":0,"phase":"inner","address":"127.0.0.1:29600"}'
wrk.headers["Content-Type"] = "application/json"
EOF
  wrk_rate() {  # url: requests/s over 3 s after 1 s of warm-up
    timeout 30 wrk -t1 -c1000 -d1s -s "$work/post.lua" "$1" >/dev/null 2>&1 || true
    timeout 30 wrk -t1 -c1000 -d3s -s "$work/post.lua" "$1" 2>&1 |
      awk '/Requests\/sec/ {print $2} /Non-2xx/ {print "non-2xx:" $NF > "/dev/stderr"}'
  }
  lh_rate=$(wrk_rate "http://$lh_addr/v1/heartbeat")
  ng_rate=$(wrk_rate "http://127.0.0.1:$nginx_port/v1/heartbeat")
  echo
  echo "| wrk -t1 -c1000 (JSON heartbeat) | Lighthouse | nginx 204 | ratio |"
  echo "|---|---|---|---|"
  awk -v l="$lh_rate" -v n="$ng_rate" 'BEGIN {
    printf "| requests/s | %.0f/s | %.0f/s | %s |\n", l, n, (n > 0 ? sprintf("%.2fx", l / n) : "n/a") }'
  stop_pid "$wrk_lh_pid" TERM
  wrk_lh_pid=""
fi
echo
echo "Details (load generator's own CPU, reasons):"
sed 's/^/    /' "$work/bench.err"
