#!/usr/bin/env bash
# Installs missing packages, configures (once; later runs reuse the build directory) and builds.
# Environment: ZEROSHARD_BUILD_DIR (default build), ZEROSHARD_WITH_CUDA (default OFF),
#              ZEROSHARD_JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh

build_dir="${ZEROSHARD_BUILD_DIR:-build}"
args=(-S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release
      "-DZEROSHARD_WITH_CUDA=${ZEROSHARD_WITH_CUDA:-OFF}")
# A reused build directory keeps the generator it was made with; cmake refuses to switch.
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  args+=(-G Ninja)
fi

echo "build: cmake ${args[*]}"
cmake "${args[@]}"
cmake --build "$build_dir" -j "${ZEROSHARD_JOBS:-$(nproc)}"
