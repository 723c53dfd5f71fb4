"""What a model would hold per rank under every ZeRO stage and offload choice, before training.

    est = zeroshard.estimate(model, world=8, ranks_per_node=8, device_gib=80, host_gib=1024)
    print(est)          # a table, DeepSpeed's estimator beside it where it has an answer
    est.rows            # the same as a list of dicts

Each row comes from zeroshard.plan_memory(): the engine's own setup run with nothing allocated,
so its bytes are what that engine's memory() will report (rank 0, or the larger of the first and
last rank). The model is cut into units as ZeroOptimizer cuts it (zeroshard.torch's
partition_units), or given as a list of (name, [Param, ...]) units. Activations and the
trainer's own memory come on top. device="cuda" plans GPU engines, with their staging buffers
on the GPU and in pinned host memory. Stage 3 plans the default max_live_units gather buffers;
ZeroOptimizer raises that number for modules nested inside other units' modules.

DeepSpeed's estimate_zero2/3_model_states_mem_needs answer per GPU and per node, from the
parameter count (and the largest layer) alone: they leave out padding, the gradient staging and
gather buffers, the nvme tier and its swap reserve, and replace them by an
additional_buffer_factor of 1.5 on the host side. Their answers are shown beside the plan where
they apply (stages 2 and 3 with the optimizer on the GPU or the CPU), with that factor.
"""
from dataclasses import dataclass, field

from . import _core

_GIB = float(1 << 30)


@dataclass
class Estimate:
    """Rows of bytes per rank, one per stage and offload choice (see the module doc)."""
    parameters: int
    largest_unit: int
    world: int
    ranks_per_node: int
    rows: list = field(default_factory=list)

    def __str__(self):
        head = (f"{self.parameters / 1e9:.3f} G parameters (largest unit {self.largest_unit / 1e6:.2f} M) "
                f"on {self.world} rank(s), {self.ranks_per_node} per node; GiB per rank")
        lines = [head, "",
                 f"{'stage':<5} {'optimizer':<9} {'params':<7} {'device':>9} {'host':>9} "
                 f"{'nvme':>9} {'states':>9}  {'fits':<12} {'step s':>8} "
                 f"deepspeed (gpu per rank, cpu per node)"]
        for r in self.rows:
            ds = r["deepspeed"]
            ds = f"{ds['gpu'] / _GIB:9.3f} {ds['cpu'] / _GIB:9.3f}" if ds else ""
            fits = {None: "-", True: "yes"}.get(r["fits"], f"no ({r['fits']})")
            step = f"{r['step']['total_s']:8.3f}" if r.get("step") else f"{'-':>8}"
            lines.append(f"{r['stage']:<5} {r['optimizer']:<9} {r['params']:<7} "
                         f"{r['device'] / _GIB:9.3f} {r['host'] / _GIB:9.3f} "
                         f"{r['nvme'] / _GIB:9.3f} {r['model_states'] / _GIB:9.3f}  {fits:<12} "
                         f"{step} {ds}")
        return "\n".join(lines)


def _units_of(model, unit_numel, muon=False):
    """(units, dtype) of a torch module as ZeroOptimizer registers it, or of a unit list. With
    muon, a module's matrices are in group 0 (Muon's) and the rest in group 1 (AdamW's), as
    ZeroOptimizer(optimizer="muon") splits a model by default."""
    if isinstance(model, (list, tuple)):
        return list(model), None
    from .torch import _TORCH_DTYPES, partition_units  # torch only when given a torch model
    units = []
    dtypes = set()
    for name, _, named in partition_units(model, unit_numel):
        units.append((name, [_core.Param(n, shape=list(p.shape),
                                         group=int(muon and p.dim() < 2)) for n, p in named]))
        dtypes.update(p.dtype for _, p in named)
    if len(dtypes) != 1 or next(iter(dtypes)) not in _TORCH_DTYPES:
        raise _core.InvalidArgumentError(
            f"estimate(): the trainable parameters must share one dtype of float32, bfloat16 or "
            f"float16, got {sorted(str(d) for d in dtypes)}")
    return units, _TORCH_DTYPES[next(iter(dtypes))]


