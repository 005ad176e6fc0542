#!/usr/bin/env bash
# A one-node Slurm cluster on this host, for tests and for trying scripts/slurm/train.sbatch.
#
#   scripts/slurm/local-cluster.sh start    install slurm-wlm + munge if missing (apt), write the
#                                           config for this host, start munged, slurmctld, slurmd,
#                                           wait until the node is idle
#   NODES=2 scripts/slurm/local-cluster.sh start
#                                           the same with two nodes, <host>-1 and <host>-2: one
#                                           slurmd per node on this host (`slurmd -N`), each on
#                                           its own port, with a share of the CPUs and memory;
#                                           for train-multinode.sbatch
#   scripts/slurm/local-cluster.sh stop     stop the daemons this script started (pid files)
#   scripts/slurm/local-cluster.sh status   which daemons run, and sinfo
#
# Idempotent: `start` on a running cluster only waits for the node; `stop` on a stopped one does
# nothing; a `start` with another NODES than the running cluster's restarts slurmctld and slurmd.
# Needs root. It writes /etc/slurm/slurm.conf only when that file is absent or was written by
# this script (it carries the marker line below), so a real cluster's config is never
# overwritten.
#
# Exit codes: 0 done; 2 usage; 3 this machine cannot run the cluster (not root, no apt-get to
# install Slurm, the install failed, a daemon would not start): the reason is on stderr, and the
# test suite skips on it.
set -euo pipefail

MARKER="# written by rtrain scripts/slurm/local-cluster.sh"
CONF=/etc/slurm/slurm.conf
KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
LOG_DIR=/var/log/slurm
READY_TIMEOUT_S=${READY_TIMEOUT_S:-60}
NODES=${NODES:-1}
case "$NODES" in ''|*[!0-9]*|0) echo "NODES=$NODES: give a number of nodes, 1 or more" >&2; exit 2 ;; esac
NODE_PORT_BASE=6830  # node i's slurmd listens on NODE_PORT_BASE + i (several nodes only)

say() { echo "local-cluster: $*" >&2; }
cannot() { say "cannot start: $*"; exit 3; }

running() {  # running PIDFILE: the pid in it is alive
  [ -s "$1" ] && alive "$(cat "$1")"
}

# A daemon that exited is a zombie until its parent reaps it, and kill -0 still finds it. Its
# parent is init, or a subreaper above us that may never reap it (pytest is one once rtrain ran
# in-process): `stop` would wait its 10 s for each daemon that had long exited.
alive() {  # alive PID: the process exists and has not exited
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }  # the state follows the command name, which may hold spaces
  [ "${stat%% *}" != Z ]
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v munged >/dev/null && command -v sbatch >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get to install it"
  say "installing slurm-wlm and munge (apt-get)"
  local log; log=$(mktemp)
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$log" 2>&1 \
         || { apt-get update -q >>"$log" 2>&1 \
              && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >>"$log" 2>&1; }; }; then
    tail -n 5 "$log" >&2
    rm -f "$log"
    cannot "apt-get install slurm-wlm munge failed"
  fi
  rm -f "$log"
}

node_names() {  # the cluster's node names, one a line
  local host i
  host=$(hostname -s)
  if [ "$NODES" = 1 ]; then echo "$host"; return; fi
  for i in $(seq "$NODES"); do echo "$host-$i"; done
}

slurmd_pidfile() {  # slurmd_pidfile NODE
  if [ "$NODES" = 1 ]; then echo "$SLURMD_PID"; else echo "/run/slurmd-$1.pid"; fi
}

write_config() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  # Addresses are given as 127.0.0.1 so that nothing depends on this host name resolving.
  # Leave 10% (at least 512 MiB) to the system: slurmd refuses a node that has less memory than
  # RealMemory says.
  mem=$(awk '/^MemTotal:/ {m = int($2 / 1024); r = int(m / 10); if (r < 512) r = 512;
                           print (m - r > 256 ? m - r : 256)}' /proc/meminfo)
  if [ -e "$CONF" ] && ! grep -qxF "$MARKER" "$CONF"; then
    cannot "$CONF exists and was not written by this script; not overwriting a real cluster's config"
  fi
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
  local tmp="$CONF.tmp.$$" nodes spool=/var/spool/slurmd pidfile=$SLURMD_PID
  local slurmd_log=$LOG_DIR/slurmd.log
  if [ "$NODES" = 1 ]; then
    nodes="NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN"
  else
    # Several slurmd on one host: each its own port, spool dir, pid file and log (%n: the node).
    spool=/var/spool/slurmd/%n pidfile=/run/slurmd-%n.pid slurmd_log=$LOG_DIR/slurmd-%n.log
    cpus=$(( cpus / NODES > 0 ? cpus / NODES : 1 ))
    mem=$(( mem / NODES ))
    nodes=$(for i in $(seq "$NODES"); do
      echo "NodeName=$host-$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((NODE_PORT_BASE + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    done)
  fi
  cat >"$tmp" <<CONF
$MARKER
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=$spool
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$pidfile
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$slurmd_log
ReturnToService=2
JobRequeue=1
MpiDefault=none
$nodes
PartitionName=debug Nodes=$(node_names | paste -sd, -) Default=YES MaxTime=INFINITE State=UP
CONF
  if [ -e "$CONF" ] && ! cmp -s "$tmp" "$CONF" && running "$CTLD_PID"; then
    say "the node set changed: restarting slurmctld and slurmd"
    stop_slurmds
    stop_pidfile slurmctld "$CTLD_PID"
  fi
  mv "$tmp" "$CONF"
}

