#!/usr/bin/env bash
# CTest shaped_links_smoke_test: a short DiLoCo job (two groups of one trainer, a tiny model)
# across a shaped link between network namespaces (1 Gbit/s, 20 ms RTT). It checks correctness
# only, never a speed: the namespaces exist during the run and are gone after it, every trainer
# committed every step with equal weights across the groups, the link carried the cross-group
# bytes, the link's RTT is at least the profile's, and each site reads the other site's agent
# status on its --serve address with the job's token (200) and is refused without it (401).
# Without root, ip netns, tc tbf or /dev/net/tun it prints LK_TEST_SKIPPED and passes.
#   smoke_test.sh BUILD_DIR
set -uo pipefail
build=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/bench/netns/lib.sh"
tag=lkst$$
netns_require "$tag"
command -v tc >/dev/null || netns_skip "no tc (iproute2)"
[[ -c /dev/net/tun ]] || netns_skip "no /dev/net/tun"
probe=$tag-probe
ip netns add "$probe"
if ! ip netns exec "$probe" tc qdisc add dev lo root tbf rate 1gbit burst 128k latency 20ms \
    2>/dev/null; then
  ip netns del "$probe"
  netns_skip "the kernel has no tbf qdisc"
fi
ip netns del "$probe"
trap 'netns_remove_all "$tag"' EXIT
out=$(mktemp -d "${TMPDIR:-/tmp}/lk-shaped-smoke-XXXXXX")
/usr/bin/python3 "$root/bench/netns/shaped_links.py" --smoke --build "$build" --tag "$tag" \
  --out "$out" --profile smoke=1gbit,20 --inner-steps 2 --outer-steps 3 --job-timeout-s 200 \
  --model "--model-width 32 --layers 1 --heads 2 --seq-len 32 --batch 4" --setting float32=
rc=$?
left=$(netns_left "$tag")
if [[ -n $left ]]; then echo "FAIL: namespaces left behind: $left"; rc=1; fi
if [[ $rc == 0 ]]; then rm -rf "$out"; else echo "logs kept in $out"; fi
exit $rc
