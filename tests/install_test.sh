#!/bin/bash
# The installed tree as users get it: `cmake --install` into a temp prefix, the prefix moved
# elsewhere (it must be relocatable), its public headers checked for what they must not pull in,
# then a small trainer built out of tree against it, once with find_package and once with
# pkg-config, and run against the installed lighthouse and replica_agent (two groups, a few
# outer steps; both must end on the same global weights).
# Usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-install-XXXXXX")
PIDS=()
cleanup() {
  local rc=$?
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [ $rc -eq 0 ] && [ -z "${LK_KEEP_TEST_DIRS:-}" ]; then rm -rf "$TMP"; else echo "kept $TMP"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. Install, then move the tree: nothing may point back at the first prefix or the build.
cmake --install "$BUILD" --prefix "$TMP/stage" > "$TMP/install.log"
mv "$TMP/stage" "$TMP/moved"
P=$TMP/moved
for f in bin/lighthouse bin/replica_agent bin/lk_gateway bin/lkctl bin/diloco_trainer lib/liblightkeeper.so \
         lib/cmake/Lightkeeper/LightkeeperConfig.cmake lib/pkgconfig/lightkeeper.pc \
         include/lightkeeper/lightkeeper.h include/lightkeeper/session.h include/lightkeeper/diloco.h; do
  [ -e "$P/$f" ] || fail "$f is not installed"
done
if grep -rl -e "$BUILD" -e "$SRC" -e "$TMP/stage" "$P/lib/cmake" "$P/lib/pkgconfig"; then
  fail "absolute build, source or install paths in the CMake or pkg-config files"
fi
for f in "$P"/bin/* "$P"/lib/liblightkeeper.so; do
  if readelf -d "$f" | grep -E 'R(UN)?PATH' | grep -q -e "$BUILD" -e "$SRC" -e "$TMP"; then
    fail "$f has an RPATH into the build machine: $(readelf -d "$f" | grep -E 'R(UN)?PATH')"
  fi
done
# The Python package is typed where it is installed too (PEP 561's marker and the compiled
# module's stub), in the built package and in the sources a site builds it from.
if [ -d "$P/lib/python3/dist-packages/lightkeeper" ]; then
  for f in lib/python3/dist-packages/lightkeeper/py.typed lib/python3/dist-packages/lightkeeper/_native.pyi \
           share/lightkeeper/python-site/lightkeeper/py.typed share/lightkeeper/python-site/lightkeeper/_native.pyi; do
    [ -e "$P/$f" ] || fail "$f is not installed"
  done
fi
readelf -d "$P/bin/diloco_trainer" | grep -E 'R(UN)?PATH' | grep -q '\$ORIGIN/../lib' ||
  fail "diloco_trainer has no \$ORIGIN-relative RPATH"
# The library exports its API and nothing of what it links in statically.
nm -D --defined-only "$P/lib/liblightkeeper.so" > "$TMP/symbols"
grep -q ' T lk_diloco_sync$' "$TMP/symbols" || fail "lk_diloco_sync is not exported"
grep -q ' T lk_comm_allreduce$' "$TMP/symbols" || fail "lk_comm_allreduce is not exported"
# Symbol names only (a public function may take an opaque internal type in its signature).
c++filt < "$TMP/symbols" | cut -d' ' -f3- > "$TMP/names"
if grep -E '^((typeinfo|typeinfo name|vtable) for )?(boost|google|gloo|asio|lk::http|lk::ckpt|lk::comm)::' "$TMP/names" | head -3 | grep .; then
  fail "liblightkeeper.so exports Boost, protobuf, Gloo or internal symbols"
fi
# Exactly what the installed headers declare: only the C API and our namespaces, no internals
# (an Impl's or a detail namespace's members, a private ...Locked helper), and every C++ name's
# function and class appear in a public header.
if grep -v -E '^lk_|^((typeinfo|typeinfo name|vtable) for )?lk::' "$TMP/names" | head -3 | grep .; then
  fail "liblightkeeper.so exports symbols outside the C API and lk::"
fi
if grep -E '::Impl::|::detail::|Locked\b|::Impl\b' "$TMP/names" | head -3 | grep .; then
  fail "liblightkeeper.so exports internals"
fi
cat "$P"/include/lightkeeper/*.h > "$TMP/headers"
while IFS= read -r name; do
  base=${name%%(*}
  base=${base#typeinfo name for }
  base=${base#typeinfo for }
  base=${base#vtable for }
  base=$(sed 's/\[abi:[^]]*\]//g' <<< "$base")
  for part in $(echo "$base" | tr -s ':' ' '); do
    part=${part#\~}
    part=${part%%<*}
    grep -q -w -F -- "$part" "$TMP/headers" || fail "exported $name: $part is in no installed header"
  done
done < <(grep -E '^((typeinfo|typeinfo name|vtable) for )?lk::' "$TMP/names" | grep -v -E '^lk::[A-Za-z_]+$')

# 2. Every public header compiles alone, and none of them includes Asio, Beast, protobuf,
#    OpenSSL or Gloo (they all live in /usr/include, so the check is on what each one reads).
INC=$P/include
while IFS= read -r h; do
  rel=${h#"$INC"/}
  echo "#include <$rel>" > "$TMP/one.cc"
  c++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -I"$INC" -MD -MF "$TMP/deps" "$TMP/one.cc" ||
    fail "$rel does not compile alone"
  if grep -E '/(boost|google/protobuf|openssl|gloo|asio)/' "$TMP/deps"; then
    fail "$rel includes a header it must not"
  fi
done < <(find "$INC/lightkeeper" -name '*.h' | sort)
echo '#include <lightkeeper/lightkeeper.h>' > "$TMP/one.c"
cc -std=c11 -fsyntax-only -Wall -Wextra -Werror -I"$INC" "$TMP/one.c" ||
  fail "lightkeeper.h does not compile as C"

# 3. Out-of-tree builds: find_package and pkg-config.
cmake -S "$SRC/tests/install" -B "$TMP/ob" -G Ninja -DCMAKE_PREFIX_PATH="$P" > "$TMP/ob.log" 2>&1 ||
  { cat "$TMP/ob.log"; fail "configure with find_package"; }
cmake --build "$TMP/ob" > "$TMP/ob-build.log" 2>&1 || { cat "$TMP/ob-build.log"; fail "build with find_package"; }
"$TMP/ob/header_user" | grep -q "specs ok total=17" || fail "header_user"
export PKG_CONFIG_PATH=$P/lib/pkgconfig
LIBDIR=$(pkg-config --variable=libdir lightkeeper)
# shellcheck disable=SC2046
cc -std=c11 -Wall -Wextra -Werror -o "$TMP/tiny_pc" "$SRC/tests/install/trainer.c" \
  $(pkg-config --cflags --libs lightkeeper) -Wl,-rpath,"$LIBDIR" || fail "build with pkg-config"

# 4. Run both against the installed lighthouse and agents: two groups, four outer steps.
"$P/bin/lighthouse" --bind 127.0.0.1:0 --data-dir "$TMP/lh" --min-replicas 2 \
  --join-timeout-ms 20000 > "$TMP/lighthouse.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do grep -q "listening address=" "$TMP/lighthouse.log" && break; sleep 0.1; done
ADDR=$(grep -o 'listening address=[^ ]*' "$TMP/lighthouse.log" | head -1 | cut -d= -f2)
[ -n "$ADDR" ] || { cat "$TMP/lighthouse.log"; fail "the lighthouse did not start"; }
for g in 0 1; do
  "$P/bin/replica_agent" --lighthouse "http://$ADDR" --job oot --group-id "g$g" \
    --socket "$TMP/g$g.sock" --serve 127.0.0.1:0 --heartbeat-interval-ms 200 > "$TMP/agent$g.log" 2>&1 &
  PIDS+=($!)
done
for g in 0 1; do
  for _ in $(seq 200); do grep -q agent_listening "$TMP/agent$g.log" && break; sleep 0.1; done
  grep -q agent_listening "$TMP/agent$g.log" || { cat "$TMP/agent$g.log"; fail "agent g$g did not start"; }
done
LK_AGENT_SOCKET=$TMP/g0.sock timeout 60 "$TMP/ob/tiny_trainer" 0 4 "$TMP/ckpt0" > "$TMP/t0.out" 2> "$TMP/t0.err" &
T0=$!
LK_AGENT_SOCKET=$TMP/g1.sock timeout 60 "$TMP/tiny_pc" 1 4 "$TMP/ckpt1" > "$TMP/t1.out" 2> "$TMP/t1.err" &
T1=$!
wait $T0 || { cat "$TMP/t0.err"; fail "the find_package trainer failed"; }
wait $T1 || { cat "$TMP/t1.err"; fail "the pkg-config trainer failed"; }
cat "$TMP/t0.out" "$TMP/t1.out"
for t in 0 1; do
  grep -q '^done step=4 ' "$TMP/t$t.out" || fail "trainer $t did not reach step 4"
  [ "$(grep -c '^step=' "$TMP/t$t.out")" = 4 ] || fail "trainer $t did not commit 4 steps"
done
# Two groups with different data, one quorum: the same global weights after every commit.
diff <(grep '^step=' "$TMP/t0.out") <(grep '^step=' "$TMP/t1.out") || fail "the groups' weights differ"
grep -q 'world=2' "$TMP/t0.out" || fail "the groups never formed one quorum"
# The durable save at the end holds the inner state under its names.
"$P/bin/lkctl" checkpoint inspect "$TMP/ckpt0" > "$TMP/inspect.txt" 2>&1 || { cat "$TMP/inspect.txt"; fail "lkctl checkpoint inspect"; }
grep -q 'inner/momentum/w' "$TMP/inspect.txt" || { cat "$TMP/inspect.txt"; fail "no inner state in the checkpoint"; }
grep -q 'outer_momentum/b' "$TMP/inspect.txt" || fail "no outer momentum in the checkpoint"
echo "install test passed"
