#!/usr/bin/env bash
# CTest gateway_sites_netns_test: two sites whose compute nodes reach nothing outside their site,
# in network namespaces this script creates. The "wan" namespace holds the lighthouse
# (10.77.1.1) and each gateway's outer leg (site A's 10.77.1.2, site B's 10.77.1.3) on one
# bridge; site A's nodes (10.77.2.2) reach only gateway A's inner leg (10.77.2.1), site B's
# (10.77.4.2) only gateway B's (10.77.4.1); the gateways do not forward. Gateway A listens for
# the other gateways (--wan-listen); gateway B only dials out (--wan-connect), as a site behind
# NAT. Two DiLoCo groups per site (agents with --gateway, tokens on everywhere, int8 outer
# compression) train to the end: their outer exchange crosses the sites through the two gateways
# only, with the partial sums int8 on the WAN, every group commits the same global hash at every
# step, and the lighthouse shows every step committed and all four
# groups finished behind their sites. It first checks that neither site reaches the lighthouse or
# the other site, so nothing can have gone around the gateways. Without root or ip netns it
# prints LK_TEST_SKIPPED and passes.
#   gateway_sites_netns_test.sh BUILD_DIR
set -uo pipefail
build=$(cd "$1" && pwd)
source "$(dirname "$0")/../bench/netns/lib.sh"
tag=lkgs$$
netns_require "$tag"
trap 'netns_remove_all "$tag"' EXIT
out=$(mktemp -d "${TMPDIR:-/tmp}/lk-gateway-sites-XXXXXX")
fail() {
  echo "FAIL: $*"
  for f in "$out"/*.log "$out"/*.stderr; do [[ -f $f ]] && { echo "== $f"; tail -n 20 "$f"; }; done
  echo "logs kept in $out"
  exit 1
}
wait_for() {
  local n=$1
  shift
  for ((i = 0; i < n; i++)); do "$@" && return 0; sleep 0.1; done
  "$@"
}
in_ns() { local ns=$1; shift; ip netns exec "$tag-$ns" "$@"; }
reaches() { in_ns "$1" timeout 3 bash -c "echo > /dev/tcp/${2%:*}/${2#*:}" 2>/dev/null; }

for ns in wan gwa gwb sa sb; do
  ip netns add "$tag-$ns" || fail "ip netns add $tag-$ns"
  in_ns "$ns" ip link set lo up
done
in_ns wan ip link add br0 type bridge || fail "bridge"
in_ns wan ip addr add 10.77.1.1/24 dev br0
in_ns wan ip link set br0 up
# veth NAME_A in namespace A with ADDR_A, NAME_B in namespace B with ADDR_B ("" for a bridge port).
link() {
  ip link add "$tag-$1" type veth peer name "$tag-$4" || fail "veth $1"
  ip link set "$tag-$1" netns "$tag-$2"
  ip link set "$tag-$4" netns "$tag-$5"
  if [[ -n $3 ]]; then in_ns "$2" ip addr add "$3" dev "$tag-$1"; else in_ns "$2" ip link set "$tag-$1" master br0; fi
  in_ns "$5" ip addr add "$6" dev "$tag-$4"
  in_ns "$2" ip link set "$tag-$1" up
  in_ns "$5" ip link set "$tag-$4" up
}
link wa wan "" oa gwa 10.77.1.2/24
link wb wan "" ob gwb 10.77.1.3/24
link ia gwa 10.77.2.1/24 na sa 10.77.2.2/24
link ib gwb 10.77.4.1/24 nb sb 10.77.4.2/24
in_ns gwa sysctl -qw net.ipv4.ip_forward=0
in_ns gwb sysctl -qw net.ipv4.ip_forward=0

token=tok-x-$RANDOM$RANDOM
admin=tok-admin-$RANDOM$RANDOM
printf 'x %s\n' "$token" > "$out/lh-tokens"
printf '%s\n' "$admin" > "$out/admin-token"
printf 'x %s\n' "$token" > "$out/gateway-tokens"
printf '%s\n' "$token" > "$out/token"

in_ns wan "$build/bin/lighthouse" --bind 10.77.1.1:0 --data-dir "$out/data" \
  --token-file "$out/lh-tokens" --admin-token-file "$out/admin-token" --min-replicas 4 \
  --join-timeout-ms 20000 > "$out/lighthouse.log" 2>&1 &
wait_for 200 grep -q 'listening address=' "$out/lighthouse.log" || fail "the lighthouse did not start"
lh=$(grep -o 'listening address=[^ ]*' "$out/lighthouse.log" | head -1 | cut -d= -f2)

in_ns gwa "$build/bin/lk_gateway" --site site-a --lighthouse "http://$lh" --listen 10.77.2.1:0 \
  --wan-listen 10.77.1.2:0 --token-file "$out/gateway-tokens" \
  > "$out/gateway-a.log" 2>&1 &
wait_for 200 grep -q 'gateway_wan' "$out/gateway-a.log" || fail "gateway A did not start"
gwa=$(grep gateway_listening "$out/gateway-a.log" | grep -o ' listen=[^ ]*' | head -1 | cut -d= -f2)
wana=$(grep gateway_wan "$out/gateway-a.log" | grep -o ' wan_listen=[^ ]*' | head -1 | cut -d= -f2)
in_ns gwb "$build/bin/lk_gateway" --site site-b --lighthouse "http://$lh" --listen 10.77.4.1:0 \
  --wan-connect "$wana" --token-file "$out/gateway-tokens" > "$out/gateway-b.log" 2>&1 &
wait_for 200 grep -q 'gateway_wan' "$out/gateway-b.log" || fail "gateway B did not start"
gwb=$(grep gateway_listening "$out/gateway-b.log" | grep -o ' listen=[^ ]*' | head -1 | cut -d= -f2)

# Neither site reaches the lighthouse, the other site's gateway or the WAN; each reaches its own
# gateway (so the probe can succeed).
for probe in "sa $lh" "sa $wana" "sa $gwb" "sb $lh" "sb $wana" "sb $gwa"; do
  # shellcheck disable=SC2086
  reaches $probe && fail "probe $probe went through: the sites are not cut off"
done
reaches sa "$gwa" || fail "site A's probe cannot reach its gateway at $gwa"
reaches sb "$gwb" || fail "site B's probe cannot reach its gateway at $gwb"

steps=6
declare -A trainer
for g in a0 a1 b0 b1; do
  ns=s${g:0:1}
  gw=$gwa
  [[ $g == b* ]] && gw=$gwb
  in_ns "$ns" "$build/bin/replica_agent" --gateway "$gw" --token-file "$out/token" --job x \
    --group-id "$g" --socket "$out/$g.sock" --heartbeat-interval-ms 200 \
    > "$out/agent-$g.log" 2>&1 &
  wait_for 100 grep -q agent_listening "$out/agent-$g.log" || fail "agent $g did not start"
  in_ns "$ns" env LK_AGENT_SOCKET="$out/$g.sock" LK_GROUP_ID="$g" "$build/bin/diloco_trainer" \
    --group-rank 0 --group-size 1 --inner-steps 4 --outer-steps $steps --seed 7 \
    --log "$out/trainer-$g.jsonl" --model-width 32 --layers 1 --heads 2 --seq-len 32 --batch 4 \
    --corpus-bytes 16384 --op-timeout-ms 30000 --outer-compress int8 \
    > "$out/trainer-$g.stderr" 2>&1 &
  trainer[$g]=$!
done
for g in a0 a1 b0 b1; do
  wait_for 1200 bash -c "! kill -0 ${trainer[$g]} 2>/dev/null" || fail "trainer $g did not finish"
  wait "${trainer[$g]}" || fail "trainer $g exited $?"
  grep -q "comm_ready backend=gateway" "$out/trainer-$g.stderr" ||
    fail "trainer $g did not exchange through its gateway"
done
# One global hash per step across the four groups, every step of the run.
/usr/bin/python3 - "$out" "$steps" <<'EOF' || fail "the groups' hashes differ"
import json, sys
out, steps = sys.argv[1], int(sys.argv[2])
by_step = {}
for g in ("a0", "a1", "b0", "b1"):
    for line in open(f"{out}/trainer-{g}.jsonl"):
        o = json.loads(line)
        by_step.setdefault(o["step"], set()).add(o["param_hash"])
ok = sorted(by_step) == list(range(1, steps + 1)) and all(len(h) == 1 for h in by_step.values())
print("hashes per step:", {s: sorted(h) for s, h in sorted(by_step.items())})
sys.exit(0 if ok else 1)
EOF

status() {
  in_ns wan curl -s -H "Authorization: Bearer $admin" "http://$lh/status?job=x"
}
finished() {
  status | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
groups = j.get("groups", [])
ok = int(j.get("committed_step", 0)) == int(sys.argv[1]) and len(groups) == 4 and all(
    g.get("state") == "left" and g.get("reason") == "finished" for g in groups)
sys.exit(0 if ok else 1)' "$steps"
}
wait_for 300 finished || fail "the lighthouse's status is not the finished run: $(status)"
grep -q "exchange_refused\|relay_refused" "$out"/gateway-*.log && fail "a gateway refused a call of the job"
# The WAN carried int8 partials: about a quarter of the float32 bytes of one partial per round.
pkill -TERM -f "lk_gateway --site site-b" || true
wait_for 100 grep -q gateway_exchange_totals "$out/gateway-b.log" || fail "gateway B did not stop"
/usr/bin/python3 - "$out/gateway-b.log" <<'EOF' || fail "the WAN bytes are not int8's"
import re, sys
line = [l for l in open(sys.argv[1]) if "gateway_exchange_totals" in l][-1]
f = dict(re.findall(r" (\w+)=(\d+)", line))
member, sent = int(f["member_bytes"]), int(f["wan_sent_bytes"])
print(line.strip())
# Two members per site: float32 partials would be member / 2. The outer steps' partials are
# int8 (about a quarter); the join's state sync (weights and momentum, once) stays float32 and
# is most of the bytes of so short a run, so the whole is below half, not a quarter.
sys.exit(0 if 0 < sent < member / 2 * 0.5 else 1)
EOF
echo "PASS: two sites with no route between them trained $steps DiLoCo steps through their gateways"
rm -rf "$out"
