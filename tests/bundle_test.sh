#!/bin/bash
# The portable bundle as a site meets it (scripts/bundle.sh): unpacked into an empty root whose
# only other content is a static busybox (no C library, no loader, nothing of Debian), then in a
# chroot there a lighthouse, an agent that joins it, and lkctl status; the trainer's bin/ entry
# starts too (--help). Then, outside the chroot, the Python module is built for this machine's
# Python against the unpacked bundle the way BUNDLE.md tells a site to, and imported.
# Needs root (chroot, mknod); elsewhere it prints LK_TEST_SKIPPED and CTest reports it skipped.
# Usage: bundle_test.sh BUILD_DIR
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -ne 0 ]; then echo "LK_TEST_SKIPPED: the chroot needs root"; exit 0; fi
BUSYBOX=$(command -v busybox || true)
if [ -z "$BUSYBOX" ] || ! file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked'; then
  # Without file(1), ask the loader: a static binary is "not a dynamic executable".
  if [ -z "$BUSYBOX" ] || ldd "$BUSYBOX" > /dev/null 2>&1; then
    echo "LK_TEST_SKIPPED: no static busybox (busybox-static, scripts/install-deps.sh)"; exit 0
  fi
fi
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-bundle-test-XXXXXX")
ROOT=$TMP/root
cleanup() {
  local rc=$?
  # Whatever still runs inside the chroot goes with it.
  for p in $(ls /proc | grep -E '^[0-9]+$'); do
    if [ "$(readlink "/proc/$p/root" 2>/dev/null)" = "$ROOT" ]; then kill -9 "$p" 2>/dev/null || true; fi
  done
  if [ $rc -eq 0 ] && [ -z "${LK_KEEP_TEST_DIRS:-}" ]; then rm -rf "$TMP"; else echo "kept $TMP"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. The bundle (gzip -1: the test checks the contents, not the packing).
# LK_BUNDLE_TARBALL: test a tarball made before (of the same build) instead of making one.
if [ -n "${LK_BUNDLE_TARBALL:-}" ]; then
  TARBALL=$LK_BUNDLE_TARBALL
else
  LK_BUNDLE_GZIP_LEVEL=1 bash "$SRC/scripts/bundle.sh" "$BUILD" "$TMP/out" > "$TMP/bundle.log" 2>&1 ||
    { cat "$TMP/bundle.log"; fail "bundle.sh"; }
  TARBALL=$(tail -1 "$TMP/bundle.log")
fi
[ -f "$TARBALL" ] || fail "bundle.sh's last line is not the tarball: $TARBALL"
case "$TARBALL" in */lightkeeper-*-linux-x86_64.tar.gz) ;; *) fail "tarball name $TARBALL" ;; esac

# 2. The empty root: busybox, device nodes, an empty /tmp; the bundle unpacked in /opt.
mkdir -p "$ROOT/bin" "$ROOT/tmp" "$ROOT/dev" "$ROOT/opt"
cp "$BUSYBOX" "$ROOT/bin/busybox"
for applet in sh cat grep sleep kill ls head cut wc tr; do ln -s busybox "$ROOT/bin/$applet"; done
mknod -m 666 "$ROOT/dev/null" c 1 3
mknod -m 666 "$ROOT/dev/urandom" c 1 9
mknod -m 666 "$ROOT/dev/random" c 1 8
tar -C "$ROOT/opt" -xzf "$TARBALL"
[ "$(ls "$ROOT/opt" | wc -l)" = 1 ] || fail "more than one top-level folder: $(ls "$ROOT/opt")"
TOP=$(ls "$ROOT/opt")
B=/opt/$TOP
[ -d "$ROOT$B/lib/glibc" ] || fail "no lib/glibc in the bundle"
if ls "$ROOT$B/lib"/libc.so.* > /dev/null 2>&1; then fail "the C library is in lib/, where an RPATH reaches it"; fi
for p in lighthouse replica_agent lk_gateway lkctl diloco_trainer; do
  sed -n 1p "$ROOT$B/bin/$p" | grep -q '^#!/bin/sh' || fail "bin/$p is not a sh script"
