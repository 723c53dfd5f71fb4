#!/usr/bin/env bash
# A host that disappears (cluster.sh: 2 hosts of 2 ranks, TCP only between them): ranks train
# and save a checkpoint after every step (ckpt_crash save-loop, collective timeout T); host 1's
# link is cut in the middle of it. Host 0's ranks must end within a few timeouts, the first of
# them with an error naming the collective and both ranks of host 1 with their host, and the last
# checkpoint must load and continue bitwise (ckpt_crash resume, 4 ranks on one machine).
# Exits 77 (ctest: skipped) with the reason where namespaces cannot be made.
#
#   run_host_loss_test.sh CKPT_CRASH_BINARY [MPIRUN]
set -euo pipefail
bin=${1:?usage: $0 CKPT_CRASH_BINARY [MPIRUN]}
mpirun=${2:-mpirun}
export CLUSTER_MPIRUN=$mpirun
timeout_s=6
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
rc=0
cluster_up 2 || rc=$?
if [[ $rc == 77 ]]; then echo "SKIPPED: no cluster of namespaces on this machine (see above)"; exit 77; fi
[[ $rc == 0 ]] || exit "$rc"
root=$(mktemp -d /tmp/zs-hostloss.XXXXXX)
log=$root.log
job=""
finish() {
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null || true
  cluster_down
  rm -rf "$root" "$log"
}
trap finish EXIT

cluster_mpirun -np 4 "$bin" save-loop "$root" "$timeout_s" > "$log" 2>&1 &
job=$!
for _ in $(seq 1 240); do
  (( $(grep -c "^saved step" "$log" || true) >= 2 )) && break
  kill -0 "$job" 2>/dev/null || { cat "$log"; echo "FAIL: save-loop ended"; exit 1; }
  sleep 0.5
done
(( $(grep -c "^saved step" "$log" || true) >= 2 )) || { cat "$log"; echo "FAIL: no saves"; exit 1; }

echo "cutting host 1 off after: $(grep "^saved step" "$log" | tail -n 1)"
cluster_on 1 ip link set eth0 down
cut=$(date +%s.%N)
# Host 0's ranks reach a collective within one step (or a save) of the cut, then time out. The
# first to report ends the job (MPI_Abort: MPI_Finalize would wait for the lost ranks), which may
# end the other before its own deadline: every rank of host 0 must be gone, at least one must
# have reported, and every report must name the collective and the lost host's ranks.
name=$(basename "$bin")
limit=$(( 3 * timeout_s + 10 ))
for _ in $(seq 1 $(( limit * 2 ))); do
  [[ -z "$(cluster_pids 0 "$name")" ]] && break
  sleep 0.5
done
elapsed=$(echo "$(date +%s.%N) - $cut" | bc)
left=$(cluster_pids 0 "$name" | tr '\n' ' ')
grep "^ckpt_crash save-loop" "$log" || true
[[ -z "$left" ]] || { cat "$log"; echo "FAIL: host 0's ranks still run ${limit} s after the cut (pids $left)"; exit 1; }
reported=""
for r in 0 1; do
  line=$(grep "^ckpt_crash save-loop: rank $r:" "$log" | head -n 1 || true)
  [[ -n "$line" ]] || continue
  [[ "$line" == *"did not complete within ${timeout_s}"* ]] || { echo "FAIL: not the timeout: $line"; exit 1; }
  [[ "$line" =~ (reduce_scatter|all_gather|all_reduce|barrier)\ of\ [^:]+ ]] || { echo "FAIL: no collective named: $line"; exit 1; }
  [[ "$line" == *"no answer from rank 2 (host zs-h1), rank 3 (host zs-h1)"* ]] || { echo "FAIL: the lost host's ranks are not named: $line"; exit 1; }
  reported+=" $r"
done
[[ -n "$reported" ]] || { cat "$log"; echo "FAIL: host 0's ranks ended, but none reported the lost host"; exit 1; }
grep -q "aborting the MPI job" "$log" || { cat "$log"; echo "FAIL: no rank aborted the job"; exit 1; }
echo "host 0's ranks ended ${elapsed} s after the cut (timeout ${timeout_s} s); rank(s)${reported} reported it, naming host 1's ranks"
kill -9 "$job" 2>/dev/null || true
job=""

echo "resuming from the last checkpoint on one machine"
tags=$(ls "$root")
echo "checkpoint root holds: $(echo $tags)"
"$mpirun" -np 4 "$bin" resume "$root"
echo "host loss: passed"
