# A one-node Slurm cluster on this machine, for tests: slurmctld and slurmd as root, with their
# configuration, state and logs in a temporary directory, authentication off (auth/none: the
# daemons listen on this machine's name only and serve this test), and the node declared with
# 8 CPUs so that 4 tasks fit on a 2-core machine. Source it, then:
#
#   slurm_up      starts the daemons and waits until the node is idle; returns 77 with the
#                 reason where it cannot (not root, Slurm not installed, a daemon that fails)
#   slurm_down    stops them and removes the directory (slurm_up arranges it on EXIT too)
#
# srun, sbatch and sinfo find the cluster through SLURM_CONF, which slurm_up exports.

slurm_dir=""

slurm_down() {
  [[ -n "$slurm_dir" ]] || return 0
  scancel --quiet --user="$(id -un)" 2>/dev/null || true
  for f in "$slurm_dir"/slurmd.pid "$slurm_dir"/slurmctld.pid; do
    [[ -s "$f" ]] && kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 0.5
  for f in "$slurm_dir"/slurmd.pid "$slurm_dir"/slurmctld.pid; do
    [[ -s "$f" ]] && kill -9 "$(cat "$f")" 2>/dev/null || true
  done
  rm -rf "$slurm_dir"
  slurm_dir=""
}

slurm_up() {
  if [[ $(id -u) != 0 ]]; then echo "slurm: needs root (slurmd starts tasks as their user)"; return 77; fi
  local tool
  for tool in slurmctld slurmd srun sinfo; do
    command -v "$tool" >/dev/null || { echo "slurm: $tool not installed (scripts/setup.sh installs it)"; return 77; }
  done
  slurm_dir=$(mktemp -d /tmp/zs-slurm.XXXXXX)
  trap slurm_down EXIT
  mkdir -p "$slurm_dir"/{state,spool}
  local host port
  host=$(uname -n)
  # Two ports of a range nothing else of the suite uses, picked per run.
  port=$(( 27000 + (RANDOM % 500) * 2 ))
  cat > "$slurm_dir/slurm.conf" <<CONF
ClusterName=zeroshard-test
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$slurm_dir/state
SlurmdSpoolDir=$slurm_dir/spool
SlurmctldPidFile=$slurm_dir/slurmctld.pid
SlurmdPidFile=$slurm_dir/slurmd.pid
SlurmctldLogFile=$slurm_dir/slurmctld.log
SlurmdLogFile=$slurm_dir/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=$host CPUs=8 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=30 State=UP OverSubscribe=YES
CONF
  export SLURM_CONF="$slurm_dir/slurm.conf"
  if ! slurmctld -f "$SLURM_CONF" || ! slurmd -f "$SLURM_CONF"; then
    echo "slurm: a daemon did not start:"; tail -n 20 "$slurm_dir"/*.log 2>/dev/null
    return 77
  fi
  local i
  for i in $(seq 1 60); do
    [[ "$(sinfo -h -o %t 2>/dev/null)" == idle ]] && { echo "slurm: node $host idle"; return 0; }
    sleep 0.5
  done
  echo "slurm: the node did not become idle:"; sinfo 2>&1; tail -n 20 "$slurm_dir"/*.log
  return 77
}
