#!/usr/bin/env bash
# Checkpoint throughput next to its yardsticks, in one run on one machine:
#   save / restore of a 2 GiB state  vs  fio sequential write (with fsync) / read, same directory
#   peer recovery from 1, 2, 3 sources vs iperf3 on loopback (one stream)
# usage: bench/checkpoint_bench.sh [BUILD_DIR] [DISK_DIR]      (LK_BENCH_BYTES overrides 2 GiB)
set -euo pipefail
BUILD=${1:-build}
DIR=${2:-/tmp/lk-ckpt-bench}
BYTES=${LK_BENCH_BYTES:-2147483648}
PORT=${LK_BENCH_IPERF_PORT:-5299}
mkdir -p "$DIR"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT" "$DIR/fio.0.0"' EXIT

fio --name=fio --directory="$DIR" --filename=fio.0.0 --rw=write --bs=16M --size="$BYTES" \
    --ioengine=psync --end_fsync=1 --output-format=json >"$OUT/fio-write.json"
fio --name=fio --directory="$DIR" --filename=fio.0.0 --rw=read --bs=16M --size="$BYTES" \
    --ioengine=psync --invalidate=1 --output-format=json >"$OUT/fio-read.json"
rm -f "$DIR/fio.0.0"

"$BUILD/bin/checkpoint_bench" --dir "$DIR" --bytes "$BYTES" | tee "$OUT/ours.txt"

iperf3 -s -1 -p "$PORT" >/dev/null 2>&1 &
sleep 0.5
iperf3 -c 127.0.0.1 -p "$PORT" -t 5 -J >"$OUT/iperf.json"
wait

python3 - "$OUT" "$BYTES" <<'PY'
import json, sys
out, size = sys.argv[1], int(sys.argv[2])
def fio_rate(name, kind):
    job = json.load(open(f"{out}/{name}"))["jobs"][0]
    return size / (job["job_runtime"] / 1000.0)  # runtime includes the final fsync
ours = dict(l.strip().split("=", 1) for l in open(f"{out}/ours.txt") if "=" in l and not l.startswith("effective"))
w, r = fio_rate("fio-write.json", "write"), fio_rate("fio-read.json", "read")
ip = json.load(open(f"{out}/iperf.json"))["end"]["sum_received"]["bits_per_second"] / 8
G = 1e9
rows = [("save (write+fsync+commit)", float(ours["save_bytes_per_s"]), "fio write+fsync", w),
        ("restore (pread, cold cache)", float(ours["restore_bytes_per_s"]), "fio read", r)]
for n in (1, 2, 3):
    rows.append((f"peer recovery, {n} source(s)", float(ours[f"peer{n}_bytes_per_s"]), "iperf3 loopback", ip))
print(f"\n| figure | ours GB/s | yardstick | GB/s | ratio |\n|---|---|---|---|---|")
for name, v, yname, y in rows:
    print(f"| {name} | {v/G:.2f} | {yname} | {y/G:.2f} | {v/y:.2f}x |")
PY
