#!/usr/bin/env bash
# Builds zeroshard with CUDA on a GPU machine, runs the GPU tests (ctest label "gpu") and the GPU
# benchmarks (fused_adamw_bench; torch_fused_adamw_bench.py where python3 has torch with CUDA,
# joined with it into fused_adamw_vs_torch.txt; offload_step_bench; demo_throughput.sh;
# demo_capacity.sh), and writes
# logs and figures to $OUT when set, else to benchmarks/gpu/results/. A part name (build, test,
# python, bench, capacity, plan) runs the build and that part only: each then fits a 10-minute
# command. plan: `zeroshard calibrate --device cuda`, then GPU engines' steps against
# predict_step() from that file (plan_step_bench --device cuda, one rank), in plan_gpu.txt.
#
#   bash benchmarks/gpu/run_all.sh pack   # on a development machine (Debian, after
#                                         # scripts/setup.sh): gathers into .gpu-deps/ the build
#                                         # dependencies a bare GPU machine lacks
#   bash benchmarks/gpu/run_all.sh        # on the GPU machine, with .gpu-deps/ beside the sources
#   bash benchmarks/gpu/run_all.sh test   # the build (incremental) and the GPU tests only
#
# What the GPU machine must have: nvcc (CUDA >= 12) with a C++20 host compiler it supports
# (g++ 11-14), CMake >= 3.22, ninja or make, NCCL (the toolkit's, or the pip wheel
# nvidia-nccl-cu13, found through python3), an NVIDIA driver. What zeroshard also needs and a
# bare machine usually lacks, and how this script gets it:
#   oneTBB, nlohmann_json   copied by `pack` (headers, CMake package files, libtbb*.so*; built
#                           for glibc >= 2.36, which any current CUDA image has)
#   GoogleTest              its source (/usr/src/googletest) copied by `pack`, built here
#   liburing                copied by `pack` (headers, libraries; a .pc file is written here)
#   Open MPI                `pack` archives Debian's Open MPI and the libraries it needs; here,
#                           where no mpirun exists, the archive is unpacked and each of its files
#                           copied into / where no file of that name exists yet (nothing of the
#                           machine's own is replaced), so that the multi-rank GPU tests run
# Without either, the build has the one-rank communicator or no NVMe tier, and says so.
# A dependency found on the machine itself is used instead of the packed one.
# Environment: ZEROSHARD_GPU_DEPS (default .gpu-deps), ZEROSHARD_GPU_BUILD_DIR (default
# build-gpu), ZEROSHARD_CUDA_ARCHS (default: the project's "80;90"), ZEROSHARD_GPU_PACKED_ONLY=1
# (ignore system copies of the packed dependencies: tests this script on a development machine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
root="$PWD"
deps="${ZEROSHARD_GPU_DEPS:-$root/.gpu-deps}"

say() { echo "run_all: $*"; }
die() {
  echo "run_all: $*" >&2
  exit 1
}

