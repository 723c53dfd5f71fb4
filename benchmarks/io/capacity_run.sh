#!/usr/bin/env bash
# Capacity on this machine: capacity_bench (stage 3, everything on nvme) inside a memory cgroup
# limited to the budget, when the cgroup file system allows it (root): the whole process, not
# only the engine's ledger, must then fit the budget or be killed. Reports the cgroup's peak
# usage next to the program's own figures. Cleans the swap directory up (the engine does).
#
#   benchmarks/io/capacity_run.sh BUILD_DIR DIR [PARAMS=1.5G] [UNITS=120] [STEPS=3] [BUDGET=1.6G]
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR DIR [PARAMS] [UNITS] [STEPS] [BUDGET]}
dir=${2:?usage: $0 BUILD_DIR DIR [PARAMS] [UNITS] [STEPS] [BUDGET]}
params=${3:-1.5G}
units=${4:-120}
steps=${5:-3}
budget=${6:-1.6G}
bench="$build/benchmarks/io/capacity_bench"
[[ -x "$bench" ]] || { echo "$bench not built (-DZEROSHARD_BUILD_BENCHMARKS=ON)" >&2; exit 1; }
mkdir -p "$dir"
limit=$(python3 -c "import sys; s=sys.argv[1]; m={'K':2**10,'M':2**20,'G':2**30}; print(int(float(s[:-1])*m[s[-1].upper()]) if s[-1].upper() in m else int(s))" "$budget")
args=(--dir "$dir" --params "$params" --units "$units" --steps "$steps" --budget "$budget")

cg=""
for root in /sys/fs/cgroup/memory /sys/fs/cgroup; do
  if [[ -w "$root" ]] && mkdir "$root/zeroshard-capacity-$$" 2>/dev/null; then cg="$root/zeroshard-capacity-$$"; break; fi
done
if [[ -n "$cg" ]]; then
  trap 'rmdir "$cg" 2>/dev/null || true' EXIT
  if [[ -f "$cg/memory.limit_in_bytes" ]]; then  # cgroup v1
    echo "$limit" >"$cg/memory.limit_in_bytes"
    peak_file="$cg/memory.max_usage_in_bytes"
  else  # cgroup v2
    echo "$limit" >"$cg/memory.max"
    peak_file="$cg/memory.peak"
  fi
  echo "running in memory cgroup $cg limited to $limit bytes ($budget)"
  bash -c 'echo $$ >"$1/cgroup.procs"; shift; exec "$@"' _ "$cg" "$bench" "${args[@]}"
  [[ -f "$peak_file" ]] && echo "cgroup peak memory usage: $(python3 -c "print('%.2f GiB' % ($(cat "$peak_file")/2**30))")"
else
  echo "no writable memory cgroup: the budget is checked against the engine's ledger only"
  "$bench" "${args[@]}"
fi
