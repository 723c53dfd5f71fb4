#!/usr/bin/env bash
# Installs a built zeroshard into a temporary prefix, then, as an outside project would
# (find_package against the installed tree only), builds the C++ example of docs/cpp-api.md and
# runs it on one rank and under `mpirun -np 2`, and parses the JSON example of
# docs/configuration.md.
# Usage: run_install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail

if (($# != 2)); then
  echo "usage: $0 BUILD_DIR SOURCE_DIR" >&2
  exit 2
fi
build_dir="$(realpath "$1")"
src_dir="$(realpath "$2")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

say() { echo "install-test: $*"; }

# Prints the lines of the page $2 (docs/...) between "<!-- NAME:begin -->" and "<!-- NAME:end -->",
# without the ``` fence lines; fails if there are none.
extract() {
  local out
  out="$(awk -v b="<!-- $1:begin -->" -v e="<!-- $1:end -->" \
    '$0 == e { exit } on && !/^```/ { print } $0 == b { on = 1 }' "$src_dir/$2")"
  if [[ -z "$out" ]]; then
    echo "install-test: no '$1' block in $src_dir/$2" >&2
    return 1
  fi
  printf '%s\n' "$out"
}

# A value from the library's CMake cache (empty if unset), so the consumer is built the same way.
cache() {
  [[ -f "$build_dir/CMakeCache.txt" ]] || return 0
  sed -n "s/^$1:[A-Z]*=//p" "$build_dir/CMakeCache.txt"
}

prefix="$work/prefix"
say "cmake --install $build_dir --prefix $prefix"
cmake --install "$build_dir" --prefix "$prefix"

mkdir -p "$work/src"
extract example docs/cpp-api.md >"$work/src/example.cpp"
extract config-example docs/configuration.md >"$work/src/config.json"

args=(-S "$src_dir/tests/install" -B "$work/consumer" -DCMAKE_BUILD_TYPE=Release
      "-DCMAKE_PREFIX_PATH=$prefix" "-DZEROSHARD_EXAMPLE_SOURCE=$work/src/example.cpp")
cxx="$(cache CMAKE_CXX_COMPILER)"
if [[ -n "$cxx" ]]; then args+=("-DCMAKE_CXX_COMPILER=$cxx"); fi
if command -v ninja >/dev/null; then args+=(-G Ninja); fi
# A sanitized libzeroshard.so needs a sanitized executable (the runtime must load first).
sanitize="$(cache ZEROSHARD_SANITIZE)"
if [[ -n "$sanitize" ]]; then
  args+=("-DCMAKE_CXX_FLAGS=-fsanitize=$sanitize -fno-omit-frame-pointer")
  # Open MPI leaks at exit by design; the other ASan checks stay on.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}"
fi
say "configure the consumer project"
cmake "${args[@]}"

# It must have found the installed package, not the build tree or another installation.
found="$(sed -n 's/^zeroshard_DIR:[A-Z]*=//p' "$work/consumer/CMakeCache.txt")"
if [[ "$found" != "$prefix"/* ]]; then
  echo "install-test: found zeroshard in '$found', not under $prefix" >&2
  exit 1
fi
say "build the consumer project"
cmake --build "$work/consumer"
libs="$(ldd "$work/consumer/example")"
if ! grep -q "libzeroshard.* => $prefix/" <<<"$libs"; then
  printf 'install-test: example does not load libzeroshard from %s:\n%s\n' "$prefix" "$libs" >&2
  exit 1
fi

# Containers usually forbid the ptrace that Open MPI's single-copy path needs; keep what the
# caller set.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"

say "check_config docs/configuration.md example"
"$work/consumer/check_config" "$work/src/config.json"
say "example, one rank"
timeout 300 "$work/consumer/example"
say "example, mpirun -np 2"
timeout 300 mpirun -np 2 --allow-run-as-root --oversubscribe "$work/consumer/example"
say "passed"
