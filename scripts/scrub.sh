#!/usr/bin/env bash
# Removes everything earlier runs of the tests, benchmarks and demo left outside the clone, so
# that the run after it starts as on a machine where Lightkeeper never ran. scripts/test.sh calls
# it first; run it by hand with the same effect.
#
# What it stops and removes:
#   - local Slurm daemons (munged, slurmctld, slurmd) whose state lives under /tmp/lk-slurm (the
#     default base of scripts/slurm-local.sh) or under $LK_SCRATCH (the test run's base), and any
#     Lightkeeper binary still running from this clone's build/bin;
#   - /tmp/lk-* and /tmp/lk_* (test scratch, RocksDB dirs, sockets, benchmark temp dirs, the old
#     fixed Slurm base), /tmp/lightkeeper-demo.* (scripts/demo.sh), /dev/shm/lk-* (live state);
#   - $LK_SCRATCH (default /tmp/lk-scratch): the root of one test run (TMPDIR, SLURM_BASE).
# A path that holds this clone itself is never removed. Do not run it while another checkout's
# tests run on the same machine: their scratch matches the same names.
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd -P)
scratch=${LK_SCRATCH:-/tmp/lk-scratch}

for base in /tmp/lk-slurm "$scratch/slurm" "$scratch/slurm-2n" ${SLURM_BASE:+"$SLURM_BASE" "$SLURM_BASE-2n"}; do
  [ -f "$base/slurm.conf" ] || [ -d "$base/munge" ] || continue
  SLURM_BASE=$base timeout -k 5 60 bash scripts/slurm-local.sh down 2>/dev/null || true
done
# Daemons whose pid files went with an earlier scrub still hold Slurm's fixed ports, and so do
# those of a run whose base was elsewhere (tests run with TMPDIR inside a checkout put it under
# $TMPDIR/lk-slurm): every slurm-local.sh daemon names a base with "lk-" in it.
for pat in "slurmctld -f /tmp/lk-" "slurmd -f /tmp/lk-" "munged --socket=/tmp/lk-" \
           "^slurmctld -f [^ ]*/lk-[^ ]*/slurm[.]conf" "^slurmd -f [^ ]*/lk-[^ ]*/slurm[.]conf" \
           "^/usr/sbin/munged --socket=[^ ]*/lk-[^ ]*/munge/"; do
  pkill -KILL -f -- "$pat" 2>/dev/null || true
done
pkill -KILL -f -- "^$top/build/bin/" 2>/dev/null || true

holds_clone() { [ "$top" = "$1" ] || [[ "$top" == "$1"/* ]]; }
removed=0
shopt -s nullglob
for p in /tmp/lk-* /tmp/lk_* /tmp/lightkeeper-demo.* /dev/shm/lk-* "$scratch"; do
  [ -e "$p" ] || [ -L "$p" ] || continue
  p=$(realpath -s "$p")
  holds_clone "$p" && continue
  # A file that a process still running writes into may resist; the run goes on without it.
  rm -rf -- "$p" 2>/dev/null || echo "scrub: could not remove all of $p" >&2
  removed=$((removed + 1))
done
echo "scrub: removed $removed paths left by earlier runs"
