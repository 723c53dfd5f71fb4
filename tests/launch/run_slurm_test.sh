#!/usr/bin/env bash
# Slurm's srun as the launcher, for real (slurm.sh: a one-node cluster on this machine):
#  - `srun --mpi=pmix` starts the multi-rank tests as one MPI world: launch_info() agrees with
#    MPI (rank, world, local ranks), hierarchical sharding and the stage parity tests pass;
#  - the demo trainer under srun trains exactly as under mpirun (the same losses, bit for bit);
#  - `srun --mpi=none`, where MPI cannot find the other tasks, is refused by zeroshard with
#    what to run instead, on every task, before MPI starts (not Open MPI's advice to rebuild);
#  - Python under srun (second form, run by scripts/python_test.sh once the package is
#    installed): default_communicator() is the MPI world of the step.
# Exits 77 (ctest: skipped) with the reason where the cluster cannot be started.
#
#   run_slurm_test.sh TEST_MULTIRANK ZEROSHARD_CLI [MPIRUN]
#   run_slurm_test.sh --python PYTHON
set -euo pipefail
usage="usage: $0 TEST_MULTIRANK ZEROSHARD_CLI [MPIRUN] | --python PYTHON"
python=""
if [[ ${1:-} == --python ]]; then
  python=${2:?$usage}
else
  bin=${1:?$usage}
  cli=${2:?$usage}
  mpirun=${3:-mpirun}
fi
source "$(dirname "${BASH_SOURCE[0]}")/slurm.sh"
rc=0
slurm_up || rc=$?
if [[ $rc == 77 ]]; then echo "SKIPPED: no Slurm cluster on this machine (see above)"; exit 77; fi
[[ $rc == 0 ]] || exit "$rc"
work=$(mktemp -d /tmp/zs-srun.XXXXXX)
trap 'slurm_down; rm -rf "$work"' EXIT

if [[ -z "$python" ]]; then
  echo "== srun --mpi=pmix: the multi-rank tests"
  srun -n 4 --mpi=pmix --time=10 "$bin" --gtest_filter='LaunchWorld*:Hybrid*:AdamW/Parity.*'

  echo "== the demo under srun and under mpirun"
  demo=(demo --steps 4 --layers 2 --dim 64 --corpus-chars 100000 --sample 0 --quiet
        --no-dp-reference)
  srun -n 2 --mpi=pmix --time=10 "$cli" "${demo[@]}" --report-json "$work/srun.json" > "$work/srun.log"
  "$mpirun" -np 2 "$cli" "${demo[@]}" --report-json "$work/mpirun.json" > "$work/mpirun.log"
  python3 -c '
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
assert a["world_size"] == b["world_size"] == 2, (a["world_size"], b["world_size"])
assert len(a["losses"]) == 4 and a["losses"] == b["losses"], (a["losses"], b["losses"])
print("srun and mpirun losses equal:", a["losses"])' "$work/srun.json" "$work/mpirun.json"

  echo "== srun without a PMI plugin is refused by name"
  if srun -n 2 --mpi=none --time=10 "$cli" "${demo[@]}" > "$work/none.log" 2>&1; then
    cat "$work/none.log"; echo "FAIL: the demo ran as 2 unconnected processes"; exit 1
  fi
  refusal="without a PMI plugin, so MPI cannot find the other tasks: launch with \`srun --mpi=pmix"
  n=$(grep -c "$refusal" "$work/none.log" || true)
  [[ $n == 2 ]] || { cat "$work/none.log"; echo "FAIL: expected the refusal on both tasks, got $n"; exit 1; }
  ! grep -q "OMPI was not built" "$work/none.log" || { echo "FAIL: MPI_Init ran"; exit 1; }
  echo "refused on both tasks"
else
  echo "== Python under srun"
  srun -n 2 --mpi=pmix --time=10 "$python" -c '
import zeroshard
info = zeroshard.launch_info()
c = zeroshard.default_communicator()
assert info["launcher"] == "srun" and (c.rank(), c.size()) == (info["rank"], 2), (info, c.size())
print("python rank", c.rank(), "of", c.size())' | sort
fi
echo "slurm: passed"
