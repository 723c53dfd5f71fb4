#!/usr/bin/env bash
# A cluster of "hosts" on this machine, for tests and benchmarks that must cross a network:
# each host is a Linux network namespace (and its own UTS namespace, so its own host name) with
# one veth link to a switch, a bridge in a namespace of its own; addresses come from the
# benchmarking range 198.18.0.0/15 (RFC 2544), and nothing touches the machine's own network:
# traffic flows only between the namespaces made here. Open MPI starts the ranks as on a
# cluster: mpirun runs on host 0 and starts its daemons on the others through an rsh agent
# (ns_rsh.sh) that enters the host's namespaces, so ranks on different hosts share no memory
# transport and talk over TCP only. Host i is named zs-h<i> (resolved through
# /etc/netns/<namespace>/hosts, which `ip netns exec` mounts over /etc/hosts).
#
# Source it, then:
#   cluster_up N             make hosts zs-h0 .. zs-h<N-1>; returns 77 with the reason on stderr
#                            where the kernel or the tools refuse (the caller skips)
#   cluster_mpirun ARGS...   mpirun on host 0 over the cluster's hostfile (ARGS: -np, program)
#   cluster_on I CMD...      a command on host I
#   cluster_link I CMD...    `tc qdisc CMD...` on host I's link (e.g. to slow it down)
#   cluster_pids I NAME      the pids of host I's processes named NAME, one a line
#   cluster_down             removes everything made (cluster_up sets a trap for it)
# CLUSTER_SLOTS (default 2) ranks per host; CLUSTER_MPIRUN (default mpirun) the launcher.

cluster_id="zs$$"
cluster_n=0
cluster_dir=""

_cluster_ns() { echo "${cluster_id}h$1"; }

cluster_down() {
  local i
  for ((i = 0; i < cluster_n; ++i)); do
    # Processes left in a host (ranks of a host cut off by a test) would outlive its namespace.
    ip netns pids "$(_cluster_ns "$i")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$(_cluster_ns "$i")" 2>/dev/null || true
    rm -rf "/etc/netns/$(_cluster_ns "$i")"
  done
  ip netns del "${cluster_id}sw" 2>/dev/null || true
  [[ -n "$cluster_dir" ]] && rm -rf "$cluster_dir"
  cluster_n=0
}

cluster_up() {
  local n=$1 i ns
  if [[ $(id -u) != 0 ]]; then echo "cluster: needs root (network namespaces)" >&2; return 77; fi
  for tool in ip unshare tc; do
    command -v "$tool" >/dev/null || { echo "cluster: $tool is not installed" >&2; return 77; }
  done
  if ! ip netns add "${cluster_id}sw" 2>"/tmp/${cluster_id}.err"; then
    echo "cluster: the kernel refuses network namespaces: $(cat "/tmp/${cluster_id}.err")" >&2
    rm -f "/tmp/${cluster_id}.err"
    return 77
  fi
  rm -f "/tmp/${cluster_id}.err"
  trap cluster_down EXIT
  cluster_dir=$(mktemp -d)
  export ZS_CLUSTER_NAMESPACES="$cluster_dir/namespaces"
  cluster_n=$n
  ip -n "${cluster_id}sw" link add br0 type bridge
  ip -n "${cluster_id}sw" link set br0 up
  : >"$cluster_dir/hostfile"
  local hosts="127.0.0.1 localhost"$'\n'
  for ((i = 0; i < n; ++i)); do
    hosts+="198.18.0.$((i + 1)) zs-h$i"$'\n'
    echo "zs-h$i slots=${CLUSTER_SLOTS:-2}" >>"$cluster_dir/hostfile"
  done
  for ((i = 0; i < n; ++i)); do
    ns=$(_cluster_ns "$i")
    ip netns add "$ns"
    mkdir -p "/etc/netns/$ns"
    printf '%s' "$hosts" >"/etc/netns/$ns/hosts"
    ip -n "${cluster_id}sw" link add "p$i" type veth peer name eth0 netns "$ns"
    ip -n "${cluster_id}sw" link set "p$i" master br0 up
    ip -n "$ns" addr add "198.18.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    echo "zs-h$i $ns" >>"$cluster_dir/namespaces"
  done
  # Host 0 reaches every other before any rank starts: a TCP connection to a closed port is
  # refused at once by a host that is there.
  local out
  for ((i = 1; i < n; ++i)); do
    out=$(ip netns exec "$(_cluster_ns 0)" timeout 5 bash -c \
      "exec 3<>/dev/tcp/198.18.0.$((i + 1))/9" 2>&1 || true)
    [[ "$out" == *refused* ]] || { echo "cluster: host 0 cannot reach host $i: $out" >&2; return 1; }
  done
}

cluster_on() {
  local i=$1
  shift
  ip netns exec "$(_cluster_ns "$i")" unshare --uts sh -c 'hostname "$0"; exec "$@"' "zs-h$i" "$@"
}

cluster_link() {
  local i=$1
  shift
  ip netns exec "$(_cluster_ns "$i")" tc qdisc "$@"
}

cluster_pids() {
  local pid
  for pid in $(ip netns pids "$(_cluster_ns "$1")" 2>/dev/null); do
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]] && echo "$pid"
  done
  return 0
}

cluster_mpirun() {
  local here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  cluster_on 0 \
    "${CLUSTER_MPIRUN:-mpirun}" --hostfile "$cluster_dir/hostfile" \
    --mca plm_rsh_agent "$here/ns_rsh.sh" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 --mca btl tcp,vader,self \
    -x ZS_CLUSTER_NAMESPACES "$@"
}
