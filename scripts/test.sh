#!/usr/bin/env bash
# The one test command: installs what is missing, builds, and runs every test.
# Exits non-zero if anything fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/build.sh

# Let mpirun run as root and start more ranks than cores (CI containers), and skip the CMA
# single-copy path, which needs ptrace rights that containers usually withhold.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

ctest --test-dir "${ZEROSHARD_BUILD_DIR:-build}" --output-on-failure --no-tests=error -j2

# The Python package and its tests (single-process, then 2 ranks under mpirun).
bash scripts/python_test.sh

# Every command the README shows, as a new user types it after the two set-up commands.
bash tests/readme/run_readme_commands.sh
