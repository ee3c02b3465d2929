#!/usr/bin/env bash
# A real one-node Slurm (munged + slurmctld + slurmd) on localhost for tests and local trials.
#
#   scripts/slurm-local.sh up       start what is not running yet (idempotent), print SLURM_CONF
#   scripts/slurm-local.sh down     cancel every job and stop the daemons (idempotent)
#   scripts/slurm-local.sh status   exit 0 when sinfo answers
#
# All state lives under $SLURM_BASE (default /tmp/lk-slurm). Every client command (sbatch, srun,
# squeue, scontrol, scancel, sinfo) needs `export SLURM_CONF=$SLURM_BASE/slurm.conf`; `up` prints
# that line last so `eval "$(scripts/slurm-local.sh up | tail -1)"` works.
#
# Runs as root, with no systemd and no cgroups (Debian 12, Slurm 22.05). Partitions:
#   debug  default, never preempted
#   low    PriorityTier=1, preempted by `high` with REQUEUE after GraceTime=10 s
#   high   PriorityTier=10, never preempted
# preempt_send_user_signal makes Slurm send a job's --signal warning at preemption too.
#
# SLURM_LOCAL_NODES=2 makes a cluster of two nodes, n1 (127.0.0.1) and n2 (127.0.0.2), each with
# its own slurmd on this host, for jobs that span nodes; give it its own SLURM_BASE and
# SLURM_LOCAL_PORT (slurmctld's port; the slurmds take the next ones; default 6817) so that it
# runs beside the one-node cluster.
set -euo pipefail

BASE=${SLURM_BASE:-/tmp/lk-slurm}
CONF="$BASE/slurm.conf"
export SLURM_CONF="$CONF"
NODES=${SLURM_LOCAL_NODES:-1}
PORT=${SLURM_LOCAL_PORT:-6817}
case "$NODES" in 1|2) ;; *) echo "slurm-local: SLURM_LOCAL_NODES must be 1 or 2" >&2; exit 2 ;; esac
node_names() { if [ "$NODES" = 1 ]; then echo localhost; else echo n1 n2; fi; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The nodes' states, the distinct ones separated by spaces ("idle", "alloc idle").
node_state() {
  local s
  s=$(timeout 5 sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
  echo "${s% }"
}
# Whether every node takes jobs.
usable() {
  [ -n "$1" ] || return 1
  local w
  for w in $1; do case "$w" in idle|mix|alloc) ;; *) return 1 ;; esac; done
}
slurmd_pid() { if [ "$NODES" = 1 ]; then echo "$BASE/slurmd.pid"; else echo "$BASE/slurmd-$1.pid"; fi; }

write_conf() {
  local cpus=${SLURM_CPUS:-$(nproc)}
  local tmp="$CONF.tmp.$$" node_lines spool_suffix= node_suffix=
  if [ "$NODES" = 1 ]; then
    node_lines="NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN"
  else
    # Two slurmds on this host: each its own address, port, spool and pid file (%n: its name).
    spool_suffix=/%n node_suffix=-%n
    node_lines="NodeName=n1 NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.2 Port=$((PORT + 2)) CPUs=$cpus State=UNKNOWN"
  fi
  cat > "$tmp" <<CONF
ClusterName=lk
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$BASE/munge/munge.socket.2,cred_expire=${SLURM_CRED_EXPIRE:-10}
CredType=cred/munge
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool$spool_suffix
SlurmctldPidFile=$BASE/slurmctld.pid
SlurmdPidFile=$BASE/slurmd$node_suffix.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd$node_suffix.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
ReturnToService=2
JobRequeue=1
MailProg=/bin/true
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
$node_lines
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=low Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=10
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF
  mv "$tmp" "$CONF"
}

up() {
  local t0 st
  t0=$(date +%s%N)
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] ||
      { echo "slurm-local: $tool not found; run scripts/install-deps.sh" >&2; exit 1; }
  done
  mkdir -p "$BASE"/{munge,state,spool,log}
  chmod 755 "$BASE"
  if ! alive "$BASE/munge/munged.pid"; then
    [ -s "$BASE/munge/munge.key" ] ||
      dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none
    chown -R munge:munge "$BASE/munge"
    chmod 600 "$BASE/munge/munge.key"
    chmod 711 "$BASE/munge"  # munged refuses group/world-writable dirs; clients need the socket
    rm -f "$BASE/munge/munge.socket.2"*
    runuser -u munge -- /usr/sbin/munged \
      --socket="$BASE/munge/munge.socket.2" --key-file="$BASE/munge/munge.key" \
      --pid-file="$BASE/munge/munged.pid" --log-file="$BASE/munge/munged.log" \
      --seed-file="$BASE/munge/munged.seed" </dev/null >/dev/null 2>&1
  fi
  # The config is rewritten only while slurmctld is down, so a running cluster never sees a
  # config that differs from the one it started with.
  if ! alive "$BASE/slurmctld.pid"; then
    write_conf
    slurmctld -f "$CONF" -c </dev/null >/dev/null 2>&1  # daemonizes; -c: drop old job state
  fi
  local n
  for n in $(node_names); do
    alive "$(slurmd_pid "$n")" && continue
    [ "$NODES" = 1 ] || mkdir -p "$BASE/spool/$n"
    # -N: the hostname of these machines is not 'localhost'.
    slurmd -f "$CONF" -N "$n" </dev/null >/dev/null 2>&1
  done
  for _ in $(seq 1 120); do
    st=$(node_state)
    usable "$st" && break
    # A drain or down state left behind (a full disk, a slurmd killed mid-job) belongs to a past
    # run of this private cluster: resume the node instead of failing every test after it.
    case "$st" in
      *drain*|*drng*|*down*)
        for n in $(node_names); do
          timeout 5 scontrol update nodename="$n" state=resume 2>/dev/null || true
        done ;;
    esac
    sleep 0.25
  done
  echo "slurm-local: node state=${st:-none} after $(( ($(date +%s%N) - t0) / 1000000 )) ms" >&2
  usable "$st" || { echo "slurm-local: node did not become idle; see $BASE/log/" >&2; exit 1; }
  echo "export SLURM_CONF=$CONF"
}

down() {
  if alive "$BASE/slurmctld.pid"; then
    timeout 10 scancel --state=PENDING,RUNNING,SUSPENDED 2>/dev/null || true
  fi
  local pf pid
  for pf in "$BASE"/slurmd*.pid "$BASE/slurmctld.pid" "$BASE/munge/munged.pid"; do
    alive "$pf" || continue
    pid=$(cat "$pf")
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    rm -f "$pf"
  done
  echo "slurm-local: down" >&2
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) [ -n "$(node_state)" ] ;;
  *) echo "usage: $0 up|down|status   (state under \$SLURM_BASE, default /tmp/lk-slurm)" >&2; exit 2 ;;
esac