start_munge() {
  if running "$MUNGE_PID"; then return; fi
  if [ ! -s "$KEY" ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
  fi
  chown munge:munge "$KEY" /etc/munge
  chmod 400 "$KEY"
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  # As the munge user, as its Debian service does; --force: stale sockets of a killed munged.
  if command -v runuser >/dev/null; then
    runuser -u munge -- munged --force || cannot "munged would not start"
  else
    munged --force || cannot "munged would not start"
  fi
}

start_daemon() {  # start_daemon NAME PIDFILE LOG
  local name=$1 pidfile=$2 log=$3
  if running "$pidfile"; then return; fi
  "$name" || { tail -n 5 "$log" >&2 2>/dev/null || true; cannot "$name would not start"; }
}

start_slurmds() {
  local node pidfile
  if [ "$NODES" = 1 ]; then
    start_daemon slurmd "$SLURMD_PID" "$LOG_DIR/slurmd.log"
    return
  fi
  for node in $(node_names); do
    pidfile=$(slurmd_pidfile "$node")
    running "$pidfile" && continue
    mkdir -p "/var/spool/slurmd/$node"
    slurmd -N "$node" || { tail -n 5 "$LOG_DIR/slurmd-$node.log" >&2 2>/dev/null || true
                            cannot "slurmd -N $node would not start"; }
  done
}

stop_slurmds() {  # every slurmd this script may have started, one node or several
  local pidfile
  for pidfile in "$SLURMD_PID" /run/slurmd-*.pid; do
    [ -e "$pidfile" ] && stop_pidfile "slurmd ($(basename "$pidfile" .pid))" "$pidfile"
  done
  return 0
}

wait_idle() {
  local host
  for host in $(node_names); do wait_node_idle "$host"; done
}

wait_node_idle() {  # wait_node_idle NODE
  local host=$1 deadline state
  deadline=$((SECONDS + READY_TIMEOUT_S))
  while :; do
    state=$(sinfo -h -n "$host" -o %t 2>/dev/null | head -n 1 || true)
    case "$state" in
      idle|mix|alloc|comp) say "node $host is $state"; return ;;
      down*|drain*|drng*|fail*)
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 5 "$LOG_DIR"/slurmd*.log "$LOG_DIR/slurmctld.log" >&2 2>/dev/null || true
      cannot "node $host not idle after ${READY_TIMEOUT_S} s (state: ${state:-none})"
    fi
    sleep 0.5
  done
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE: SIGTERM, wait up to 10 s, then SIGKILL
  local name=$1 pidfile=$2 pid i
  running "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 100); do
    alive "$pid" || { say "stopped $name"; rm -f "$pidfile"; return 0; }
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  say "killed $name (pid $pid) after 10 s"
  rm -f "$pidfile"
}

case "${1:-}" in
  start)
    [ "$(id -u)" = 0 ] || cannot "needs root (to install Slurm and run its daemons as root)"
    install_packages
    write_config
    start_munge
    start_daemon slurmctld "$CTLD_PID" "$LOG_DIR/slurmctld.log"
    start_slurmds
    wait_idle
    ;;
  stop)
    stop_slurmds
    stop_pidfile slurmctld "$CTLD_PID"
    stop_pidfile munged "$MUNGE_PID"
    ;;
  status)
    for d in "munged:$MUNGE_PID" "slurmctld:$CTLD_PID" "slurmd:$SLURMD_PID"; do
      if running "${d#*:}"; then echo "${d%%:*}: running (pid $(cat "${d#*:}"))"
      else echo "${d%%:*}: stopped"; fi
    done
    for f in /run/slurmd-*.pid; do  # the nodes of a NODES=N cluster
      [ -e "$f" ] || continue
      node=${f#/run/slurmd-}
      if running "$f"; then echo "slurmd -N ${node%.pid}: running (pid $(cat "$f"))"
      else echo "slurmd -N ${node%.pid}: stopped"; fi
    done
    if running "$CTLD_PID"; then sinfo; fi
    ;;
  *)
    echo "usage: [NODES=N] $0 start|stop|status" >&2
    exit 2
    ;;
esac