def _deepspeed(stage, opt, par, total, largest, world, per_node):
    """DeepSpeed 0.14's estimate_zero2/3_model_states_mem_needs (zero_init on), where they apply."""
    if stage not in (2, 3) or opt == "nvme" or par == "nvme":
        return None
    nodes = max(1, world // per_node)
    offload = opt == "host"
    if stage == 2:
        if offload:
            return {"gpu": 2 * total, "cpu": total * max(4 * world, 16) * 1.5}
        return {"gpu": 2 * total + int(18 * total / world), "cpu": total * 4 * per_node * 1.5}
    layer = 4 * largest
    if offload and par == "host":
        return {"gpu": layer, "cpu": total * 18 / nodes * 1.5}
    if offload:
        return {"gpu": layer + int(2 * total / world), "cpu": total * 16 / nodes * 1.5}
    if par == "host":
        return None
    return {"gpu": layer + int(18 * total / world), "cpu": largest * 4 * per_node * 1.5}


def estimate(model, world=1, *, ranks_per_node=None, dtype=None, optimizer="adamw",
             optimizer_state="f32", bf16_master=False, unit_numel=1 << 25, device_gib=None,
             host_gib=None, nvme_gib=None, calibration=None, compute_s=0.0, device="cpu",
             memory_gbs=None, disk_gbs=None, bus_gbs=None, pcie_gbs=None, gpu_update_gps=None,
             ns_gflops=None):
    """An Estimate of `model` (a torch.nn.Module, or a list of (name, [Param]) units) on `world`
    ranks: for every stage and offload choice, the bytes one rank holds on each tier once the
    engine is finalized, and whether they fit the GiB given per rank. dtype: the parameters'
    (a module's own by default, else "bf16"); optimizer: "adamw", "adam", "lion", "sgd" or
    "muon" (a module's matrices Muon's, the rest AdamW's, as ZeroOptimizer splits it; in a unit
    list, group 1 is AdamW's); optimizer_state ("f32", "bf16", "8bit") and bf16_master as
    Config takes them.
    With rates, each row's "step" is the engine's predicted step in seconds, split
    (zeroshard::predict_step(); compute_s, the trainer's own forward and backward, is taken as
    given and hides what communication it can). The rates: calibration, a file
    `zeroshard calibrate` wrote (with as many ranks per node), and typed ones standing in for
    what it did not measure or overriding it: memory_gbs (a rank's memory bandwidth: the CPU
    update), disk_gbs (a rank's share of its disks, reads and writes together: the nvme tier),
    bus_gbs (the collectives' bus bandwidth, as nccl-tests report it).
    device="cuda" plans GPU engines (one GPU per rank, its memory the device tier): their
    staging on the GPU and in pinned host memory, and only the choices a GPU engine takes. Their
    step takes the GPU's rates from a calibration made with `zeroshard calibrate --device cuda`,
    or typed: pcie_gbs (pinned copies, GB/s each way), gpu_update_gps (the update in GPU memory,
    G params/s); on more than one rank the collectives need bus_gbs (a calibration's
    collectives are the host's). Each step then has pcie_s, the host-GPU copies it waits for.
    With Muon, ns_gflops types its Newton-Schulz iteration's rate on one rank (GFLOP/s; a
    calibration measures it), and each step's newton_schulz_s is the iteration, part of its
    optimizer_s."""
    muon = optimizer == "muon"
    units, model_dtype = _units_of(model, unit_numel, muon)
    if not units:
        raise _core.InvalidArgumentError("estimate(): the model has no trainable parameters")
    per_node = ranks_per_node or world
    numels = [sum(int(_numel(p.shape)) for p in ps) for _, ps in units]
    est = Estimate(parameters=sum(numels), largest_unit=max(numels), world=world,
                   ranks_per_node=per_node)
    limits = {"device": device_gib, "host": host_gib, "nvme": nvme_gib}
    cfg = _core.Config(dtype=dtype or model_dtype or "bf16", optimizer={"kind": optimizer},
                       optimizer_state=optimizer_state, bf16_master=bf16_master, device=device)
    gpu = {"pcie_gbs": pcie_gbs, "gpu_update_gps": gpu_update_gps}
    if device != "cuda" and any(v is not None for v in gpu.values()):
        raise _core.InvalidArgumentError(
            f"estimate(): {', '.join(k for k, v in gpu.items() if v is not None)} are a GPU's: "
            f"they need device=\"cuda\"")
    if ns_gflops is not None and not muon:
        raise _core.InvalidArgumentError("estimate(): ns_gflops is Muon's: it needs optimizer=\"muon\"")
    typed = dict(gpu, memory_gbs=memory_gbs, disk_gbs=disk_gbs, bus_gbs=bus_gbs, ns_gflops=ns_gflops)
    timed = bool(calibration) or any(v is not None for v in typed.values())
    if device == "cuda" and timed and world > 1 and not bus_gbs:
        raise _core.InvalidArgumentError(
            f"estimate(): device=\"cuda\" on {world} ranks times the GPUs' collectives at "
            f"bus_gbs (their bus bandwidth, as nccl-tests report it): a calibration's "
            f"collectives are the host's")
    groups = [_core.OptimizerOptions(kind="adamw")] if muon else []
    for r in _core.plan_choices(cfg, units, world, groups, calibration=str(calibration or ""),
                                compute_s=float(compute_s),
                                **{k: float(v or 0) for k, v in typed.items()}):
        over = [t for t in ("device", "host", "nvme") if limits[t] and r[t] / _GIB > limits[t]]
        r["fits"] = None if not any(limits.values()) else (over[0] if over else True)
        r["deepspeed"] = _deepspeed(r["stage"], r["optimizer"], r["params"], est.parameters,
                                    est.largest_unit, world, per_node)
        est.rows.append(r)
    return est


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
