"""Launchers other than mpirun, for real: torchrun starts two processes that find each other
through torch.distributed's store, the store communicator's collectives give the right results,
CPU training is refused with what to run instead, and the GPU path (NCCL bootstrapped through
the store) reaches the device check on every rank. srun is tested by tests/launch/."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import zeroshard as zs  # noqa: E402

WORKER = textwrap.dedent("""
    import torch
    import zeroshard as zs
    from zeroshard import _launch

    info = zs.launch_info()
    assert info["launcher"] == "torchrun" and info["world_size"] == 2, info
    assert info["local_rank"] == info["rank"] and info["local_size"] == 2, info
    assert not info["mpi_world"], info
    comm = zs.store_communicator(_launch.torchrun_store(), info["rank"], info["world_size"])
    r, n = comm.rank(), comm.size()
    assert (r, n) == (info["rank"], 2)
    v = torch.tensor([r + 1.0, -r, 0.5 * r], dtype=torch.float64)
    comm.all_reduce(v, "sum")
    assert v.tolist() == [3.0, -1.0, 0.5], v
    m = torch.tensor([float(r)], dtype=torch.float64)
    comm.all_reduce(m, "max")
    assert m.item() == 1.0
    blob = torch.zeros(64, dtype=torch.uint8)
    if r == 1:
        blob[:] = torch.arange(64, dtype=torch.uint8) * 3
    comm.broadcast(blob, root=1)
    assert blob.tolist() == [(3 * i) % 256 for i in range(64)]
    g = torch.zeros(2 * 3, dtype=torch.float32)
    comm.all_gather(torch.full((3,), float(r + 10)), g)
    assert g.tolist() == [10.0] * 3 + [11.0] * 3, g
    comm.barrier()

    try:
        zs.default_communicator()
        raise SystemExit("CPU training under torchrun was not refused")
    except zs.CommunicationError as e:
        assert "mpirun -np 2" in str(e), e

    # The GPU path: the store carries NCCL's set-up. Without a GPU every rank stops at the
    # device check, which itself went through the store; with one, the communicator is made.
    try:
        c = zs.default_communicator(torch.device("cuda", info["local_rank"]))
        print(f"rank {r}: NCCL ok size {c.size()}")
    except Exception as e:
        print(f"rank {r}: NCCL error {type(e).__name__}: {e}")
    print(f"rank {r}: done")
""")


def test_torchrun_store_bootstrap(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX", "PMI_"))}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2",
                        # stdout to a log file and the console alike, stderr to the console:
                        # Debian's torch 1.13 cannot parse its default "0" (nor "3") under
                        # Python 3.11, whose flag enums list single bits only.
                        "--redirects", "1", "--tee", "1", "--log_dir", str(tmp_path / "logs"),
                        str(script)],
                       env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: done" in out, out
        line = next(x for x in out.splitlines() if f"rank {rank}: NCCL" in x)
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            assert "NCCL ok size 2" in line, line
        else:
            # No GPU here (or a build without CUDA): a CUDA error on this rank, not a hang.
            assert "NCCL error" in line and "CUDA" in line, line


def test_an_uncaught_exception_on_one_rank_ends_the_mpi_job(tmp_path):
    # Without the abort, rank 1's interpreter would wait in MPI_Finalize for rank 0, which waits
    # in its barrier for rank 1 until the collective timeout (300 s by default).
    import shutil
    import time
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun on this machine")
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(textwrap.dedent("""
        import zeroshard as zs
        comm = zs.default_communicator()
        if comm.rank() == 1:
            raise ValueError("rank 1 found no data")
        comm.barrier("waits for rank 1")
    """))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none")
    start = time.monotonic()
    r = subprocess.run(["mpirun", "-np", "2", sys.executable, str(script)], env=env,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert r.returncode != 0
    assert "rank 1 found no data" in r.stderr + r.stdout
    assert took < 60, f"the job took {took:.0f} s to end"
