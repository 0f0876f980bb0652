#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine (controller + compute daemon + munge), for trying
# `dtlab launch slurm --submit` and for the integration test. Needs root and Debian's packages:
#   apt-get install -y slurmctld slurmd slurm-client munge
# Usage: deploy/slurm/local-cluster.sh [start|stop]   (idempotent; `start` waits until the node is idle)
set -euo pipefail

action="${1:-start}"
conf=/etc/slurm/slurm.conf

stop() {
    pkill -x slurmd 2>/dev/null || true
    pkill -x slurmctld 2>/dev/null || true
    pkill -x munged 2>/dev/null || true
}

if [[ "$action" == stop ]]; then
    stop
    exit 0
fi
if [[ "$action" != start ]]; then
    echo "usage: $0 [start|stop]" >&2
    exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "error: run as root (the Slurm and munge daemons need it)" >&2
    exit 1
fi
for cmd in munged slurmctld slurmd sbatch sinfo; do
    command -v "$cmd" >/dev/null || {
        echo "error: $cmd not found; install: apt-get install -y slurmctld slurmd slurm-client munge" >&2
        exit 1
    }
done

# munge: one key shared by every daemon and client (here: one machine).
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
[[ -s /etc/munge/munge.key ]] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

# slurm.conf for this host: its real CPU count and memory (from `slurmd -C`), no cgroups, no accounting.
host=$(hostname -s)
node_line=$(slurmd -C | head -n 1)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat >"$conf" <<CONF
ClusterName=dtlab-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
# A requeued job waits for its old credential to expire (default 120 s) before it may start again.
AuthInfo=cred_expire=30
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=30
$node_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd

for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o '%t' 2>/dev/null || true)
    if [[ "$state" == idle* || "$state" == mix* || "$state" == alloc* ]]; then
        echo "slurm: node $host is $state"
        exit 0
    fi
    sleep 1
done
echo "error: the Slurm node did not come up; see /var/log/slurm/" >&2
sinfo >&2 || true
exit 1
