"""The Python example of docs/python.md, extracted and run on 2 ranks, so it cannot go stale."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}


def example():
    text = PAGE.read_text()
    m = re.search(r"<!-- python-example:begin -->\s*```python\n(.*?)```\s*<!-- python-example:end -->",
                  text, re.S)
    assert m, "docs/python.md has no python-example block"
    return m.group(1)


def test_readme_example_trains_on_two_ranks(tmp_path):
    (tmp_path / "train.py").write_text(example())
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun is not on PATH (scripts/setup.sh installs openmpi-bin)"
    env = dict(os.environ, **MPI_ENV)
    r = subprocess.run([mpirun, "-np", "2", sys.executable, "train.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "step   0  loss" in r.stdout and "optim_state" in r.stdout
    assert (tmp_path / "checkpoint.rank0.pt").exists() and (tmp_path / "checkpoint.rank1.pt").exists()


LEAKED = """
import ctypes, sys
import torch
import zeroshard.torch as zt

stage = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = zt.ZeroOptimizer(model, stage=stage, lr=1e-2)
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
# Whatever a script leaves alive: here a reference the interpreter never drops, so neither the
# optimizer nor its engine and communicator are ever freed.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(opt))
print("trained", opt.engine.step_count())
"""


def test_a_script_that_leaves_its_optimizer_alive_exits_cleanly(tmp_path):
    # MPI is finalised at interpreter exit even when the optimizer (and so its engine and MPI
    # communicator) is never freed; else mpirun fails the job ("exited without calling
    # finalize") though the script ended normally.
    (tmp_path / "leak.py").write_text(LEAKED)
    env = dict(os.environ, **MPI_ENV)
    for stage in (0, 2, 3):
        r = subprocess.run([shutil.which("mpirun"), "-np", "2", sys.executable, "leak.py",
                            str(stage)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"stage {stage}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        assert r.stdout.count("trained") == 2, r.stdout  # the ranks' lines may interleave
