#!/usr/bin/env bash
# Flat against hierarchical sharding across hosts (issue 15's benchmark): two hosts of two ranks
# each (tests/multinode/cluster.sh: network namespaces, TCP only between hosts), each host's
# link slowed to RATE Mbit/s each way (tc tbf), and per stage an engine of PARAMS parameters in
# 16 units stepped by plan_step_bench with one group of all four ranks (flat) and with groups
# of two (one per host). Each row gives the median step, predict_step()'s step for the same
# configuration (the collectives within a host from a calibration made on host 0, the ones
# that cross from the link's rate per collective kind as a calibration of one rank per host
# measures it: read_link_calibration()), the bytes host 1 sent to host 0 per step as the engine
# counts them (StepResult::inter_node_bytes of its two ranks) and as the planner predicts them,
# and what host 1's link really sent (its veth counter over the whole run, set-up included,
# per step).
#
#   benchmarks/multinode/hierarchical.sh BUILD_DIR [RATE_MBIT=400] [PARAMS=16M] [STEPS=5]
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR [RATE_MBIT] [PARAMS] [STEPS]}
rate=${2:-400}
params=${3:-16M}
steps=${4:-5}
bench="$build/benchmarks/plan_step_bench"
zs="$build/apps/zeroshard"
for x in "$bench" "$zs"; do [[ -x "$x" ]] || { echo "$x is not built" >&2; exit 1; }; done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_mpi_yield_when_idle=1
source "$(dirname "${BASH_SOURCE[0]}")/../../tests/multinode/cluster.sh"
rc=0
cluster_up 2 || rc=$?
[[ $rc == 0 ]] || { echo "no cluster of namespaces on this machine (see above)" >&2; exit "$rc"; }

echo "hierarchical: $params bf16 parameters in 16 units, AdamW on the device tier, 2 hosts x 2" \
     "ranks, links at $rate Mbit/s; $(lscpu | sed -n 's/^Model name: *//p'), load average" \
     "$(cut -d' ' -f1 /proc/loadavg)"
cal="$cluster_dir/calibration.json"
cluster_mpirun -np 2 "$zs" calibrate --quick --out "$cal" >/dev/null
for i in 0 1; do cluster_link "$i" add dev eth0 root tbf rate "${rate}mbit" burst 256kb latency 500ms; done
# The link as MPI sees it: each collective between one rank on each host.
link_cal="$cluster_dir/link.json"
cluster_mpirun -np 2 --map-by node "$zs" calibrate --quick --out "$link_cal" >/dev/null
python3 - "$link_cal" "$rate" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["collectives"]
print(f"link: tbf rate {float(sys.argv[2]) / 8000:g} GB/s; between one rank per host, GB/s at",
      " / ".join(f"{b / 2**20:g}" for b, _ in c["all_gather"]["points_bytes_s"][-3:]), "MiB:",
      "; ".join(k + " " + " / ".join(f"{b / t / 1e9:.4f}" for b, t in c[k]["points_bytes_s"][-3:])
                for k in ("reduce_scatter", "all_gather", "all_reduce")))
PY
sent() { cluster_on 1 cat /sys/class/net/eth0/statistics/tx_bytes; }
rows="$cluster_dir/rows"
for stage in 2 3; do
  for group in 4 2; do
    before=$(sent)
    row=$(cluster_mpirun -np 4 "$bench" --calibration "$cal" --params "$params" --units 16 \
          --stage "$stage" --tier device --steps "$steps" --shard-group "$group" \
          --ranks-per-node 2 --link-calibration "$link_cal")
    link=$(( $(sent) - before ))
    echo "$row; groups of $group; link $link bytes in $((steps + 2)) steps" | tee -a "$rows"
  done
done
python3 - "$rows" "$steps" <<'PY'
import re, sys
steps = int(sys.argv[2]) + 2
rows = []
for l in open(sys.argv[1]):
    g = lambda f: re.search(f, l).group(1)
    rows.append((g(r"stage (\d)"), g(r"groups of (\d)"), float(g(r"measured ([0-9.]+) s")),
                 float(g(r"predicted ([0-9.]+) s")), float(g(r"engine ([0-9.]+)")),
                 float(re.findall(r"predicted ([0-9.]+)", l)[-1]),
                 int(g(r"link (\d+) bytes")) / steps / 2**20))
print("\n| stage | sharding | measured step s | predicted step s | predicted / measured |"
      " host 1 -> host 0, MiB/step: engine | planner | link (veth, set-up included) |")
print("|---|---|---|---|---|---|---|---|")
for st, grp, m, p, e, pb, v in rows:
    name = "flat (1 group of 4)" if grp == "4" else "hierarchical (2 groups of 2)"
    print(f"| {st} | {name} | {m:.3f} | {p:.3f} | {p / m:.2f} | {e:.2f} | {pb:.2f} | {v:.2f} |")
by = {(r[0], r[1]): r for r in rows}
for st in ("2", "3"):
    f, h = by[(st, "4")], by[(st, "2")]
    print(f"stage {st}: hierarchical / flat: step {h[2] / f[2]:.2f}, engine bytes {h[4] / f[4]:.2f},"
          f" link bytes {h[6] / f[6]:.2f}")
PY