# ---- pack: on a development machine ----------------------------------------------------------
pack() {
  local arch=x86_64-linux-gnu
  [[ -f /usr/include/nlohmann/json.hpp && -d /usr/lib/$arch/cmake/TBB && -d /usr/src/googletest ]] ||
    die "pack needs nlohmann-json3-dev, libtbb-dev and libgtest-dev installed (bash scripts/setup.sh)"
  rm -rf "$deps"
  mkdir -p "$deps/usr/include" "$deps/usr/share/cmake" "$deps/usr/lib/$arch/cmake"
  # Same layout as /usr, so the packages' own CMake files find their files relative to themselves.
  cp -a /usr/include/nlohmann "$deps/usr/include/"
  cp -a /usr/share/cmake/nlohmann_json "$deps/usr/share/cmake/"
  cp -a /usr/include/tbb /usr/include/oneapi "$deps/usr/include/"
  cp -a /usr/lib/$arch/cmake/TBB "$deps/usr/lib/$arch/cmake/"
  cp -a /usr/lib/$arch/libtbb*.so* "$deps/usr/lib/$arch/"
  cp -a /usr/src/googletest "$deps/googletest-src"
  if [[ -f /usr/include/liburing.h ]]; then
    cp -a /usr/include/liburing.h /usr/include/liburing "$deps/usr/include/"
    cp -a /usr/lib/$arch/liburing.so* "$deps/usr/lib/$arch/"
    # CMake finds liburing through pkg-config, which a bare machine may lack too.
    mkdir -p "$deps/pkgconf"
    cp -a /usr/bin/pkgconf /usr/lib/$arch/libpkgconf.so* "$deps/pkgconf/"
    printf '#!/bin/sh\nd="$(dirname "$0")"\nLD_LIBRARY_PATH="$d" exec "$d/pkgconf" "$@"\n' >"$deps/pkgconf/pkg-config"
    chmod +x "$deps/pkgconf/pkg-config"
  fi
  if command -v mpirun >/dev/null; then
    # Every file of Open MPI's packages and of the libraries they load, links followed (mpirun
    # and mpicxx are links through /etc/alternatives), without documentation or Fortran modules.
    local p pkgs="openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libpmix2 libhwloc15
      libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libibverbs1 ibverbs-providers
      librdmacm1 libmunge2 libnl-3-200 libnl-route-3-200 libnuma1 libpsm-infinipath1 libpsm2-2 libucx0"
    for p in $pkgs; do dpkg -L "$p" 2>/dev/null; done | grep -v -E '^/usr/share/(doc|man|lintian)/|/fortran/' |
      sort -u | while read -r f; do [[ -f "$f" ]] && echo "$f"; done >"$deps/openmpi.files"
    printf '%s\n' /usr/bin/mpirun /usr/bin/mpiexec /usr/bin/mpicc /usr/bin/mpicxx >>"$deps/openmpi.files"
    tar -chJf "$deps/openmpi.tar.xz" -T "$deps/openmpi.files" 2>/dev/null
  fi
  # Keep the default folder out of git (it travels only when carried).
  local exclude
  if [[ "$deps" == "$root/.gpu-deps" ]] && exclude="$(git -C "$root" rev-parse --git-path info/exclude 2>/dev/null)"; then
    [[ "$exclude" == /* ]] || exclude="$root/$exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.gpu-deps/' "$exclude" 2>/dev/null || echo '/.gpu-deps/' >>"$exclude"
  fi
  say "packed $(du -sh "$deps" | cut -f1) into $deps; carry it to the GPU machine (the device tool's carry: [\".gpu-deps\"])"
}

if [[ "${1:-}" == "pack" ]]; then
  pack
  exit 0
fi
# What to run after the (incremental) build: every part, or the one named, so that each part
# fits a time-limited command on a lent GPU machine.
parts="${1:-test python bench capacity plan}"
case "$parts" in
  build | test | python | bench | capacity | plan | "test python bench capacity plan") ;;
  *) die "usage: $0 [pack|build|test|python|bench|capacity|plan]" ;;
esac
want() { [[ " $parts " == *" $1 "* ]]; }

out="${OUT:-$root/benchmarks/gpu/results}"
mkdir -p "$out"
build="${ZEROSHARD_GPU_BUILD_DIR:-$root/build-gpu}"
jobs="$(nproc)"

# ---- tools -------------------------------------------------------------------------------------
if ! command -v nvcc >/dev/null; then
  [[ -x /usr/local/cuda/bin/nvcc ]] || die "nvcc not found (install the CUDA toolkit or put it on PATH)"
  export PATH="/usr/local/cuda/bin:$PATH"
fi
command -v cmake >/dev/null || die "cmake not found"
cxx="${CXX:-$(command -v g++ || command -v c++ || true)}"
[[ -n "$cxx" ]] || die "no C++ host compiler (g++) found"
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
  else
    echo "nvidia-smi: not found"
  fi
  nvcc --version | tail -2
  "$cxx" --version | head -1
  cmake --version | head -1
} >"$out/env.txt"
cat "$out/env.txt"

# ---- dependencies ------------------------------------------------------------------------------
# Warnings stay warnings here: the GPU machine's compiler may be newer than CI's and warn about
# more, which must not keep the GPU from being measured (CI keeps -Werror).
args=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" -DZEROSHARD_WITH_CUDA=ON -DZEROSHARD_WERROR=OFF
      -DZEROSHARD_BUILD_APPS=ON -DZEROSHARD_BUILD_PYTHON=OFF -DZEROSHARD_BUILD_BENCHMARKS=OFF
      -DZEROSHARD_BUILD_GPU_BENCHMARKS=ON)
if [[ -n "${ZEROSHARD_CUDA_ARCHS:-}" ]]; then args+=("-DCMAKE_CUDA_ARCHITECTURES=$ZEROSHARD_CUDA_ARCHS"); fi
missing=()
tbb_dir="$(ls -d "$deps"/usr/lib/*/cmake/TBB 2>/dev/null | head -1 || true)"
packed_only="${ZEROSHARD_GPU_PACKED_ONLY:-0}"
if [[ "$packed_only" != 1 && ( -f /usr/include/oneapi/tbb.h || -f /usr/local/include/oneapi/tbb.h ) ]]; then
  say "oneTBB: system"
elif [[ -n "$tbb_dir" ]]; then
  say "oneTBB: packed ($tbb_dir)"
  args+=("-DTBB_DIR=$tbb_dir")
else
  missing+=(oneTBB)
fi
if [[ "$packed_only" != 1 && ( -f /usr/include/nlohmann/json.hpp || -f /usr/local/include/nlohmann/json.hpp ) ]]; then
  say "nlohmann_json: system"
elif [[ -d "$deps/usr/share/cmake/nlohmann_json" ]]; then
  say "nlohmann_json: packed"
  args+=("-Dnlohmann_json_DIR=$deps/usr/share/cmake/nlohmann_json")
else
  missing+=(nlohmann_json)
fi
gtest_dir="$(ls -d "$deps"/gtest/lib*/cmake/GTest 2>/dev/null | head -1 || true)"
if [[ "$packed_only" != 1 && -f /usr/include/gtest/gtest.h ]]; then
  say "GoogleTest: system"
elif [[ -n "$gtest_dir" || -d "$deps/googletest-src" ]]; then
  if [[ -z "$gtest_dir" ]]; then
    # Built here with this machine's compiler, so its C++ ABI matches the tests'.
    say "GoogleTest: building the packed source"
    cmake -S "$deps/googletest-src" -B "$deps/gtest-build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_INSTALL_PREFIX="$deps/gtest" >"$out/gtest-build.log" 2>&1 &&
      cmake --build "$deps/gtest-build" -j "$jobs" >>"$out/gtest-build.log" 2>&1 &&
      cmake --install "$deps/gtest-build" >>"$out/gtest-build.log" 2>&1 ||
      die "building GoogleTest failed; see $out/gtest-build.log"
    gtest_dir="$(ls -d "$deps"/gtest/lib*/cmake/GTest | head -1)"
  fi
  say "GoogleTest: packed ($gtest_dir)"
  args+=("-DGTest_DIR=$gtest_dir")
else
  missing+=(GoogleTest)
fi
if ((${#missing[@]})); then
  die "missing: ${missing[*]}. Run 'bash benchmarks/gpu/run_all.sh pack' on a development machine" \
      "(after scripts/setup.sh) and bring the .gpu-deps folder along, or install them here."
fi
# NCCL: the toolkit's, the system's, or the pip wheel's (nvidia-nccl-cu13 ships include/ and lib/).
if [[ -n "${NCCL_ROOT:-}" ]]; then
  say "NCCL: $NCCL_ROOT (NCCL_ROOT)"
  args+=("-DNCCL_ROOT=$NCCL_ROOT")
elif [[ ! -f /usr/local/cuda/include/nccl.h && ! -f /usr/include/nccl.h ]]; then
  nccl_root="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
  [[ -n "$nccl_root" && -f "$nccl_root/include/nccl.h" ]] ||
    die "NCCL not found: neither in the CUDA toolkit nor as python3's nvidia.nccl; set NCCL_ROOT"
  say "NCCL: $nccl_root"
  args+=("-DNCCL_ROOT=$nccl_root")
fi
# Open MPI from the packed archive where the machine has none (see the header).
if ! command -v mpirun >/dev/null && [[ -f "$deps/openmpi.tar.xz" ]]; then
  rm -rf "$deps/openmpi-root" && mkdir -p "$deps/openmpi-root"
  tar -xJf "$deps/openmpi.tar.xz" -C "$deps/openmpi-root"
  cp -rn "$deps/openmpi-root/." / && ldconfig
  say "Open MPI: packed ($(mpirun --version 2>&1 | head -1))"
fi
if ! command -v pkg-config >/dev/null && [[ -x "$deps/pkgconf/pkg-config" ]]; then
  export PATH="$deps/pkgconf:$PATH"
fi
if [[ -f "$deps/usr/include/liburing.h" ]] && ! pkg-config --exists liburing 2>/dev/null; then
  mkdir -p "$deps/pkgconfig"
  lib="$(ls -d "$deps"/usr/lib/*/liburing.so | head -1)"
  cat >"$deps/pkgconfig/liburing.pc" <<PC
Name: liburing
Description: io_uring library (packed)
Version: 2.3
Libs: -L$(dirname "$lib") -luring
Cflags: -I$deps/usr/include
PC
  export PKG_CONFIG_PATH="$deps/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  say "liburing: packed"
fi
mpi=OFF
if command -v mpicxx >/dev/null && command -v mpirun >/dev/null; then mpi=ON; fi
uring=OFF
if pkg-config --exists liburing 2>/dev/null; then uring=ON; fi
args+=("-DZEROSHARD_WITH_MPI=$mpi" "-DZEROSHARD_WITH_URING=$uring")
say "MPI $mpi, io_uring $uring"

# ---- build, test, benchmark --------------------------------------------------------------------
if [[ ! -f "$build/CMakeCache.txt" ]]; then args+=("${generator[@]}"); fi
say "cmake -S . -B $build ${args[*]}"
start=$SECONDS
cmake -S . -B "$build" "${args[@]}" >"$out/build.log" 2>&1 || {
  tail -40 "$out/build.log"
  die "configure failed; see $out/build.log"
}
cmake --build "$build" -j "$jobs" >>"$out/build.log" 2>&1 || {
  tail -60 "$out/build.log"
  die "build failed; see $out/build.log"
}
say "built in $((SECONDS - start)) s"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
status=0
if want test; then
# Verbose, so the log shows every test's output, skips included.
ctest --test-dir "$build" -L gpu -V -j 1 >"$out/ctest-gpu.log" 2>&1 || status=1
tail -25 "$out/ctest-gpu.log"
# A run where the GPU tests skipped proves nothing: say so loudly.
if grep -q "no CUDA GPU on this machine" "$out/ctest-gpu.log" ||
   ! grep -q "100% tests passed" "$out/ctest-gpu.log"; then
  say "WARNING: some GPU tests failed or skipped; see $out/ctest-gpu.log"
fi
fi
if want python; then
# The Python bindings on the GPU (tests/python/test_gpu_torch.py): the extension module built by
# CMake (no pip: the machine has no network) and put into a copy of the package.
if python3 -c 'import torch, nanobind, pytest; assert torch.cuda.is_available()' 2>"$out/python-check.log"; then
  pybuild="$build-python"
  pyargs=("${args[@]}" -DZEROSHARD_BUILD_PYTHON=ON -DZEROSHARD_BUILD_TESTS=OFF -DZEROSHARD_BUILD_APPS=OFF
          -DZEROSHARD_BUILD_GPU_BENCHMARKS=OFF "-DPython_EXECUTABLE=$(command -v python3)")
  if [[ ! -f "$pybuild/CMakeCache.txt" ]]; then pyargs+=("${generator[@]}"); fi
  if cmake -S . -B "$pybuild" "${pyargs[@]}" >"$out/python-build.log" 2>&1 &&
     cmake --build "$pybuild" --target _core -j "$jobs" >>"$out/python-build.log" 2>&1; then
    pkg="$pybuild/package"
    rm -rf "$pkg" && mkdir -p "$pkg"
    cp -r python_bindings/zeroshard "$pkg/"
    cp "$pybuild"/python_bindings/_core*.so "$pkg/zeroshard/"
    PYTHONPATH="$pkg" python3 -m pytest -q tests/python/test_gpu_torch.py >"$out/pytest-gpu.log" 2>&1 || status=1
    tail -15 "$out/pytest-gpu.log"
  else
    status=1
    tail -20 "$out/python-build.log"
    say "building the Python module failed; see $out/python-build.log"
  fi
else
  say "Python GPU tests skipped: $(tail -1 "$out/python-check.log")" | tee "$out/pytest-gpu.log"
fi
fi
if want bench; then
# Fused AdamW on the GPU, then PyTorch's fused AdamW on the same element count, joined into
# zeroshard / torch time ratios (fused_adamw_vs_torch.txt).
adamw_elements=$((1 << 26))
"$build/benchmarks/gpu/fused_adamw_bench" --elements "$adamw_elements" --out "$out/fused_adamw_bench.txt" || status=1
torch_txt="$out/torch_fused_adamw_bench.txt"
if ! command -v python3 >/dev/null; then
  echo "torch_fused_adamw_bench: skipped: python3 not found" | tee "$torch_txt"
elif torch_why="$(python3 -c 'import torch; assert torch.cuda.is_available(), "torch %s (CUDA %s) sees no CUDA GPU" % (torch.__version__, torch.version.cuda)' 2>&1)"; then
  python3 benchmarks/gpu/torch_fused_adamw_bench.py --elements "$adamw_elements" --out "$torch_txt" \
    >"$out/torch_fused_adamw_bench.log" 2>&1 || status=1
  cat "$out/torch_fused_adamw_bench.log"
else
  echo "torch_fused_adamw_bench: skipped: python3 cannot use torch on a GPU: $(echo "$torch_why" | tail -1)" |
    tee "$torch_txt"
fi
if command -v python3 >/dev/null; then
  # Joins the `data: {json}` lines of the two benchmarks by case.
  python3 - "$out/fused_adamw_bench.txt" "$torch_txt" >"$out/fused_adamw_vs_torch.txt" 2>&1 <<'PY' || status=1
import json, sys

def load(path):
    cases = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("data: "):
                    d = json.loads(line[len("data: "):])
                    cases[d["case"]] = d
    except OSError as e:
        print(f"cannot read {path}: {e}")
    return cases

zs, th = load(sys.argv[1]), load(sys.argv[2])
print("# zeroshard fused AdamW (fused_adamw_bench) / torch fused AdamW (torch_fused_adamw_bench.py),")
print("# same element count, both from this run_all.sh invocation (two processes, one after the other).")
print("# time ratio < 1: zeroshard is faster. 'medians': ratio of the two processes' median step times.")
print("# 'copy-normalised': each side's step in units of its own same-bytes D2D copy, alternated round by")
print("# round in its own process (median per-round ratio), rescaled by the bytes each copy stood for;")
print("# it cancels drift between the two processes if copy bandwidth is the same for both sizes.")
missing = 0
for key in ("f32_grad_no_out", "bf16_grad_bf16_out"):
    z, t = zs.get(key), th.get(key)
    if not z or not t:
        print(f"{key}: no ratio: zeroshard figure {'present' if z else 'missing'}, "
              f"torch figure {'present' if t else 'missing'} (see the two benchmarks' files)")
        missing += 1
        continue
    if z["elements"] != t["elements"]:
        print(f"{key}: no ratio: element counts differ ({z['elements']} vs {t['elements']})")
        missing += 1
        continue
    r = z["update_ms"] / t["update_ms"]
    # t_step / t_copy per side, copies scaled to the bytes each stands for.
    rn = (t["copy_over_update"] / z["copy_over_update"]) * (z["bytes_per_element"] / t["bytes_per_element"])
    note = "" if t.get("launch_hidden") else " (torch's time includes Python's launch: no _sleep)"
    print(f"{key}: zeroshard / torch time = {r:.3f} (medians), {rn:.3f} (copy-normalised); "
          f"{z['elements']} elements; zeroshard {z['update_ms']:.3f} ms moving {z['bytes_per_element']:.0f} B/element, "
          f"torch {t['update_ms']:.3f} ms moving {t['bytes_per_element']:.0f} B/element{note}; "
          f"of their own copy bandwidth: zeroshard {z['copy_over_update']:.3f}, torch {t['copy_over_update']:.3f}")
t = th.get("bf16_all")
if t:
    print(f"(reference, not the same math) torch bf16 param/grad/m/v: {t['update_ms']:.3f} ms at "
          f"{t['bytes_per_element']:.0f} B/element, {t['copy_over_update']:.3f} of its copy bandwidth")
# A missing side (torch skipped, a benchmark failed) is reported above and by its own step.
sys.exit(0)
PY
  cat "$out/fused_adamw_vs_torch.txt"
fi
# A host-offloaded step of a 1B-parameter model against its PCIe and CPU-update floors.
"$build/benchmarks/gpu/offload_step_bench" --out "$out/offload_step_bench.txt" >"$out/offload_step_bench.log" 2>&1 ||
  { status=1; say "offload_step_bench failed; see $out/offload_step_bench.log"; }
cat "$out/offload_step_bench.log"
# The demo trainer's tokens/s at stage 0 and 3, and its ledger against ZeRO's formulas.
bash "$root/benchmarks/gpu/demo_throughput.sh" "$build/apps/zeroshard" --out "$out/demo_throughput.txt" \
  >"$out/demo_throughput.log" 2>&1 || { status=1; say "demo_throughput failed; see $out/demo_throughput.log"; }
cat "$out/demo_throughput.log"
fi
if want capacity; then
# The largest model the demo trains on this GPU with host and with nvme offload (the demo builds
# without OpenBLAS or MPI: its model runs on the GPU, one rank).
bash "$root/benchmarks/gpu/demo_capacity.sh" "$build/apps/zeroshard" --out "$out/demo_capacity.txt" \
  --timeout "${ZEROSHARD_CAPACITY_TIMEOUT:-300}" >"$out/demo_capacity.log" 2>&1 ||
  { status=1; say "demo_capacity failed; see $out/demo_capacity.log"; }
cat "$out/demo_capacity.txt" 2>/dev/null || true
fi
if want plan; then
# The planner's GPU step model against the engine on this GPU: the machine calibrated (its CPU,
# the GPU's pinned copies and update, the nvme tier under TMPDIR), then each configuration's
# measured step beside predict_step()'s from that file.
nv="${TMPDIR:-/tmp}/zeroshard-plan-nvme"
mkdir -p "$nv"
launch=()
if [[ $mpi == ON ]]; then launch=(mpirun -np 1); fi
cal="$out/calibration-gpu.json"
"${launch[@]}" "$build/apps/zeroshard" calibrate --device cuda --nvme-path "$nv" --out "$cal" \
  >"$out/plan_gpu.log" 2>&1 || { status=1; say "calibrate failed; see $out/plan_gpu.log"; }
cat "$out/plan_gpu.log"
bench="$(find "$build/benchmarks" -name plan_step_bench -type f | head -1)"
if [[ -z "$bench" ]]; then
  say "plan_step_bench not built (it needs MPI)" | tee "$out/plan_gpu.txt"
else
  : >"$out/plan_gpu.txt"
  for c in "1 device device" "2 device device" "3 device device" "1 host device" "2 host device" \
           "3 host device" "3 host host" "2 nvme device" "3 nvme nvme"; do
    read -r st opt par <<<"$c"
    "${launch[@]}" "$bench" --device cuda --calibration "$cal" --params 128M --units 16 --steps 5 \
      --stage "$st" --tier "$opt" --param-tier "$par" --nvme-path "$nv" \
      >>"$out/plan_gpu.txt" 2>>"$out/plan_gpu.log" || { status=1; say "plan_step_bench $c failed"; }
  done
  cat "$out/plan_gpu.txt"
fi
rm -rf "$nv"
fi
say "results in $out: $(cd "$out" && ls | tr '\n' ' ')"
exit $status
