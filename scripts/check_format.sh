#!/usr/bin/env bash
# Fails, naming file and line, where a C++ or CUDA source of the repository is not formatted as
# .clang-format says. The formatter is Debian 12's clang-format 14 (scripts/setup.sh): other
# versions format a few constructs differently. Fix with:
#   git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.h' | xargs clang-format -i
# Usage: check_format.sh [CLANG_FORMAT]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
formatter="${1:-clang-format}"
mapfile -t files < <(git ls-files --cached --others --exclude-standard \
  '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.h')
"$formatter" --dry-run -Werror "${files[@]}"
echo "check_format: ${#files[@]} files formatted as .clang-format says ($("$formatter" --version))"
