#!/usr/bin/env bash
# A storm of mutated requests against a real lighthouse and replica_agent on loopback
# (bench/request_storm.py, bench/security.md): both must stay up, answer every request with a
# well-formed response below 500, and leave the attacked job's /status unchanged.
# Usage: bench/request_storm.sh [BUILD_DIR] [REQUESTS] [more request_storm.py flags...]
# The figures go to stdout and, as JSON, to $TMPDIR/request_storm.json.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
REQUESTS=${2:-300000}
shift $(( $# > 2 ? 2 : $# ))
cmake --build "$BUILD" --target lighthouse replica_agent >/dev/null
exec /usr/bin/python3 bench/request_storm.py --bin "$BUILD/bin" --requests "$REQUESTS" \
  --json "${TMPDIR:-/tmp}/request_storm.json" "$@"
