# Shell functions shared by the scripts that build network namespaces (sourced, not run):
# bench/netns/smoke_test.sh, bench/netns/shaped_links.sh and tests/gateway_netns_test.sh. Every
# namespace a script creates is named "$tag-..." so that one sweep removes exactly its own, also
# when the script fails or is interrupted.

# Prints LK_TEST_SKIPPED and the reason, and ends the test as passed: CTest reads the marker
# (SKIP_REGULAR_EXPRESSION) and reports the test skipped.
netns_skip() {
  echo "LK_TEST_SKIPPED: $*"
  exit 0
}

# Skips the test unless this machine can create a network namespace: root, ip(8), and a kernel
# and container that allow it (checked by creating and removing "$1-probe").
netns_require() {
  local tag=$1
  [[ $(id -u) == 0 ]] || netns_skip "needs root for ip netns"
  command -v ip >/dev/null || netns_skip "no ip (iproute2)"
  ip netns add "$tag-probe" 2>/dev/null || netns_skip "cannot create a network namespace here"
  ip netns del "$tag-probe"
}

# Kills what runs in each namespace named "$1-..." and removes the namespace.
netns_remove_all() {
  local tag=$1 ns p
  for ns in $(ip netns list | awk '{print $1}' | grep "^$tag-" || true); do
    for p in $(ip netns pids "$ns"); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
}

# The namespaces "$1-..." still there (none: prints nothing).
netns_left() {
  ip netns list | awk '{print $1}' | grep "^$1-" || true
}
