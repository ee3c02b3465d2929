#!/usr/bin/env bash
# Sets everything up on a fresh Debian bookworm machine and runs every test: installs the
# packages, removes what earlier runs left outside the clone (scripts/scrub.sh), builds in
# ./build, and runs CTest. Tests start the services they need themselves (lighthouse, agents,
# a local Slurm) and keep their state under one root per run, $LK_SCRATCH (default
# /tmp/lk-scratch): TMPDIR for every scratch directory and SLURM_BASE for the local Slurm. CI runs
# exactly this (.ci/run), so every CI run is a fresh-machine run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export LK_SCRATCH=${LK_SCRATCH:-/tmp/lk-scratch}
bash scripts/scrub.sh
mkdir -p "$LK_SCRATCH/tmp"
export TMPDIR=$LK_SCRATCH/tmp SLURM_BASE=$LK_SCRATCH/slurm
unset SLURM_CONF
# The local Slurm that the tests started goes down with the run, whatever its outcome (by an
# absolute path: the trap runs after the cd into build/).
root=$(pwd -P)
# The two-node cluster (SLURM_LOCAL_NODES=2) of the multi-node tests lives beside it, in
# "$SLURM_BASE-2n".
trap 'timeout -k 5 60 bash "$root/scripts/slurm-local.sh" down >/dev/null 2>&1 || true
      SLURM_BASE=$SLURM_BASE-2n SLURM_LOCAL_NODES=2 SLURM_LOCAL_PORT=6837 \
        timeout -k 5 60 bash "$root/scripts/slurm-local.sh" down >/dev/null 2>&1 || true' EXIT
# Checked libstdc++ (CMakeLists.txt, LK_GLIBCXX_ASSERTIONS): an index that input drives past the
# end aborts the test that sent it, instead of reading what lies there.
# Debug information at level 1 (line tables: a crash's backtrace names files and lines, which is
# all a test run reads of it) rather than full: compiling and linking are a good part faster on
# CI's two cores and the objects far smaller. A developer's build keeps full -g.
dbg="-O2 -g1 -DNDEBUG"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLK_GLIBCXX_ASSERTIONS=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$dbg" -DCMAKE_C_FLAGS_RELWITHDEBINFO="$dbg"
cmake --build build -j"$(nproc)"
cd build
ctest --output-on-failure --timeout 900 -j"${LK_TEST_JOBS:-2}" "$@"
