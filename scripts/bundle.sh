#!/usr/bin/env bash
# Makes the portable bundle: one tarball that runs on any x86_64 Linux (a kernel from RHEL 8 on
# and a POSIX shell), unpacked anywhere, as any user, with nothing installed.
#
#   scripts/bundle.sh BUILD_DIR OUT_DIR
#
# Prints what it does, and as its last line the tarball's path:
#   OUT_DIR/lightkeeper-VERSION-linux-x86_64.tar.gz, one top-level folder lightkeeper-VERSION/:
#     bin/           lighthouse, replica_agent, lk_gateway, lkctl, diloco_trainer:
#                    small sh scripts that start the program below with the bundle's own loader
#     libexec/lightkeeper/   the programs themselves
#     lib/           liblightkeeper.so and every shared library the programs need, found from the
#                    programs themselves (ldd), RPATH $ORIGIN; lib/glibc/ the C library and its
#                    loader, kept apart (see below)
#     include/, lib/cmake/Lightkeeper/, lib/pkgconfig/lightkeeper.pc   as cmake --install leaves them
#     lib/python3/dist-packages/lightkeeper/   the Python package, its module built for this
#                    machine's Python
#     BUNDLE.md      what is inside and how to use it
#
# Why the loader's --library-path and not RPATHs alone: a program finds its C library through the
# loader named in its ELF header (/lib64/ld-linux-x86-64.so.2, the host's), and a C library only
# works with its own loader; a RHEL 8 host has glibc 2.28, older than the one these programs were
# built against. So each bin/ script runs lib/glibc/ld-linux-x86-64.so.2 --library-path
# lib:lib/glibc PROGRAM: the bundle's loader, C library and everything else, nothing of the host
# but its kernel. The C library stays out of lib/ proper: a site's own process that loads
# liblightkeeper.so (a trainer, the Python module) runs on the host's loader and C library, and
# must never be handed the bundle's through an RPATH.
set -euo pipefail

usage() { echo "usage: $0 BUILD_DIR OUT_DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
BUILD=$(cd "$1" && pwd)
mkdir -p "$2"
OUT=$(cd "$2" && pwd)
command -v patchelf > /dev/null || { echo "bundle: patchelf is missing (scripts/install-deps.sh)" >&2; exit 1; }

VERSION=$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$BUILD/CMakeCache.txt")
[ -n "$VERSION" ] || { echo "bundle: no project version in $BUILD/CMakeCache.txt" >&2; exit 1; }
NAME=lightkeeper-$VERSION
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lk-bundle-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/$NAME

echo "bundle: installing $BUILD into $ROOT"
cmake --install "$BUILD" --prefix "$ROOT" > "$WORK/install.log"
mkdir -p "$ROOT/libexec/lightkeeper" "$ROOT/lib/glibc"

# The programs: every binary cmake installed.
PROGRAMS=()
for p in lighthouse replica_agent lkctl diloco_trainer lk_gateway; do
  if [ -x "$ROOT/bin/$p" ]; then
    mv "$ROOT/bin/$p" "$ROOT/libexec/lightkeeper/$p"
  elif [ -x "$BUILD/bin/$p" ]; then
    cp "$BUILD/bin/$p" "$ROOT/libexec/lightkeeper/$p"
  else
    continue
  fi
  PROGRAMS+=("$p")
done
for p in lighthouse replica_agent lk_gateway lkctl; do
  [ -x "$ROOT/libexec/lightkeeper/$p" ] || { echo "bundle: $p is not built in $BUILD" >&2; exit 1; }
done

# The C library's own files: they go to lib/glibc/ and are used only through the bundle's loader.
is_glibc() {
  case "$1" in
    ld-linux-x86-64.so.*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|\
    libutil.so.*|libanl.so.*|libnss_*.so.*|libmvec.so.*|libBrokenLocale.so.*|libcrypt.so.*) return 0 ;;
  esac
  return 1
}

# Every shared library the ELF files need, from ldd (which follows the whole closure). A library
# ldd cannot find is an error: the bundle would not run.
copy_deps() {
  local elf=$1 line lib path
  if ! ldd "$elf" > "$WORK/ldd.out" 2>&1; then
    grep -q 'not a dynamic executable' "$WORK/ldd.out" && return 0
    cat "$WORK/ldd.out" >&2
    return 1
  fi
  if grep -q 'not found' "$WORK/ldd.out"; then
    echo "bundle: $elf needs a library this machine lacks:" >&2
    grep 'not found' "$WORK/ldd.out" >&2
    return 1
  fi
  while read -r line; do
    case "$line" in
      *'=>'*'('*) path=${line#*=> }; path=${path%% (*} ;;
      /*'('*) path=${line%% (*} ;;
      *) continue ;;
    esac
    [ -e "$path" ] || continue
    lib=${path##*/}
    case "$lib" in liblightkeeper.so*) continue ;; esac
    if is_glibc "$lib"; then
      [ -e "$ROOT/lib/glibc/$lib" ] || cp -L "$path" "$ROOT/lib/glibc/$lib"
    else
      [ -e "$ROOT/lib/$lib" ] || cp -L "$path" "$ROOT/lib/$lib"
    fi
  done < "$WORK/ldd.out"
}

