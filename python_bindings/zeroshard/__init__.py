"""zeroshard: ZeRO sharding and offload for training large models.

The names here mirror the C++ API (include/zeroshard/*.hpp): Config and its option structs,
Engine, Communicator (make_mpi_communicator / make_self_communicator), MemoryReport, and one
exception class per zeroshard::ErrorCode, all derived from zeroshard.Error. PyTorch users want
zeroshard.torch.ZeroOptimizer.

Tensors cross by DLPack (or the buffer protocol) without copies: the views Engine returns wrap
engine memory (torch.from_dlpack / numpy.from_dlpack; CUDA arrays when Config.device is cuda),
and tensors passed in must be contiguous CPU tensors of the right dtype (gradients may also be
CUDA tensors on a GPU engine's device) -- anything else raises InvalidArgumentError instead of
being copied. Blocking and computing calls release the GIL.
"""

from . import _core
from ._core import (  # noqa: F401  (re-exported API)
    AioOptions,
    CollectiveTimeoutError,
    CommunicationError,
    Communicator,
    Config,
    ConfigError,
    CorruptedDataError,
    CudaError,
    Device,
    DType,
    Engine,
    Error,
    GradientOverflowError,
    InternalError,
    InvalidArgumentError,
    LossScaleOptions,
    LossScalerState,
    MemKind,
    MemoryReport,
    ModelMismatchError,
    NamedBuffer,
    NoSpaceError,
    OffloadOptions,
    OptimizerKind,
    OptimizerOptions,
    Param,
    ShardInfo,
    SpeculativeStep,
    StateFormat,
    StateKind,
    StepResult,
    StorageError,
    Tier,
    describe_checkpoint,
    dtype_size,
    export_checkpoint,
    make_mpi_communicator,
    make_nccl_communicator,
    make_self_communicator,
    plan_memory,
    verify_checkpoint,
    version,
)
from ._launch import default_communicator, launch_info, store_communicator  # noqa: F401
from .plan import Estimate, estimate  # noqa: F401

__version__ = _core.__version__

__all__ = [
    "AioOptions",
    "CollectiveTimeoutError",
    "CommunicationError",
    "Communicator",
    "Config",
    "ConfigError",
    "CorruptedDataError",
    "CudaError",
    "DType",
    "Device",
    "Engine",
    "Error",
    "InternalError",
    "InvalidArgumentError",
    "LossScaleOptions",
    "MemKind",
    "MemoryReport",
    "ModelMismatchError",
    "NamedBuffer",
    "NoSpaceError",
    "OffloadOptions",
    "OptimizerKind",
    "OptimizerOptions",
    "Param",
    "ShardInfo",
    "SpeculativeStep",
    "StateFormat",
    "StateKind",
    "StepResult",
    "StorageError",
    "Tier",
    "Estimate",
    "default_communicator",
    "estimate",
    "describe_checkpoint",
    "dtype_size",
    "export_checkpoint",
    "launch_info",
    "make_mpi_communicator",
    "make_nccl_communicator",
    "make_self_communicator",
    "plan_memory",
    "store_communicator",
    "verify_checkpoint",
    "version",
]
