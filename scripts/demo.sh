#!/usr/bin/env bash
# The README's main command: installs what is missing, builds, and trains the demo GPT on 4 MPI
# ranks with ZeRO stage 3 (about a minute of training on a 2-core machine). Arguments go to
# `zeroshard demo` (see `build/apps/zeroshard demo --help`), e.g.
#   bash scripts/demo.sh --stage 2 --dtype f16 --offload-optimizer cpu
# Environment: ZEROSHARD_NP (ranks, default 4), and those of scripts/build.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/build.sh
build_dir="${ZEROSHARD_BUILD_DIR:-build}"
# A build directory configured earlier without the apps (ZEROSHARD_BUILD_APPS=OFF) keeps that
# setting; turn them on and build the tool.
if grep -q '^ZEROSHARD_BUILD_APPS:BOOL=OFF' "$build_dir/CMakeCache.txt" 2>/dev/null; then
  echo "demo: enabling ZEROSHARD_BUILD_APPS in $build_dir"
  cmake -S . -B "$build_dir" -DZEROSHARD_BUILD_APPS=ON >/dev/null
  cmake --build "$build_dir" --target zeroshard_cli -j "${ZEROSHARD_JOBS:-$(nproc)}"
fi

# As root in a container: allow it, run more ranks than cores, skip the ptrace-based single-copy
# path, and let ranks that wait yield their core to ranks that compute.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_mpi_yield_when_idle=1

np="${ZEROSHARD_NP:-4}"
echo "demo: mpirun -np $np $build_dir/apps/zeroshard demo $*"
exec mpirun -np "$np" "$build_dir/apps/zeroshard" demo "$@"
