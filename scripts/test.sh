#!/usr/bin/env bash
# Sets everything up on a fresh Debian bookworm machine and runs every test: installs the
# packages, builds in ./build, and runs CTest. Tests start the services they need themselves
# (lighthouse, agents, a local Slurm, nginx). CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j"$(nproc)"
cd build
ctest --output-on-failure --timeout 900 -j"${LK_TEST_JOBS:-2}" "$@"
