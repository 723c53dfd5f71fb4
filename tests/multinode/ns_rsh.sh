#!/usr/bin/env bash
# The rsh agent of cluster.sh: Open MPI calls it as it would call ssh (options, a host name, a
# command line for the remote shell); it runs the command in that host's namespaces, under the
# host's own name, instead of on another machine.
set -euo pipefail
while [[ "${1:-}" == -* ]]; do shift; done  # ssh options Open MPI may pass
host=${1:?ns_rsh.sh: no host}
shift
ns=$(awk -v h="$host" '$1 == h {print $2}' "${ZS_CLUSTER_NAMESPACES:?ns_rsh.sh: not in a cluster}")
[[ -n "$ns" ]] || { echo "ns_rsh.sh: no host $host in $ZS_CLUSTER_NAMESPACES" >&2; exit 255; }
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0"; exec sh -c "$1"' "$host" "$*"
