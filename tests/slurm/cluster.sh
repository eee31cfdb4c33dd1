#!/usr/bin/env bash
# Private single-node Slurm cluster whose every file lives under DIR.
#
#   cluster.sh start DIR   start munged + slurmctld + slurmd for DIR, wait until
#                          the node is idle, print one line on stdout:
#                              export SLURM_CONF=DIR/slurm.conf
#                          (eval it, or set SLURM_CONF yourself; exit 0 = ready)
#   cluster.sh stop DIR    cancel its jobs, stop the daemons started for DIR (by
#                          their pid files under DIR); touches nothing else.
#
# Nothing is written to /etc, /var or /run and no system Slurm/munge config is
# read (only /etc/passwd, /etc/group as usual): the config, spool,
# state, logs, pid files, munge key and munge socket are all under DIR, and the
# TCP ports are picked free at start, so several clusters (and a system-wide
# one) can run side by side. Needs root and the Debian packages
# slurmctld slurmd slurm-client munge (Slurm 22.05). Env knobs:
#   SLURM_PRIVATE_CPUS (default 4)  CPUs the node advertises
#   SLURM_PRIVATE_TIMEOUT (default 30) seconds to wait for an idle node
set -euo pipefail

die() { echo "cluster.sh: $*" >&2; exit 1; }

usage() { die "usage: cluster.sh start|stop DIR"; }