echo "bundle: collecting the shared libraries the programs need"
ELFS=()
for p in "${PROGRAMS[@]}"; do ELFS+=("$ROOT/libexec/lightkeeper/$p"); done
ELFS+=("$ROOT"/lib/liblightkeeper.so.*.*.*)
while IFS= read -r m; do ELFS+=("$m"); done < <(find "$ROOT/lib/python3" -name '*.so' 2>/dev/null)
for e in "${ELFS[@]}"; do copy_deps "$e"; done
# The loader itself under its canonical name (ldd reports it by its absolute path).
[ -e "$ROOT/lib/glibc/ld-linux-x86-64.so.2" ] || cp -L /lib64/ld-linux-x86-64.so.2 "$ROOT/lib/glibc/"
# NSS modules the C library loads by name at run time (user and host lookups), never seen by ldd.
for lib in libnss_files.so.2 libnss_dns.so.2; do
  for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/$lib" ] && [ ! -e "$ROOT/lib/glibc/$lib" ]; then cp -L "$d/$lib" "$ROOT/lib/glibc/"; fi
  done
done

# Libraries find each other in lib/ (a site's own process that loads liblightkeeper.so then gets
# the bundle's libstdc++, protobuf, ... but never its C library); the programs keep no RPATH of
# the build machine.
for f in "$ROOT"/lib/*.so*; do
  [ -L "$f" ] && continue
  chmod u+w "$f"
  patchelf --set-rpath '$ORIGIN' "$f"
done
for f in "$ROOT"/libexec/lightkeeper/*; do
  chmod u+w "$f"
  patchelf --set-rpath '$ORIGIN/../../lib' "$f"
done
while IFS= read -r m; do patchelf --set-rpath '$ORIGIN/../../..' "$m"; done \
  < <(find "$ROOT/lib/python3" -name '*.so' 2>/dev/null)

# bin/: one script per program, POSIX sh only (no dirname, no readlink -f: a site's minimal shell
# has neither for certain).
for p in "${PROGRAMS[@]}"; do
  cat > "$ROOT/bin/$p" <<EOF
#!/bin/sh
# Runs $p from this bundle with the bundle's own loader and libraries (BUNDLE.md).
case "\$0" in
  */*) here=\${0%/*} ;;
  *) here=\$(command -v "\$0"); here=\${here%/*} ;;
esac
top=\$(cd "\$here/.." && pwd -P) || exit 127
exec "\$top/lib/glibc/ld-linux-x86-64.so.2" --library-path "\$top/lib:\$top/lib/glibc" \\
  --argv0 "\$0" "\$top/libexec/lightkeeper/$p" "\$@"
EOF
  chmod 755 "$ROOT/bin/$p"
done

# (No `| head` under pipefail: the writer may die of SIGPIPE and fail the pipeline by chance.)
GLIBC=$(ldd --version 2>&1 | sed -n '1s/.* \([0-9][0-9.]*\)$/\1/p')
# The oldest host C library that a process loading lib/liblightkeeper.so (and what it needs from
# lib/) can run on: the newest GLIBC_ symbol version any of them asks for.
GLIBC_NEED=$(for f in "$ROOT"/lib/*.so*; do [ -L "$f" ] || objdump -T "$f" 2>/dev/null; done |
  grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
PYMOD=$(find "$ROOT/lib/python3" -name '_native*.so' 2>/dev/null | sed -n 1p)
PYVER=$(basename "${PYMOD:-none}" | sed -n 's/.*cpython-\([0-9]\)\([0-9]*\)-.*/\1.\2/p')
cat > "$ROOT/BUNDLE.md" <<EOF
# Lightkeeper $VERSION, portable bundle (linux-x86_64)

Unpack anywhere and run \`bin/lighthouse\`, \`bin/replica_agent\`, \`bin/lk_gateway\`,
\`bin/lkctl\`, \`bin/diloco_trainer\`: nothing needs to be installed, as any user, on any x86_64 Linux with a
kernel from RHEL 8 on. Each \`bin/\` entry is a POSIX sh script that starts the program in
\`libexec/lightkeeper/\` with the bundle's own loader, C library (glibc $GLIBC, in \`lib/glibc/\`)
and libraries (\`lib/\`); nothing of the host is used but its kernel.

Building against it (a trainer in C or C++): \`-DCMAKE_PREFIX_PATH=BUNDLE\` then
\`find_package(Lightkeeper)\`, or \`PKG_CONFIG_PATH=BUNDLE/lib/pkgconfig pkg-config --cflags --libs
lightkeeper\`. Such a program loads \`lib/liblightkeeper.so\` on the host's own C library, which
must be glibc $GLIBC_NEED or newer (RHEL/Rocky 9: 2.34; RHEL 8: 2.28 is too old: run the bundle's
programs there, which need nothing of the host, and build trainers from source).

The Python package: \`lib/python3/dist-packages/lightkeeper\` is built for Python ${PYVER:-?} on
glibc $GLIBC (\`PYTHONPATH=BUNDLE/lib/python3/dist-packages\`). For a site's own Python and torch,
build the compiled module against the bundle (it links no torch; pybind11 from the site's
Python, e.g. \`pip install --user pybind11\` on a login node):

    cmake -S BUNDLE/share/lightkeeper/python-site -B build-py -DCMAKE_PREFIX_PATH=BUNDLE \\
          -DPython3_EXECUTABLE=\$(command -v python3)
    cmake --build build-py && cmake --install build-py --prefix DIR
    PYTHONPATH=DIR python3 -c 'import lightkeeper'
EOF
echo "bundle: packing"
TARBALL=$OUT/$NAME-linux-x86_64.tar.gz
tar -C "$WORK" -cf - "$NAME" | gzip -"${LK_BUNDLE_GZIP_LEVEL:-6}" > "$TARBALL.part"
mv "$TARBALL.part" "$TARBALL"
echo "bundle: $(du -sh "$ROOT" | cut -f1) unpacked, $(du -sh "$TARBALL" | cut -f1) packed"
echo "$TARBALL"
