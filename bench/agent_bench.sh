#!/usr/bin/env bash
# Agent figures beside their floors, measured in one run (see bench/agent_bench.cc).
# Usage: bench/agent_bench.sh [BUILD_DIR] [ROUNDS] [INNER_MS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
cmake --build "$BUILD" --target agent_bench lighthouse replica_agent >/dev/null
echo "| figure | Lightkeeper | floor, same run | ratio |"
echo "|---|---|---|---|"
LK_BIN_DIR=$PWD/$BUILD/bin "$BUILD/bin/agent_bench" "${2:-2000}" "${3:-5}"