[ $# -eq 2 ] || usage
CMD=$1
if [ "$CMD" = stop ] && [ ! -d "$2" ]; then exit 0; fi
mkdir -p -- "$2" 2>/dev/null || die "cannot create $2"
DIR=$(cd -- "$2" && pwd -P)

CONF=$DIR/slurm.conf
MUNGE_DIR=$DIR/munge
SOCK=$MUNGE_DIR/munge.socket
RUN=$DIR/run
LOGS=$DIR/log
CTLD_PID=$RUN/slurmctld.pid
SLURMD_PID=$RUN/slurmd.pid
MUNGED_PID=$RUN/munged.pid
NODE=localhost

# pid from PIDFILE if that process is alive and its command name is NAME
live_pid() {
    local f=$1 name=$2 p comm
    [ -s "$f" ] || return 1
    p=$(tr -dc 0-9 <"$f")
    [ -n "$p" ] && [ -r "/proc/$p/comm" ] || return 1
    comm=$(cat "/proc/$p/comm" 2>/dev/null) || return 1
    [ "$comm" = "$name" ] || return 1
    echo "$p"
}

# SIGTERM the daemons named by "PIDFILE:NAME" args together (each takes ~2 s to
# exit), wait up to ~10 s, then SIGKILL what is left; remove the pid files
stop_pidfiles() {
    local fn p i pids=()
    for fn in "$@"; do
        if p=$(live_pid "${fn%%:*}" "${fn##*:}"); then
            kill -TERM "$p" 2>/dev/null || true
            pids+=("$p")
        fi
    done
    local alive
    for i in $(seq 100); do
        alive=
        for p in "${pids[@]}"; do [ -d "/proc/$p" ] && alive=1; done
        [ -z "$alive" ] && break
        sleep 0.1
    done
    for p in "${pids[@]}"; do [ -d "/proc/$p" ] && kill -KILL "$p" 2>/dev/null; done
    for fn in "$@"; do rm -f "${fn%%:*}"; done
    return 0
}

# slurmstepd processes of this cluster: slurmd hands them its environment,
# which has SLURM_CONF=$CONF (set by start)
our_stepds() {
    local p
    for p in $(pgrep -x slurmstepd 2>/dev/null); do
        tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qxF "SLURM_CONF=$CONF" && echo "$p"
    done
    return 0
}

log_tails() {
    local f
    for f in "$LOGS"/munged.log "$LOGS"/slurmctld.log "$LOGS"/slurmd.log "$LOGS"/*.out; do
        [ -s "$f" ] || continue
        echo "---- tail $f" >&2
        tail -n 20 "$f" >&2
    done
}

fail() { echo "cluster.sh: $*" >&2; log_tails; do_stop >/dev/null 2>&1 || true; exit 1; }

free_ports() {  # two distinct free TCP ports on 127.0.0.1
    python3 - <<'PY'
import socket
ss = []
for _ in range(2):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); ss.append(s)
print(*(s.getsockname()[1] for s in ss))
PY
}

do_stop() {
    export SLURM_CONF=$CONF
    local i
    if live_pid "$CTLD_PID" slurmctld >/dev/null && [ -f "$CONF" ]; then
        # cancel every job so slurmstepd and user tasks go away with slurmd
        local jobs
        jobs=$(timeout 5 squeue -h -o %i 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            timeout 5 scancel $jobs 2>/dev/null || true
            for i in $(seq 100); do
                [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
                sleep 0.1
            done
        fi
    fi
    # batch/step daemons still around (jobs cancelled above, or slurmctld gone)
    for i in $(seq 50); do [ -z "$(our_stepds)" ] && break; sleep 0.1; done
    stop_pidfiles "$SLURMD_PID:slurmd" "$CTLD_PID:slurmctld" "$MUNGED_PID:munged"
    for i in $(our_stepds); do kill -KILL "$i" 2>/dev/null || true; done
    rm -f "$SOCK" "$SOCK.lock"
}

do_start() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd/munged run as root here)"
    local b
    for b in munged munge unmunge slurmctld slurmd sinfo scontrol python3; do
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] \
            || die "$b not found (apt-get install slurmctld slurmd slurm-client munge)"
    done
    export PATH=$PATH:/usr/sbin:/sbin
    if live_pid "$CTLD_PID" slurmctld >/dev/null || live_pid "$SLURMD_PID" slurmd >/dev/null \
        || live_pid "$MUNGED_PID" munged >/dev/null; then
        die "a cluster is already running for $DIR (cluster.sh stop $DIR first)"
    fi

    # unix sockets (munge socket, slurmd spool sockets) have a 108-byte limit
    [ ${#SOCK} -le 100 ] && [ ${#DIR} -le 80 ] \
        || die "DIR path too long for unix sockets (keep it under 80 chars): $DIR"
    mkdir -p "$MUNGE_DIR" "$RUN" "$LOGS" "$DIR/spool/slurmctld" "$DIR/spool/slurmd"
    # munged insists that its dirs are not writable by group/other
    chmod 755 "$DIR"
    chmod 755 "$MUNGE_DIR" "$RUN" "$LOGS"
    rm -f "$SOCK" "$SOCK.lock"
    # a restart in the same DIR: keep the previous logs as *.old
    local f
    for f in "$LOGS"/*.log "$LOGS"/*.out; do [ -e "$f" ] && mv -f "$f" "$f.old"; done

    # --- munge: own key, socket, pid, log, seed
    if [ ! -s "$MUNGE_DIR/munge.key" ]; then
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
    chmod 400 "$MUNGE_DIR/munge.key"
    munged --force --key-file="$MUNGE_DIR/munge.key" --socket="$SOCK" \
        --pid-file="$MUNGED_PID" --log-file="$LOGS/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" >"$LOGS/munged.out" 2>&1 \
        || fail "munged failed to start"
    local i ok=
    for i in $(seq 50); do
        if munge --socket="$SOCK" -n </dev/null 2>/dev/null | unmunge --socket="$SOCK" >/dev/null 2>&1; then
            ok=1; break
        fi
        sleep 0.1
    done
    [ -n "$ok" ] || fail "munged at $SOCK does not answer"

    # --- slurm config
    local ports ctld_port d_port cpus
    ports=$(free_ports) || fail "could not pick free ports"
    read -r ctld_port d_port <<<"$ports"
    cpus=${SLURM_PRIVATE_CPUS:-4}
    cat >"$CONF" <<CONF
# generated by tests/slurm/cluster.sh for $DIR
ClusterName=private
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCK
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$DIR/spool/slurmctld
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
InactiveLimit=0
KillWait=5
MinJobAge=30
Waittime=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
    # slurmd looks for cgroup.conf next to slurm.conf; no cgroup plugin is used
    echo "CgroupPlugin=autodetect" >"$DIR/cgroup.conf"
    export SLURM_CONF=$CONF

    # --- daemons (both daemonize and write their pid files)
    slurmctld -c -f "$CONF" >"$LOGS/slurmctld.out" 2>&1 || fail "slurmctld failed to start"
    slurmd -f "$CONF" -N "$NODE" >"$LOGS/slurmd.out" 2>&1 || fail "slurmd failed to start"

    local timeout=${SLURM_PRIVATE_TIMEOUT:-30} st= t0=$SECONDS
    while [ $((SECONDS - t0)) -lt "$timeout" ]; do
        st=$(timeout 5 sinfo -h -n "$NODE" -o '%t' 2>/dev/null || true)
        case "$st" in
            idle) break ;;
            down*|drain*) timeout 5 scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
        esac
        live_pid "$CTLD_PID" slurmctld >/dev/null || [ $((SECONDS - t0)) -lt 3 ] || fail "slurmctld died"
        live_pid "$SLURMD_PID" slurmd >/dev/null || [ $((SECONDS - t0)) -lt 3 ] || fail "slurmd died"
        sleep 0.2
    done
    [ "$st" = idle ] || fail "node $NODE not idle after ${timeout}s (state: '${st:-no answer}')"
    # slurmctld runs its first scheduling pass ~3 s after it starts; batch jobs
    # submitted before that wait for it (and `sbatch --wait` then polls slowly),
    # so wait for that pass too (soft: at most 6 s, no failure)
    while [ $((SECONDS - t0)) -lt 6 ] && ! grep -q 'SchedulerParameters=' "$LOGS/slurmctld.log" 2>/dev/null; do
        sleep 0.1
    done
    echo "export SLURM_CONF=$CONF"
}

case "$CMD" in
    start) do_start ;;
    stop) do_stop ;;
    *) usage ;;
esac
