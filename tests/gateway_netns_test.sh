#!/usr/bin/env bash
# CTest gateway_netns_test: the site topology lk_gateway is for, in network namespaces this
# script creates. The lighthouse's namespace ("wan", 10.77.1.0/24) and the compute nodes'
# ("site", 10.77.2.0/24) share no link and no route; the gateway's namespace has a leg in each
# and does not forward. Two groups (agents started with --gateway, tokens on everywhere) train a
# short job to the end through the gateway, and the lighthouse's /status shows every step
# committed and both groups finished behind the gateway's site. It first checks that the site cannot reach the lighthouse
# directly, so nothing can have gone around the gateway. Without root or ip netns it prints
# LK_TEST_SKIPPED and passes.
#   gateway_netns_test.sh BUILD_DIR
set -uo pipefail
build=$(cd "$1" && pwd)
source "$(dirname "$0")/../bench/netns/lib.sh"
tag=lkgw$$
netns_require "$tag"
trap 'netns_remove_all "$tag"' EXIT
out=$(mktemp -d "${TMPDIR:-/tmp}/lk-gateway-netns-XXXXXX")
fail() {
  echo "FAIL: $*"
  for f in "$out"/*.log "$out"/*.stderr; do [[ -f $f ]] && { echo "== $f"; tail -n 20 "$f"; }; done
  echo "logs kept in $out"
  exit 1
}
# Waits up to $1 tenths of a second for the command after it to succeed.
wait_for() {
  local n=$1
  shift
  for ((i = 0; i < n; i++)); do "$@" && return 0; sleep 0.1; done
  "$@"
}
in_ns() { local ns=$1; shift; ip netns exec "$tag-$ns" "$@"; }

# wan: the lighthouse (10.77.1.1) and the gateway's outer leg (10.77.1.2); site: the gateway's
# inner leg (10.77.2.1) and the compute node (10.77.2.2).
for ns in wan gw site; do
  ip netns add "$tag-$ns" || fail "ip netns add $tag-$ns"
  in_ns "$ns" ip link set lo up
done
ip link add "$tag-w0" type veth peer name "$tag-w1" || fail "veth"
ip link add "$tag-s0" type veth peer name "$tag-s1" || fail "veth"
ip link set "$tag-w0" netns "$tag-wan"
ip link set "$tag-w1" netns "$tag-gw"
ip link set "$tag-s0" netns "$tag-gw"
ip link set "$tag-s1" netns "$tag-site"
in_ns wan ip addr add 10.77.1.1/24 dev "$tag-w0"
in_ns gw ip addr add 10.77.1.2/24 dev "$tag-w1"
in_ns gw ip addr add 10.77.2.1/24 dev "$tag-s0"
in_ns site ip addr add 10.77.2.2/24 dev "$tag-s1"
in_ns wan ip link set "$tag-w0" up
in_ns gw ip link set "$tag-w1" up
in_ns gw ip link set "$tag-s0" up
in_ns site ip link set "$tag-s1" up
in_ns gw sysctl -qw net.ipv4.ip_forward=0

token=tok-t-$RANDOM$RANDOM
admin=tok-admin-$RANDOM$RANDOM
credential=tok-gateway-$RANDOM$RANDOM
printf 't %s\nrole=gateway %s\n' "$token" "$credential" > "$out/lh-tokens"
printf '%s\n' "$credential" > "$out/gateway-credential"
printf '%s\n' "$admin" > "$out/admin-token"
printf 't %s\n' "$token" > "$out/gateway-tokens"
printf '%s\n' "$token" > "$out/token"

in_ns wan "$build/bin/lighthouse" --bind 10.77.1.1:0 --data-dir "$out/data" \
  --token-file "$out/lh-tokens" --admin-token-file "$out/admin-token" --min-replicas 2 \
  --join-timeout-ms 2000 > "$out/lighthouse.log" 2>&1 &
wait_for 200 grep -q 'listening address=' "$out/lighthouse.log" || fail "the lighthouse did not start"
lh=$(grep -o 'listening address=[^ ]*' "$out/lighthouse.log" | head -1 | cut -d= -f2)

# The site has no way to the lighthouse but the gateway.
if in_ns site timeout 3 bash -c "echo > /dev/tcp/${lh%:*}/${lh#*:}" 2>/dev/null; then
  fail "the site reaches the lighthouse at $lh directly"
fi

in_ns gw "$build/bin/lk_gateway" --site site-a --lighthouse "http://$lh" --listen 10.77.2.1:0 \
  --token-file "$out/gateway-tokens" --gateway-token-file "$out/gateway-credential" \
  > "$out/gateway.log" 2>&1 &
wait_for 200 grep -q 'gateway_listening' "$out/gateway.log" || fail "lk_gateway did not start"
gw=$(grep gateway_listening "$out/gateway.log" | grep -o ' listen=[^ ]*' | head -1 | cut -d= -f2)
# The same probe reaches the gateway: the check above can fail.
in_ns site timeout 3 bash -c "echo > /dev/tcp/${gw%:*}/${gw#*:}" 2>/dev/null ||
  fail "the site's probe cannot reach the gateway at $gw either"

steps=20
declare -A trainer
for g in a b; do
  in_ns site "$build/bin/replica_agent" --gateway "$gw" --token-file "$out/token" --job t \
    --group-id "$g" --socket "$out/$g.sock" --heartbeat-interval-ms 100 \
    > "$out/agent-$g.log" 2>&1 &
  wait_for 100 grep -q agent_listening "$out/agent-$g.log" || fail "agent $g did not start"
  in_ns site env LK_AGENT_SOCKET="$out/$g.sock" "$build/bin/test_trainer" --group-rank 0 \
    --group-size 1 --steps $steps --step-sleep-ms 20 --log "$out/trainer-$g.jsonl" \
    > "$out/trainer-$g.stderr" 2>&1 &
  trainer[$g]=$!
done
for g in a b; do
  wait_for 1200 bash -c "! kill -0 ${trainer[$g]} 2>/dev/null" || fail "trainer $g did not finish"
  wait "${trainer[$g]}" || fail "trainer $g exited $?"
  grep -q "\"event\":\"done\".*\"step\":$steps\|\"step\":$steps.*\"event\":\"done\"" \
    "$out/trainer-$g.jsonl" || fail "trainer $g did not reach step $steps"
done

# The lighthouse's record, read on its own side with the admin token.
status() {
  in_ns wan curl -s -H "Authorization: Bearer $admin" "http://$lh/status?job=t"
}
finished() {
  status | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
groups = j.get("groups", [])
ok = int(j.get("committed_step", 0)) == int(sys.argv[1]) and len(groups) == 2 and all(
    g.get("state") == "left" and g.get("reason") == "finished" and g.get("gateway") == "site-a"
    for g in groups)
sys.exit(0 if ok else 1)' "$steps"
}
wait_for 300 finished || fail "the lighthouse's status is not the finished run: $(status)"
grep -q "relay_refused" "$out/gateway.log" && fail "the gateway refused an agent's call"
echo "PASS: two groups trained $steps steps through lk_gateway with no route to the lighthouse"
rm -rf "$out"
