#!/bin/bash
# A one-node Slurm cluster on localhost, for testing slurm/train.sbatch on one machine (CI does this).
#
#   bash slurm/local_cluster.sh start     # install (Debian, as root) if needed, configure, start; prints the env
#   eval "$(bash slurm/local_cluster.sh env)"   # SLURM_CONF for sbatch/sinfo/scontrol in this shell
#   bash slurm/local_cluster.sh stop
#
# Exit status 3 means Slurm cannot be set up here (not root, no apt, daemons refuse to start); the
# reason is printed and callers skip the real-cluster tests.
set -uo pipefail
DIR=${DRAFTLAB_SLURM_DIR:-/tmp/draftlab-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)

unavailable() { echo "local Slurm unavailable: $*" >&2; exit 3; }

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null && return 0
    [ "$(id -u)" = 0 ] || unavailable "Slurm is not installed and installing it needs root"
    command -v apt-get >/dev/null || unavailable "Slurm is not installed and there is no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge) \
        >"$DIR/apt.log" 2>&1 || unavailable "apt-get install failed (see $DIR/apt.log)"
}

start() {
    mkdir -p "$DIR"/{state,spool,log}
    install
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key 2>/dev/null || true
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
    if ! pgrep -x munged >/dev/null; then
        (runuser -u munge -- munged </dev/null >/dev/null 2>&1 || munged --force </dev/null >/dev/null 2>&1) || unavailable "munged did not start"
    fi
    NODE=$(slurmd -C | awk 'NR == 1')  # this machine's real topology: NodeName=... CPUs=... RealMemory=...
    cat > "$CONF" <<CONF
ClusterName=draftlab-local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MinJobAge=600
$NODE State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF=$CONF
    pgrep -x slurmctld >/dev/null || slurmctld -f "$CONF" </dev/null >/dev/null 2>&1 || unavailable "slurmctld did not start (see $DIR/log)"
    pgrep -x slurmd >/dev/null || slurmd -f "$CONF" </dev/null >/dev/null 2>&1 || unavailable "slurmd did not start (see $DIR/log)"
    for _ in $(seq 60); do
        if sinfo -h -o %t 2>/dev/null | grep -qE 'idle|mix|alloc'; then
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
        sleep 1
    done
    tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 2>/dev/null
    unavailable "the node did not come up (see $DIR/log)"
}

stop() {
    pkill -x slurmd; pkill -x slurmctld
    return 0
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
