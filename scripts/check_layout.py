#!/usr/bin/env python3
"""The layout is the stack: checks every #include "..." of the project's own code against it.

A folder includes only itself, the folders below it and the public headers (<lightkeeper/...>,
include/lightkeeper/). Tests (*_test.cc and the test folders) may also include tests/support/.
Nothing outside replica_agent/ includes replica_agent/, except the agent's own tests and the
fuzz targets that drive it. Prints each violation as FILE:LINE: and exits 1 if there is one.
Usage: check_layout.py [SOURCE_DIR]
"""
import os
import re
import sys

# The trainer's stack from the bottom up; each folder may include every folder listed before it.
STACK = ["common", "checkpoint", "slurm", "comm", "client", "diloco", "capi"]
# Beside the stack: what each daemon or tool may include besides itself.
BESIDE = {
    "lighthouse": ["common", "checkpoint", "slurm"],
    "replica_agent": ["common", "checkpoint", "slurm"],
    # The gateway sums and encodes the outer exchange with comm/'s pure codec (compress.h,
    # reduce.h); it links lk_comm_codec only, never Gloo or the trainer's communicator.
    "gateway": ["common", "comm"],
    "lkctl": ["common", "checkpoint", "slurm"],
    "python": STACK,
    "examples": STACK + ["examples"],
}
# Folders of tests and tools: they may include anything of the project.
ANYTHING = {"tests", "bench", "fuzz"}
EXTENSIONS = (".cc", ".h", ".c", ".cpp")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def top(path):
    return path.split("/", 1)[0]


def allowed(src_top, inc_top, is_test):
    if inc_top == src_top or src_top in ANYTHING:
        return True
    if is_test and inc_top == "tests":
        return True
    if is_test and src_top in BESIDE and inc_top in STACK:
        return True  # a daemon's test may drive both ends (the poll board's writer and reader)
    if src_top in STACK:
        return inc_top in STACK[: STACK.index(src_top)]
    if src_top in BESIDE:
        return inc_top in BESIDE[src_top]
    if src_top == "include":
        return False  # public headers include only each other, as <lightkeeper/...>
    return True  # a folder this check does not know: not part of the stack


def self_test():
    """The check finds an include upward and one of the agent from elsewhere, and passes a clean tree."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        def write(rel, text):
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                f.write(text)
        write("common/a.h", "#pragma once\n")
        write("comm/b.h", '#include "common/a.h"\n')
        write("replica_agent/agent.h", '#include "comm/b.h"\n')
        if run(d, quiet=True) != 1:
            return "a daemon including comm/ was not caught"
        write("replica_agent/agent.h", '#include "common/a.h"\n')
        if run(d, quiet=True) != 0:
            return "a clean tree was refused"
        write("common/c.h", '#include "comm/b.h"\n')
        if run(d, quiet=True) != 1:
            return "common/ including comm/ was not caught"
        os.remove(os.path.join(d, "common/c.h"))
        write("diloco/d.cc", '#include "replica_agent/agent.h"\n')
        if run(d, quiet=True) != 1:
            return "diloco/ including replica_agent/ was not caught"
    return None


def main():
    if sys.argv[1:] == ["--self-test"]:
        err = self_test()
        print("check_layout self-test: " + (err or "ok"))
        return 1 if err else 0
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    return run(root)


def run(root, quiet=False):
    known = {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))}
    bad = []
    checked = 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not d.startswith("build")]
        if rel_dir == ".":
            continue
        for name in filenames:
            if not name.endswith(EXTENSIONS):
                continue
            rel = os.path.join(rel_dir, name)
            src_top = top(rel)
            is_test = name.endswith(("_test.cc", "_test_peer.cc")) or "/test_support" in rel or "/testdata/" in rel
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    inc_top = top(inc)
                    if inc_top not in known or "/" not in inc:
                        continue  # generated (gen/), a system header in quotes, or a sibling
                    checked += 1
                    if not allowed(src_top, inc_top, is_test):
                        bad.append(f"{rel}:{lineno}: {src_top}/ includes {inc} ({inc_top}/ is not below it)")
                    elif inc_top == "replica_agent" and src_top not in ("replica_agent", "tests", "fuzz", "bench"):
                        bad.append(f"{rel}:{lineno}: only the agent and its tests include replica_agent/")
    if not quiet:
        for b in bad:
            print(b)
        print(f"check_layout: {checked} includes checked, {len(bad)} outside the stack")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
