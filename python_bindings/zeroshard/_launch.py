"""How this process was launched, and the communicator that follows from it.

zeroshard's collectives run over MPI, so a multi-rank job is started with mpirun (Open MPI or
an MPICH-style launcher); a plain `python script.py` is one rank with no MPI at all. torchrun
starts its processes without MPI: they cannot join one MPI world, so that launch is refused
with a message saying what to run instead, rather than each process silently training alone.
"""

import atexit
import os

from . import _core

# Variables the MPI launchers set in every process they start.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")

_default = None


def _env_int(names):
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return None


def launch_info():
    """{'launcher': 'mpi' | 'torchrun' | 'none', 'rank': int, 'world_size': int} from the
    environment, without starting anything."""
    if any(n in os.environ for n in _MPI_SIZE_VARS + _MPI_RANK_VARS):
        size = _env_int(_MPI_SIZE_VARS)
        return {"launcher": "mpi", "rank": _env_int(_MPI_RANK_VARS) or 0,
                "world_size": size if size is not None else 1}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return {"launcher": "torchrun", "rank": _env_int(("RANK",)) or 0,
                "world_size": _env_int(("WORLD_SIZE",)) or 1}
    return {"launcher": "none", "rank": 0, "world_size": 1}


def default_communicator():
    """The process-wide communicator: MPI_COMM_WORLD under mpirun, one rank otherwise.

    Created once and reused, because MPI can be initialised only once per process. It is
    dropped at interpreter exit so MPI is finalised as soon as no engine still uses it.
    Raises CommunicationError under a multi-process torchrun launch (see the module doc)."""
    global _default
    if _default is not None:
        return _default
    info = launch_info()
    if info["launcher"] == "torchrun" and info["world_size"] > 1:
        raise _core.CommunicationError(
            "zeroshard needs an MPI launcher: torchrun started this process as rank "
            f"{info['rank']} of {info['world_size']} (RANK/WORLD_SIZE), but zeroshard's "
            "collectives run over MPI and torchrun's processes cannot join one MPI world. "
            f"Launch with `mpirun -np {info['world_size']} python your_script.py` instead "
            "(as root add --allow-run-as-root).")
    if info["launcher"] == "mpi":
        comm = _core.make_mpi_communicator()
        if comm.size() != info["world_size"] and any(
                n in os.environ for n in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
            raise _core.CommunicationError(
                f"MPI reports {comm.size()} ranks but the launcher announced "
                f"{info['world_size']}: the MPI library zeroshard was built with is not the "
                "one of the mpirun that started this process")
    else:
        comm = _core.make_self_communicator()
    _default = comm
    return comm


@atexit.register
def _drop_default():
    global _default
    _default = None
