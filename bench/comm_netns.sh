#!/usr/bin/env bash
# The communicator figures with every member on a link of its own, as between machines: each
# member runs in a network namespace of its own, joined to the others by a veth pair into one
# bridge, and both ends of every veth are shaped to RATE (a NIC, full duplex). iperf3 runs
# between two members' namespaces over the same shaped links. On plain loopback the "link" is
# the machine's CPUs, shared by every member, so busbw can never pass 1/n of one iperf3 stream;
# here each member has its own link, as the issue's ratio assumes. RATE must stay below what
# the CPUs can push through all links at once, or the CPUs are the bottleneck again.
#
#   bench/comm_netns.sh [BUILD_DIR] [RATE]        e.g. bench/comm_netns.sh build 4gbit
#
# Needs root (ip netns, tc); everything it creates is removed on exit. Traffic stays inside the
# namespaces and the bridge (10.77.0.0/24), which exist only for the run.
set -euo pipefail
BUILD=${1:-build}
RATE=${2:-4gbit}
MEMBERS=8  # the rebuild figure goes up to 8 members
PREFIX=lkns
BRIDGE=lkbr0
if [[ $(id -u) != 0 ]]; then echo "comm_netns.sh needs root (ip netns, tc)" >&2; exit 1; fi
cd "$(dirname "$0")/.."
cmake --build "$BUILD" --target comm_bench comm_test_peer lighthouse >/dev/null

cleanup() {
  for i in $(seq 0 $((MEMBERS - 1))); do
    ip netns del "$PREFIX$i" 2>/dev/null || true
    ip link del "lkv$i" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}
trap cleanup EXIT
cleanup

ip link add "$BRIDGE" type bridge
ip addr add 10.77.0.1/24 dev "$BRIDGE"
ip link set "$BRIDGE" up
# A token bucket on each direction of every member's link; the burst covers one 64 KiB TSO
# segment many times over, and the latency bound keeps the queue short, as a switch port's.
for i in $(seq 0 $((MEMBERS - 1))); do
  ns=$PREFIX$i
  ip netns add "$ns"
  ip link add "lkv$i" type veth peer name eth0 netns "$ns"
  ip link set "lkv$i" master "$BRIDGE" up
  ip -n "$ns" addr add "10.77.0.$((i + 2))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  tc qdisc add dev "lkv$i" root tbf rate "$RATE" burst 4mb latency 5ms  # towards the member
  ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst 4mb latency 5ms  # from it
done
echo "members in namespaces ${PREFIX}0..$((MEMBERS - 1)), each link shaped to $RATE both ways"
cd "$BUILD"
LK_BIN_DIR=$PWD/bin ./bin/comm_bench --netns "$PREFIX" "${@:3}"
