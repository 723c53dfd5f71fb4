#!/usr/bin/env bash
# Runs the real `zeroshard demo` under mpirun for a few steps of a small model, then checks its
# JSON report (ledger bytes against the ZeRO formulas, falling loss) with check_demo_report.py.
# usage: run_demo_test.sh ZEROSHARD_BIN MPIEXEC NP [demo flags...]
# MPIEXEC "none" runs the one rank directly (a build without MPI).
set -euo pipefail
if (($# < 3)); then
  echo "usage: $0 ZEROSHARD_BIN MPIEXEC NP [demo flags...]" >&2
  exit 2
fi
bin="$1" mpiexec="$2" np="$3"
shift 3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A small model and short run; flags given after these (the test's own) take their place.
small=(--steps 16 --layers 2 --dim 64 --heads 2 --seq 32 --batch 4 --corpus-chars 200000 --sample 40)
launch=("$mpiexec" -np "$np")
if [[ "$mpiexec" == none ]]; then launch=(); fi
"${launch[@]}" "$bin" demo "${small[@]}" --report-json "$work/report.json" "$@" | tee "$work/out.txt"
# The human-readable report is there too.
grep -q "memory per rank" "$work/out.txt"
grep -q "data parallel" "$work/out.txt"
grep -q "communication hidden behind compute" "$work/out.txt"
/usr/bin/python3 "$here/check_demo_report.py" "$work/report.json" --np "$np" "${small[@]}" "$@"
