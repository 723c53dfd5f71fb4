"""How this process was launched, and the communicator that follows from it.

- mpirun (Open MPI, or an MPICH-style launcher) and Slurm's `srun --mpi=pmix`: the ranks form
  one MPI world; collectives run over MPI (the engine stages GPU tensors through host memory).
- torchrun, on GPUs: no MPI at all. The ranks find each other through torch.distributed's store
  (the one torchrun's agent serves, or the default process group's), which carries NCCL's unique
  id; collectives then run over NCCL, one GPU per rank.
- torchrun on CPUs: refused with what to run instead, rather than each process silently
  training alone (zeroshard's CPU collectives need MPI).
- a plain `python script.py`: one rank, no MPI.
"""

import atexit
import datetime
import sys

from . import _core

_default = {}


# Registered first, so it runs last of zeroshard's exit handlers (atexit runs them in reverse):
# MPI is finalised even when the script leaves an optimizer alive (its parameters hold the
# engine's memory, and the engine its communicator), which the interpreter may never free.
# Without it the process would end without MPI_Finalize, and mpirun would fail the job.
atexit.register(_core.finalize_mpi)


def launch_info():
    """{'launcher': 'mpirun' | 'srun' | 'torchrun' | 'none', 'rank', 'world_size',
    'local_rank', 'local_size', 'mpi_world'} from the launcher's environment, without starting
    anything. mpi_world is False where MPI cannot join the processes into one world (torchrun,
    srun without a PMI plugin)."""
    li = _core.launch_info()
    return {k: getattr(li, k) for k in ("launcher", "rank", "world_size", "local_rank",
                                        "local_size", "mpi_world")}


def torchrun_store(timeout_s=300.0):
    """torch.distributed's store of this torchrun job: the default process group's if one is
    initialised, else the one torchrun's environment points to (MASTER_ADDR/MASTER_PORT, or
    the agent's store). zeroshard's keys start with 'zeroshard/'."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    return store


def _try_get(store, key):
    # The value, or None while no rank has set it, without blocking: Store.check() where torch
    # has it; where it lacks one (Debian's torch 1.13), compare_set with an expected value no
    # key holds (values are hex), which returns the stored value if there is one, and else the
    # expected one, storing nothing. (A wait() that times out would leave the store's socket out
    # of step with its replies.)
    if hasattr(store, "check"):
        return store.get(key).decode() if store.check([key]) else None
    v = store.compare_set(key, "-", "-").decode()
    return None if v == "-" else v


def store_communicator(store, rank, size):
    """A Communicator whose collectives go through `store` (a torch.distributed Store): for
    set-up, such as NCCL's bootstrap; every value passes through the store's server."""
    return _core.make_store_communicator(
        lambda k, v: store.set(k, v),
        lambda k: _try_get(store, k),
        lambda k: store.delete_key(k),
        rank, size)


def _abort_job_on_uncaught_exception():
    """An exception that ends this rank's script ends the MPI job (after the traceback is
    printed), as `python -m mpi4py` does: otherwise the interpreter's exit runs MPI_Finalize,
    which waits for the other ranks, while they wait in a collective for this one until their
    timeout (collective_timeout_s, 300 s by default). The previous hook still runs first."""
    previous = sys.excepthook
    if getattr(previous, "_zeroshard_aborts", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if not issubclass(kind, KeyboardInterrupt):
            sys.stderr.flush()
            _core.abort_mpi_job(1)
    hook._zeroshard_aborts = True
    sys.excepthook = hook


def default_communicator(device=None):
    """The process-wide communicator for tensors on `device` (a torch.device, or None for CPU):
    MPI_COMM_WORLD under mpirun or srun, NCCL bootstrapped through torch.distributed's store
    under torchrun on a GPU, one rank otherwise.

    Created once per device and reused (MPI can be initialised only once per process), and
    dropped at interpreter exit so MPI is finalised as soon as no engine still uses it.
    Raises CommunicationError under a multi-process torchrun launch on CPU, and under an srun
    without a PMI plugin (see the module doc)."""
    cuda = device is not None and getattr(device, "type", None) == "cuda"
    info = launch_info()
    key = ("cuda", device.index) if cuda and info["launcher"] == "torchrun" else "host"
    if key in _default:
        return _default[key]
    if info["launcher"] == "torchrun" and info["world_size"] > 1:
        if not cuda:
            raise _core.CommunicationError(
                "zeroshard needs an MPI launcher for CPU training: torchrun started this "
                f"process as rank {info['rank']} of {info['world_size']} (RANK/WORLD_SIZE), but "
                "zeroshard's CPU collectives run over MPI and torchrun's processes cannot join "
                f"one MPI world. Launch with `mpirun -np {info['world_size']} python "
                "your_script.py` instead (as root add --allow-run-as-root); on GPUs torchrun "
                "works (NCCL, bootstrapped through torch.distributed's store).")
        index = device.index if device.index is not None else info["local_rank"]
        boot = store_communicator(torchrun_store(), info["rank"], info["world_size"])
        comm = _core.make_nccl_communicator(index, boot)
    elif info["launcher"] in ("mpirun", "srun"):
        # Refuses an srun without PMI, and a launcher of another MPI library, by name.
        comm = _core.make_mpi_communicator()
        if comm.size() > 1:
            _abort_job_on_uncaught_exception()
    else:
        comm = _core.make_self_communicator()
    _default[key] = comm
    return comm


@atexit.register
def _drop_default():
    _default.clear()
