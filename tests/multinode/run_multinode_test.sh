#!/usr/bin/env bash
# The engine across hosts (cluster.sh): 2 hosts of 2 ranks each, launched by Open MPI as on a
# cluster, ranks on different hosts connected by TCP only. Runs the multi-rank tests of every
# stage against their one-process references (bitwise), the nvme and host tiers against the
# device tier, and checkpoints (saved by 4 ranks on 2 hosts, loaded at other world sizes), and
# checks that the ranks really were on two hosts and that the bytes crossed the link.
# Exits 77 (ctest: skipped) with the reason where namespaces cannot be made.
#
#   run_multinode_test.sh TEST_MULTIRANK_BINARY [MPIRUN]
set -euo pipefail
bin=${1:?usage: $0 TEST_MULTIRANK_BINARY [MPIRUN]}
export CLUSTER_MPIRUN=${2:-mpirun}
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
rc=0
cluster_up 2 || rc=$?
if [[ $rc == 77 ]]; then echo "SKIPPED: no cluster of namespaces on this machine (see above)"; exit 77; fi
[[ $rc == 0 ]] || exit "$rc"

# Each rank's host: two ranks on each of the two hosts.
names=$(cluster_mpirun -np 4 hostname | sort | uniq -c | awk '{print $2 ":" $1}' | tr '\n' ' ')
echo "ranks per host: $names"
[[ "$names" == "zs-h0:2 zs-h1:2 " ]] || { echo "FAIL: ranks are not two per host"; exit 1; }

rx_before=$(cluster_on 1 cat /sys/class/net/eth0/statistics/rx_bytes)
cluster_mpirun -np 4 "$bin" --gtest_filter='*/Parity.*:Offload*:Checkpoint*:Restore*:Hybrid*'
rx=$(( $(cluster_on 1 cat /sys/class/net/eth0/statistics/rx_bytes) - rx_before ))
echo "host 1 received $rx bytes over its link"
# Gradients, gathers and checkpoint agreements of many steps: far more than the launch's own.
(( rx > 10000000 )) || { echo "FAIL: the ranks did not talk across the link"; exit 1; }
echo "multinode: passed"
