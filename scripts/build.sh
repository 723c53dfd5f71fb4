#!/usr/bin/env bash
# Installs missing packages, configures (once; later runs reuse the build directory) and builds.
# Environment: ZEROSHARD_BUILD_DIR (default build), ZEROSHARD_WITH_CUDA (default ON when nvcc is there),
#              ZEROSHARD_JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

build_dir="${ZEROSHARD_BUILD_DIR:-build}"
# CUDA defaults to ON where the toolkit is installed: the kernels and the NCCL communicator then
# build everywhere CI runs, and their tests skip (saying why) on machines without a GPU.
cuda_default=OFF
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then cuda_default=ON; fi
args=(-S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release
      "-DZEROSHARD_WITH_CUDA=${ZEROSHARD_WITH_CUDA:-$cuda_default}")
# A reused build directory keeps the generator it was made with; cmake refuses to switch.
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  args+=(-G Ninja)
fi

echo "build: cmake ${args[*]}"
cmake "${args[@]}"
cmake --build "$build_dir" -j "${ZEROSHARD_JOBS:-$(nproc)}"
