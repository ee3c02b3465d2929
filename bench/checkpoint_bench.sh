#!/usr/bin/env bash
# Checkpoint throughput next to its yardsticks, in one run on one machine:
#   save / restore of a 2 GiB state  vs  fio sequential write (with fsync) / read, same directory
#   peer recovery from 1, 2, 3 sources vs iperf3 on loopback (one stream, run before and after)
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
# fio reads before and after ours (the mean is the yardstick): this virtual disk's read speed
# swings by 2x from one minute to the next.
fio_read() {
  fio --name=fio --directory="$DIR" --filename=fio.0.0 --rw=read --bs=16M --size="$BYTES" \
      --ioengine=psync --invalidate=1 --output-format=json >"$OUT/$1"
}
fio_read fio-read.json

# iperf3 right before and right after ours; the yardstick is their mean, so a load that comes or
# goes during the run weighs on both sides alike.
iperf() {
  iperf3 -s -1 -p "$PORT" >/dev/null 2>&1 &
  sleep 0.5
  iperf3 -c 127.0.0.1 -p "$PORT" -t 5 -J >"$OUT/$1"
  wait
}
iperf iperf-before.json
"$BUILD/bin/checkpoint_bench" --dir "$DIR" --bytes "$BYTES" | tee "$OUT/ours.txt"
fio_read fio-read-after.json
rm -f "$DIR/fio.0.0"
iperf iperf-after.json

python3 - "$OUT" "$BYTES" <<'PY'
import json, sys
out, size = sys.argv[1], int(sys.argv[2])
def fio_rate(name, kind):
    job = json.load(open(f"{out}/{name}"))["jobs"][0]
    return size / (job["job_runtime"] / 1000.0)  # runtime includes the final fsync
ours = dict(l.strip().split("=", 1) for l in open(f"{out}/ours.txt") if "=" in l and not l.startswith("effective"))
w = fio_rate("fio-write.json", "write")
reads = [fio_rate(n, "read") for n in ("fio-read.json", "fio-read-after.json")]
r = sum(reads) / 2
print(f"fio read before {reads[0]/1e9:.2f} GB/s, after {reads[1]/1e9:.2f} GB/s")
ipends = [json.load(open(f"{out}/{n}"))["end"] for n in ("iperf-before.json", "iperf-after.json")]
ips = [e["sum_received"]["bits_per_second"] / 8 for e in ipends]
ip = sum(ips) / len(ips)
print(f"iperf3 before {ips[0]/1e9:.2f} GB/s, after {ips[1]/1e9:.2f} GB/s")
# iperf3's CPU (sender + receiver, % of one core over the run) per GB moved, to set against
# ours: CPU per byte depends less on what else the machine runs than bytes per second do.
def cpu_per_gb(e):
    c, r = e["cpu_utilization_percent"], e["sum_received"]
    return (c["host_total"] + c["remote_total"]) / 100 * r["seconds"] / (r["bytes"] / 1e9)
ip_cpu = sum(cpu_per_gb(e) for e in ipends) / len(ipends)
G = 1e9
rows = [("save (write+fsync+commit)", float(ours["save_bytes_per_s"]), "fio write+fsync", w),
        ("restore (pread, cold cache), into fresh memory", float(ours["restore_fresh_bytes_per_s"]), "fio read", r),
        ("restore (pread, cold cache), into the model's tensors", float(ours["restore_bytes_per_s"]), "fio read", r)]
peer_rows = [("peer recovery, 1 source, first in the process (fresh memory)", "peer_cold", "local_copy_fresh"),
             ("peer recovery, 1 source, into fresh memory", "peer1_fresh", "local_copy_fresh")]
peer_rows += [(f"peer recovery, {n} source(s), into the model's tensors", f"peer{n}", "local_copy") for n in (1, 2, 3)]
for name, key, _ in peer_rows:
    rows.append((name, float(ours[f"{key}_bytes_per_s"]), "iperf3 loopback", ip))
print(f"\n| figure | ours GB/s | yardstick | GB/s | ratio |\n|---|---|---|---|---|")
for name, v, yname, y in rows:
    print(f"| {name} | {v/G:.2f} | {yname} | {y/G:.2f} | {v/y:.2f}x |")
print(f"\n| CPU s per GB | ours | iperf3 | local copy floor (pread from /dev/shm + XXH3, same destination) |\n|---|---|---|---|")
for name, key, floor in peer_rows:
    print(f"| {name} | {float(ours[f'{key}_cpu_s_per_gb']):.2f} | {ip_cpu:.2f} | {float(ours[f'{floor}_cpu_s_per_gb']):.2f} |")
print(f"\nfilling fresh memory in this process: {float(ours['memory_first_touch_bytes_per_s'])/G:.2f} GB/s the first time, "
      f"{float(ours['memory_second_touch_bytes_per_s'])/G:.2f} GB/s once freed and taken again")
print(f"local copy floor on one thread: {float(ours['local_copy_fresh_bytes_per_s'])/G:.2f} GB/s into fresh memory, "
      f"{float(ours['local_copy_bytes_per_s'])/G:.2f} GB/s into touched memory")
PY
