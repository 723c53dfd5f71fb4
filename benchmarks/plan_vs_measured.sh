#!/usr/bin/env bash
# The planner's step time against the engine's on this machine (issue 14's validation): for
# each configuration below, `zeroshard calibrate` under mpirun -np N, then at once
# plan_step_bench, which measures the median step of an engine of PARAMS parameters in UNITS
# units (synthetic gradients, no model math: the trainer's compute is the writing of the
# gradients, timed alone) and prints predict_step()'s figure from that calibration beside it,
# then a second calibration: its "drift" column is how far the
# reduce-scatter and all-gather times (256 KiB to 16 MiB) of the two calibrations differ, the
# machine's own noise (on the 2-core virtual machine of benchmarks/RESULTS.md they jump between
# levels up to 3x apart from one minute to the next). Ends with the table, and how many
# configurations came within 25 % of their measured step.
#
# With ALTERNATE=R, each configuration's plan_step_bench alternates R rounds of STEPS steps with
# a measurement of the step's own collectives in the same process, and predicts each round from
# those (the update and nvme rates still from the calibration before): the median round's ratio
# is printed, and the drift is how far the collectives' time moved over the rounds.
#
#   [CONFIGS="2 2 nvme 8bit"] [ALTERNATE=5] benchmarks/plan_vs_measured.sh BUILD_DIR NVME_DIR [PARAMS=64M] [UNITS=16] [STEPS=7]
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR NVME_DIR [PARAMS] [UNITS] [STEPS]}
nvme=${2:?usage: $0 BUILD_DIR NVME_DIR [PARAMS] [UNITS] [STEPS]}
params=${3:-64M}
units=${4:-16}
steps=${5:-7}
bench="$build/benchmarks/plan_step_bench"
zs="$build/apps/zeroshard"
for x in "$bench" "$zs"; do [[ -x "$x" ]] || { echo "$x is not built" >&2; exit 1; }; done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_mpi_yield_when_idle=1
mkdir -p "$nvme"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ranks stage optimizer-tier [moments' format, default f32] [stage 3's parameter tier, default device]
configs=(
  "2 0 device" "2 1 host" "2 2 host" "2 3 device" "2 2 nvme" "2 3 nvme"
  "4 1 host" "4 2 device" "4 3 host" "4 2 nvme"
  "2 2 host 8bit" "2 2 nvme 8bit" "2 3 nvme bf16" "2 1 host bf16"
)
[[ -n "${CONFIGS:-}" ]] && mapfile -t configs <<<"$CONFIGS"  # one configuration per line
echo "plan_vs_measured: $params parameters in $units units, bf16, AdamW, $steps steps each;" \
     "$(lscpu | sed -n 's/^Model name: *//p'), load average $(cut -d' ' -f1 /proc/loadavg)"
drift() {  # calibration files a b: the largest relative difference of their collectives' times
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = (json.load(open(f))["collectives"] for f in sys.argv[1:3])
print(f"{max(abs(x[1] / y[1] - 1) for k in ('reduce_scatter', 'all_gather') for x, y in zip(a[k]['points_bytes_s'], b[k]['points_bytes_s']) if 2**18 <= x[0] <= 2**24):.2f}")
PY
}
out="$work/rows"
for c in "${configs[@]}"; do
  read -r n stage tier state ptier <<<"$c"
  mpirun -np "$n" "$zs" calibrate --out "$work/before.json" --nvme-path "$nvme" >/dev/null 2>&1
  row=$(mpirun -np "$n" "$bench" --calibration "$work/before.json" --params "$params" \
        --units "$units" --stage "$stage" --tier "$tier" --state "${state:-f32}" \
        --param-tier "${ptier:-device}" \
        --nvme-path "$nvme" --steps "$steps" ${ALTERNATE:+--alternate "$ALTERNATE"})
  if [[ -n "${ALTERNATE:-}" ]]; then  # its rounds, then its line with the drift over them
    echo "$row" | tee -a "$out"
    continue
  fi
  mpirun -np "$n" "$zs" calibrate --out "$work/after.json" --nvme-path "$nvme" >/dev/null 2>&1
  echo "$row, drift $(drift "$work/before.json" "$work/after.json")" | tee -a "$out"
done
python3 - "$out" <<'PY'
import re, sys
fields = [r"ranks (\d+)", r"stage (\d)", r"tier (\w+)", r"state (\w+)", r"param tier (\w+)",
          r"measured ([0-9.]+) s",
          r"predicted ([0-9.]+) s", r"compute ([0-9.]+),", r"comm ([0-9.]+),",
          r"optimizer ([0-9.]+), nvme",
          r"nvme ([0-9.]+)\)", r"predicted / measured ([0-9.]+)", r"drift ([0-9.]+)"]
rows = [[re.search(f, l).group(1) for f in fields] for l in open(sys.argv[1]) if "predicted /" in l]
print("\n| ranks | stage | optimizer | moments | params | measured s | predicted s | compute | comm | optimizer | nvme | predicted / measured | drift |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(r) + " |")
within = sum(abs(float(r[-2]) - 1) <= 0.25 for r in rows)
print(f"\n{within} of {len(rows)} configurations within 25 % of the measured step")
PY
