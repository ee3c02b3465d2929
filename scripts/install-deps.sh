#!/usr/bin/env bash
# Installs every Debian bookworm package that building, testing and benchmarking Lightkeeper needs.
# Idempotent: packages already present are skipped by apt, and apt-get update runs only when a
# package is missing. Boost is installed by its versioned 1.81 names only, because the unversioned
# libboost-*-dev packages pull 1.74 and conflict with them.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl python3 python3-numpy
  libboost1.81-dev libboost-program-options1.81-dev libboost-json1.81-dev
  libprotobuf-dev protobuf-compiler librocksdb-dev libfmt-dev doctest-dev
  libtorch-dev libgloo-dev libxxhash-dev libssl-dev
  # Debian's torch calls whatever libblas.so.3 the alternatives name; the reference BLAS made the
  # character model's linear layers ~10x slower (bench/python_trainer.md). Serial, not pthread:
  # several trainers share a node's cores, and one thread per GEMM keeps runs reproducible.
  libopenblas0-serial
  slurm-wlm munge
  nginx-light wrk iperf3 fio procps iproute2 openssl
  python3-torch python3-pytest python3-matplotlib pybind11-dev python3-dev mypy
  clang-14 libfuzzer-14-dev
  # The portable bundle (scripts/bundle.sh) and its test in an empty root with a static busybox.
  patchelf busybox-static
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
# The packaged daemons must not keep running after install: tests start their own instances.
for svc in nginx munge slurmctld slurmd; do
  $SUDO service "$svc" stop >/dev/null 2>&1 || true
done
echo "install-deps: installed ${missing[*]}"
