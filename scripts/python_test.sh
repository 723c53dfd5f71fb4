#!/usr/bin/env bash
# Builds and installs the `zeroshard` Python package into .venv and runs the Python tests: the
# single-process suite, then tests/python/mpi on 2 ranks under mpirun. Exits non-zero if
# anything fails, including a suite that ran no test (pytest's exit code 5).
#
# The interpreter is Debian's /usr/bin/python3 on purpose (not whatever python3 is first on
# PATH): its python3-torch comes from apt (scripts/setup.sh), and the venv sees it through
# --system-site-packages. Environment: ZEROSHARD_JOBS (build parallelism, default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh  # python3-torch, python3-venv, python3-dev, python3-pytest, Open MPI

python=/usr/bin/python3
venv=.venv
if [[ ! -x "$venv/bin/python" ]]; then
  echo "python: creating $venv from $python"
  "$python" -m venv --system-site-packages "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

# The build requirements live in the venv so that later runs build incrementally (the build
# directory is build-wheel/, see pyproject.toml) and without reaching PyPI; a plain
# `pip install .` fetches the same ones into an isolated environment instead.
if ! "$venv/bin/python" -c "import scikit_build_core, nanobind" 2>/dev/null; then
  echo "python: installing the build requirements (scikit-build-core, nanobind)"
  "${pip[@]}" install "scikit-build-core>=0.10" "nanobind>=2.9,<4"
fi
# The safetensors package reads the files `zeroshard ckpt export` writes (a test checks it).
if ! "$venv/bin/python" -c "import safetensors" 2>/dev/null; then
  echo "python: installing safetensors (the export test reads its files with it)"
  "${pip[@]}" install "safetensors>=0.4"
fi
echo "python: pip install ."
CMAKE_BUILD_PARALLEL_LEVEL="${ZEROSHARD_JOBS:-2}" \
  "${pip[@]}" install --root-user-action=ignore --no-build-isolation .

# mpirun as root, more ranks than cores, no CMA single-copy (see scripts/test.sh).
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

# Runs one pytest invocation; "no tests ran" is a failure here, not a pass.
run() {
  local rc=0
  "$@" || rc=$?
  if ((rc == 5)); then
    echo "python: no tests ran: $*" >&2
  fi
  return "$rc"
}

echo "python: single-process tests"
run "$venv/bin/python" -m pytest tests/python --ignore=tests/python/mpi -q --color=no
echo "python: 2-rank tests (mpirun -np 2)"
run timeout 900 mpirun -np 2 "$venv/bin/python" -m pytest tests/python/mpi -q --color=no
# The torch integration again on the asynchronous CPU device (ZEROSHARD_ASYNC_DEVICE=1): the
# GPU's staged tiers, copies and waits on stream threads, collectives ordered as NCCL orders
# them, with the same assertions.
echo "python: torch, engine and Muon tests on the asynchronous CPU device"
ZEROSHARD_ASYNC_DEVICE=1 run "$venv/bin/python" -m pytest tests/python/test_torch.py \
  tests/python/test_engine.py tests/python/test_muon.py -q --color=no
ZEROSHARD_ASYNC_DEVICE=1 run timeout 900 mpirun -x ZEROSHARD_ASYNC_DEVICE -np 2 \
  "$venv/bin/python" -m pytest tests/python/mpi -q --color=no
echo "python: under Slurm's srun (tests/launch)"
rc=0
bash tests/launch/run_slurm_test.sh --python "$venv/bin/python" || rc=$?
if ((rc == 77)); then echo "python: srun test skipped (see above)"; elif ((rc != 0)); then exit "$rc"; fi

# The same single-process suite and the 2-rank examples on the current PyTorch from PyPI, in a
# venv of its own (Debian's torch above is the oldest version the README supports). The package
# built above is put on its path as it is: same interpreter, same extension. The first run
# downloads torch (a CUDA build, several GB; pip caches it); later runs reuse the venv.
torch_pypi="${ZEROSHARD_TORCH_PYPI:-2.15.0}"
venv2=.venv-torch2
if [[ "$torch_pypi" != "none" ]]; then
  if [[ ! -x "$venv2/bin/python" ]]; then
    echo "python: creating $venv2 (torch $torch_pypi from PyPI)"
    "$python" -m venv "$venv2"
  fi
  if ! "$venv2/bin/python" -c "import torch, numpy, pytest, safetensors, transformers
assert torch.__version__.split('+')[0] == '$torch_pypi'" 2>/dev/null; then
    echo "python: installing torch $torch_pypi into $venv2"
    "$venv2/bin/python" -m pip --disable-pip-version-check -q install "torch==$torch_pypi" \
      numpy pytest "safetensors>=0.4" "transformers>=5"
  fi
  pkg="$("$venv/bin/python" -c 'import os, zeroshard; print(os.path.dirname(zeroshard.__file__))')"
  path2="$(mktemp -d)"
  ln -s "$pkg" "$path2/zeroshard"
  echo "python: single-process tests and the 2-rank examples on torch $torch_pypi"
  PYTHONPATH="$path2" run "$venv2/bin/python" -m pytest tests/python --ignore=tests/python/mpi \
    -q --color=no
  echo "python: 2-rank tests on torch $torch_pypi (mpirun -np 2)"
  PYTHONPATH="$path2" run timeout 900 mpirun -x PYTHONPATH -np 2 "$venv2/bin/python" -m pytest \
    tests/python/mpi -q --color=no
  rm -rf "$path2"
fi
