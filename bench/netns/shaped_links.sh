#!/usr/bin/env bash
# DiLoCo on shaped wide-area links between network namespaces, beside its yardsticks measured in
# the same run (bench/netns.md): the link's RTT and iperf3 capacity, plain data parallelism's
# bytes and time on the same link, the same trainers without cross-group communication.
#
#   bench/netns/shaped_links.sh [BUILD_DIR] [shaped_links.py flags...]
#   e.g. bench/netns/shaped_links.sh build --profile 1g30=1gbit,30 --setting 'int8=--outer-compress int8'
#
# Needs root (ip netns, tc). Everything it creates (namespaces named lkPID-*, their TUN devices
# and shaping) is removed on exit, also when the run fails or is interrupted. Traffic stays
# inside those namespaces (10.78.0.0/24 exists only there).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
shift || true
if [[ $(id -u) != 0 ]]; then echo "shaped_links.sh needs root (ip netns, tc)" >&2; exit 1; fi
cmake --build "$build" --target diloco_trainer replica_agent lighthouse comm_test_peer \
  lk_link_delay >/dev/null
source "$root/bench/netns/lib.sh"
tag=lk$$
# The driver removes its namespaces itself; this is for a driver that was killed.
trap 'netns_remove_all "$tag"' EXIT
/usr/bin/python3 "$root/bench/netns/shaped_links.py" --build "$build" --tag "$tag" "$@"