done
# Nothing the root holds but busybox, the nodes and the bundle: no library of the host.
if find "$ROOT" -path "$ROOT$B" -prune -o -name '*.so*' -print | grep .; then fail "host libraries in the root"; fi

# 3. In the chroot: a lighthouse, an agent that joins it, lkctl status.
cat > "$ROOT/tmp/run.sh" <<EOF
#!/bin/sh
set -e
B=$B
\$B/bin/lighthouse --bind 127.0.0.1:0 --data-dir /tmp/lh --min-replicas 1 > /tmp/lh.log 2>&1 &
i=0
while ! grep -q 'listening address=' /tmp/lh.log; do
  i=\$((i + 1)); [ \$i -lt 300 ] || { cat /tmp/lh.log; echo "lighthouse did not start"; exit 1; }
  sleep 0.1
done
ADDR=\$(grep -o 'listening address=[^ ]*' /tmp/lh.log | head -1 | cut -d= -f2)
\$B/bin/replica_agent --lighthouse http://\$ADDR --job bundled --group-id g0 --socket /tmp/g0.sock \\
  --heartbeat-interval-ms 100 > /tmp/agent.log 2>&1 &
i=0
while ! \$B/bin/lkctl status --lighthouse http://\$ADDR > /tmp/status.txt 2>&1 || ! grep -q g0 /tmp/status.txt; do
  i=\$((i + 1)); [ \$i -lt 300 ] || { cat /tmp/agent.log /tmp/status.txt; echo "the agent never joined"; exit 1; }
  sleep 0.1
done
cat /tmp/status.txt
\$B/bin/diloco_trainer --help > /tmp/trainer_help.txt 2>&1 || true
grep -q -- '--inner-steps' /tmp/trainer_help.txt || { cat /tmp/trainer_help.txt; echo "diloco_trainer did not start"; exit 1; }
echo "chroot run ok"
EOF
chmod 755 "$ROOT/tmp/run.sh"
timeout 120 chroot "$ROOT" /bin/sh /tmp/run.sh > "$TMP/chroot.out" 2>&1 || { cat "$TMP/chroot.out"; fail "the bundle in the empty root"; }
cat "$TMP/chroot.out"
grep -q 'bundled' "$TMP/chroot.out" || fail "lkctl status does not show the job"
grep -q 'chroot run ok' "$TMP/chroot.out" || fail "the chroot script did not finish"

# 4. The Python module for this machine's Python, built against the unpacked bundle as BUNDLE.md
#    says, then imported and used (a session to an agent socket that is not there fails cleanly).
if python3 -c 'import pybind11' 2> /dev/null || [ -d /usr/lib/cmake/pybind11 ]; then
  PB=$ROOT$B
  cmake -S "$PB/share/lightkeeper/python-site" -B "$TMP/py" -DCMAKE_PREFIX_PATH="$PB" \
    -DPython3_EXECUTABLE=/usr/bin/python3 > "$TMP/py.log" 2>&1 || { cat "$TMP/py.log"; fail "configure the site module"; }
  cmake --build "$TMP/py" > "$TMP/py-build.log" 2>&1 || { cat "$TMP/py-build.log"; fail "build the site module"; }
  cmake --install "$TMP/py" --prefix "$TMP/pyinst" > /dev/null || fail "install the site module"
  for f in py.typed _native.pyi; do
    [ -e "$TMP/pyinst/lightkeeper/$f" ] || fail "the site install has no lightkeeper/$f"
  done
  PYTHONPATH=$TMP/pyinst /usr/bin/python3 - "$PB" <<'PY' || fail "the site module does not import or run"
import sys
import lightkeeper
from lightkeeper import _native
print("site module:", _native.__file__)
try:
    lightkeeper.Manager(socket="/nonexistent/agent.sock", group_rank=0, group_size=1)
except lightkeeper.Error as e:
    print("refused as expected:", type(e).__name__)
else:
    raise SystemExit("a session to a missing socket did not fail")
PY
else
  echo "pybind11 is missing: the site module build is not checked"
fi
echo "bundle test passed"
