"""pytest set-up for zeroshard's Python tests.

Single-process tests run as plain `pytest tests/python --ignore=tests/python/mpi`; the tests in
mpi/ run on every rank of `mpirun -np 2 python -m pytest tests/python/mpi`. Under mpirun only
rank 0 reports in full (other ranks print failures only), and the ranks agree on the outcome
at the end so that a failure on any rank fails every rank, and so mpirun.
"""

import array
import os
import sys

import pytest

# zs_testutil.py sits beside this file; tests in mpi/ import it too.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zeroshard  # noqa: E402

_UNDER_MPI = zeroshard.launch_info()["launcher"] in ("mpirun", "srun")


_RANK = zeroshard.launch_info()["rank"] if _UNDER_MPI else 0


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if _RANK != 0:
        # Other ranks print only their failures (below); rank 0 reports as usual.
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_runtest_logreport(report):
    if _RANK != 0 and report.failed:
        print(f"[rank {_RANK}] FAILED {report.nodeid} ({report.when}):\n{report.longreprtext}",
              file=sys.stderr, flush=True)


def pytest_sessionfinish(session, exitstatus):
    if not _UNDER_MPI:
        return
    comm = zeroshard.default_communicator()
    # "No tests ran" (5) is a failure too: every rank must have run the suite.
    flag = array.array("d", [0.0 if exitstatus == 0 else 1.0])
    comm.all_reduce(flag, "max", "test outcome")
    if flag[0] > 0 and exitstatus == 0:
        session.exitstatus = 1
        print(f"[rank {comm.rank()}] another rank failed", file=sys.stderr)
