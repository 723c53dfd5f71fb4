"""zeroshard.torch: ZeRO sharding and offload for an ordinary PyTorch training loop.

    opt = zeroshard.torch.ZeroOptimizer(model, stage=2, lr=3e-4, offload_optimizer="cpu")
    for x, y in data:                    # this rank's share of the global batch
        opt.zero_grad()
        loss = loss_fn(model(x), y)      # the mean over this rank's micro-batch
        loss.backward()                  # each unit's reduction starts as its gradients are ready
        opt.step()

Launch with `mpirun -np N python train.py` (or plain `python train.py` for one rank).

Devices. The model's trainable parameters are all on the CPU, or all on one CUDA device (which
needs zeroshard built with ZEROSHARD_WITH_CUDA=ON). On a GPU the engine runs with Config.device
cuda and device_index = the parameters' device, its parameter and gradient buffers are GPU
memory, and it issues its work on torch's current stream of that device at construction (the
default stream unless the caller set another; Engine.set_stream()): run the model's forward and
backward on that stream, as torch does by default, so that the engine's kernels and copies are
ordered after the ones that write gradients and before the ones that read parameters. Initial
values are copied to the host once for finalize(); frozen parameters and buffers are the
model's own. Collectives between ranks then go through host memory (the MPI communicator, with
the engine staging device buffers), a path that works on any machine but is not fast.

How it maps onto the engine
---------------------------
Units. One unit per top-level child module of the model (its parameters, recursively); a child
with more than `unit_numel` trainable elements is split into its own children (its direct
parameters then form a unit of their own), and parameters directly on the model form a unit
"<root>". A ModuleList or ModuleDict is never a unit (it is never called, so its hooks could
not fire): its children are, as if they were the model's; a ParameterList or ParameterDict
belongs to its parent's unit. An nn.MultiheadAttention is one unit whatever its size (its
forward reads out_proj's weight itself). `units=[module, ...]` sets the boundaries by hand
instead (parameters outside them form the unit "<rest>", attached to the model). Only
parameters with requires_grad=True are managed; frozen ones stay ordinary tensors, and
requires_grad must not change afterwards (step() refuses it, naming the parameter).

Parameters. The engine owns parameter memory. In stages 0-2 each parameter's .data becomes a
view of the engine's whole-parameter buffer (DLPack, no copy), which step() updates in place.
In stage 3 a parameter exists only while its unit is gathered: a forward pre-hook on the unit's
module gathers it and a forward hook releases it; a hook on the module's outputs gathers it
again when backward reaches the module, and it is released once the unit's gradients are handed
over. Outside those windows .data is an empty tensor. While gathered, .data is a torch-owned
buffer that the gathered values are copied into (one memcpy per gather), because autograd saves
*views* of parameters (Linear saves weight.t()) whose storage must still be the parameter's when
backward runs; that buffer's storage is freed (resized to 0) at release, so memory stays that of
the live units.

Gradients. torch 1.13 has no register_post_accumulate_grad_hook, so a hook on each parameter's
AccumulateGrad node (p.expand_as(p).grad_fn.next_functions[0][0].register_hook) sees the moment
its .grad is complete. When every parameter of a unit has its gradient, the unit's gradients go
to the engine with the copying Engine.grads_ready(unit, grads) (validated, one copy, no GIL), its
reduce-scatter starts while backward goes on: after backward the gradients live in the engine
(sharded from stage 2), not in .grad. .grad then holds a HandedGrad, the parameter's shape with
no values, which raises when read (torch.nn.utils.clip_grad_norm_, gradient logging, GradScaler
would otherwise see None and silently do nothing) and names the ways out: opt.clip_grad_norm_(
max_norm) returns the global norm and clips the coming step, as torch's does; every step's norm
is in opt.last_result.grad_norm. model.zero_grad() passes over it, the next backward replaces it.
A callback queued on the autograd engine hands over, at the end of backward, any unit that did
not get all its gradients (unused parameters count as zero). This is the same for every stage.
It is queued on the trainer's own backward, not on an autograd pass nested in it (a
torch.utils.checkpoint segment with use_reentrant=True runs a backward of its own inside the
trainer's) or run beside it (torch.autograd.grad(), as a gradient penalty calls it): a hook on
the model's outputs queues it as backward begins, and hooks that fire inside such passes do not
queue it (the thread's Python stack shows which pass a hook runs in, and on an autograd device
thread, where it shows none, autograd says whether the pass fills .grad; a pass nested in the
trainer's is taken only where the model's own forward ran under no_grad, as when the whole
model runs inside one checkpoint). A .grad cleared (None, zero_()) or replaced between backward
and step() is refused by step(): those gradients were reduced already, and the step would
silently apply them.
Ranks may differ in which units get gradients (a branch taken on some ranks only): the engine
reduces in its own order, the same on every rank.

Writes. At stages 0-2, a parameter written in place between steps (a pruning mask, nn.init, a
submodule's load_state_dict()) keeps the write: the next step() makes it the master weights of
its elements first (_param_watch.py). Stage 3 refuses such writes, since its parameters are
shards. close() gives the model back: ordinary parameters holding their current values, no
hooks; only then can another ZeroOptimizer take the model.

Stage 3 outside forward(). A released parameter raises when its values are read (it is a
ShardedParameter): a module that shares a unit's weight (an output head tied to the embedding)
gathers that unit in its own forward, automatically; a method other than forward() that reads
parameters directly is made to gather with opt.register_forward_method(module, "loss"), and
reads under torch.no_grad() (generate(), evaluation) with `with opt.gathered(module):`. Every
rank must run the same modules in the same order, since each gather is a collective: a branch
taken on some ranks only fails every rank with an error naming the unit (or, if the ranks'
collectives happen to match in size, at step(), naming both units) -- run such a branch on every
rank, with its output weighted by zero where it does not apply.

Batches. Each backward() is one micro-step. The engine averages gradients over ranks and over
gradient_accumulation_steps micro-steps, so each rank's loss should be the mean over its own
micro-batch, without dividing by the rank count or the accumulation steps: the update then
equals that of one process taking the mean over the whole global batch.

Checkpoints. Two forms. save_checkpoint(root) / load_checkpoint(root) are the engine's own
(collective, one root shared by the ranks, a crash-safe checksummed tag per save) and load at
any world size and any stage.
state_dict() is the torch.optim form: this rank's shard of the f32 master weights and optimizer
state (plus step count, loss scale and hyperparameters), to torch.save one file per rank and
load into an optimizer over the same model at the same world size. Either way loading also
restores the model's parameters (they are rebuilt from the master weights).
"""

import contextlib
import difflib
import functools
import gc
import sys
import weakref

import torch
from torch.utils import dlpack as _dlpack

from . import _core
from ._launch import default_communicator
from ._param_watch import ParamWatch, refuse_sparse, same_model_on_every_rank
from ._torch_guards import GRAD_NOT_READ, HandedGrad, ShardedParameter, handed_grad

__all__ = ["ZeroOptimizer", "partition_units", "HandedGrad"]

_TORCH_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_ZS_TO_TORCH = {_core.DType.f32: torch.float32, _core.DType.bf16: torch.bfloat16,
                _core.DType.f16: torch.float16}

# Optimizer state slots by optimizer kind, named as torch names them.
_STATE_NAMES = {
    _core.OptimizerKind.adam: ("exp_avg", "exp_avg_sq"),
    _core.OptimizerKind.adamw: ("exp_avg", "exp_avg_sq"),
    _core.OptimizerKind.lion: ("exp_avg",),
    _core.OptimizerKind.sgd: ("momentum_buffer",),
}
_STATE_KINDS = (_core.StateKind.state0, _core.StateKind.state1)

# Hyperparameters a torch param group may carry, per optimizer kind.
_GROUP_KEYS = {
    _core.OptimizerKind.adam: ("lr", "betas", "eps", "weight_decay"),
    _core.OptimizerKind.adamw: ("lr", "betas", "eps", "weight_decay"),
    _core.OptimizerKind.lion: ("lr", "betas", "weight_decay"),
    _core.OptimizerKind.sgd: ("lr", "momentum", "nesterov", "weight_decay"),
}

_STATE_FORMAT = "zeroshard.sharded/1"

# cudaStreamLegacy, the legacy default stream as a handle (DLPack spells it 1 too).
_CUDA_STREAM_LEGACY = 1


_BACKWARD_CODE = torch.autograd.backward.__code__
_GRAD_CODE = torch.autograd.grad.__code__


def _autograd_calls():
    """(grad, backward): the torch.autograd.grad() and backward() calls on this thread's Python
    stack. On the CPU they are the call that started the pass running now and those it is nested
    in (a use_reentrant=True checkpoint runs a backward of its own per segment inside the
    trainer's); a hook that runs on an autograd device thread (CUDA) sees only the passes
    started on that thread, usually none."""
    grad = backward = 0
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _BACKWARD_CODE:
            backward += 1
        elif f.f_code is _GRAD_CODE:
            grad += 1
        f = f.f_back
    return grad, backward


def _stream_handle(stream):
    """A torch.cuda.Stream as the int Engine.set_stream() takes. torch reports its default
    stream as 0, which set_stream() reads as "the engine's own stream" (a non-blocking one that
    would not be ordered with torch's work), so the default stream is passed as
    cudaStreamLegacy."""
    return stream.cuda_stream or _CUDA_STREAM_LEGACY


def _resize_storage(t, numel):
    """Frees (numel = 0) or re-allocates a tensor's storage in place, keeping its identity, so
    views autograd saved of it see the new memory."""
    if hasattr(t, "untyped_storage"):  # torch >= 2.0
        t.untyped_storage().resize_(numel * t.element_size())
    else:
        t.storage().resize_(numel)


def _tensors(obj):
    """The tensors in a module's output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class _Unit:
    """Bookkeeping of one engine unit on the torch side."""

    def __init__(self, index, name, module, names, params):
        self.index = index
        self.name = name
        self.module = module
        self.names = names            # qualified parameter names
        self.params = params          # the nn.Parameters, in registration order
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.ready = [False] * len(params)  # gradient complete in this backward
        self.n_ready = 0
        self.handed = False           # gradients given to the engine in this backward
        self.gathered = False         # stage 3: parameters present
        self.forward_stack = []       # stage 3: was it gathered before each nested forward?
        self.full = []                # stage 3: torch buffers the gathered values live in
        self.versions = []            # stage 3: parameters' _version when gathered
        self.pre = self.post = None   # stage 3: the module's forward hooks
        self.placeholder = None       # stage 3: what .data is while released


_MODULE_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)
_PARAM_CONTAINERS = (torch.nn.ParameterList, torch.nn.ParameterDict)
# Modules whose forward() reads their children's parameters itself (MultiheadAttention reads
# out_proj.weight; out_proj's forward never runs): one unit whatever their size.
_WHOLE_MODULES = (torch.nn.MultiheadAttention,)


def _first_pre_hook(module, hook):
    """A forward pre-hook that runs before those registered earlier (weight_norm's and
    spectral_norm's read the parameters it gathers)."""
    try:
        return module.register_forward_pre_hook(hook, prepend=True)
    except TypeError:  # torch before 2.0
        handle = module.register_forward_pre_hook(hook)
        module._forward_pre_hooks.move_to_end(handle.id, last=False)
        return handle


def partition_units(model, unit_numel=1 << 25, units=None, trainable=None):
    """Unit boundaries for `model`, as ZeroOptimizer cuts them: a list of
    (name, module, [(param_name, param), ...]). See the module doc for the rules."""
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    if trainable is None:
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assigned = set()
    out = []

    def take(module, recurse):
        got = []
        for p in module.parameters(recurse=recurse):
            if id(p) in trainable and id(p) not in assigned:
                assigned.add(id(p))
                got.append((names[id(p)], p))
        return got

    if units is not None:
        module_names = {id(m): n for n, m in model.named_modules()}
        for m in units:
            if id(m) not in module_names:
                raise _core.InvalidArgumentError(
                    f"ZeroOptimizer: units contains a {type(m).__name__} that is not a "
                    "submodule of the model")
            ps = take(m, True)
            if ps:
                out.append((module_names[id(m)] or "<root>", m, ps))
        rest = take(model, True)
        if rest:
            out.append(("<rest>", model, rest))
        return out

    def subtree_numel(m):
        return sum(p.numel() for p in m.parameters()
                   if id(p) in trainable and id(p) not in assigned)

    def visit(m, prefix, depth):
        total = subtree_numel(m)
        if total == 0:
            return
        children = [(n, c) for n, c in m.named_children() if subtree_numel(c) > 0]
        # A ModuleList/ModuleDict is never called, so its hooks never fire: it is never a unit,
        # its children are. A ParameterList/ParameterDict is read by its parent's forward: its
        # parameters belong to the parent's unit.
        held = [c for _, c in children if isinstance(c, _PARAM_CONTAINERS)]
        children = [(n, c) for n, c in children if not isinstance(c, _PARAM_CONTAINERS)]
        # The model itself always splits into its children; below it, a module is one unit
        # unless it is too large and has children to split into.
        container = isinstance(m, _MODULE_CONTAINERS)
        whole = total <= unit_numel or not children or isinstance(m, _WHOLE_MODULES)
        if depth > 0 and not container and whole:
            out.append((prefix, m, take(m, True)))
            return
        own = take(m, False)
        for c in held:
            own += take(c, True)
        if own:
            out.append((prefix or "<root>", m, own))
        for n, c in children:
            visit(c, f"{prefix}.{n}" if prefix else n, depth + 1)

    visit(model, "", 0)
    return out


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose parameters, gradients and optimizer state are owned and
    sharded by a zeroshard Engine (ZeRO stage 0-3, optional offload).

    Args:
        model: the nn.Module to train. Its trainable parameters must share one dtype (float32,
            bfloat16 or float16), which becomes the engine's Config.dtype, and one device: the
            CPU, or one CUDA device, which becomes Config.device cuda with its device_index
            (see "Devices" in the module doc: the model runs on torch's current stream at
            construction, the default stream unless changed).
        stage: ZeRO stage 0-3.
        optimizer: "adamw" (default), "adam", "sgd" or "lion".
        lr, betas, eps, weight_decay, momentum, nesterov: hyperparameters of every group not
            given its own (torch's meanings; "adam" adds weight decay to the gradient, "adamw"
            decouples it).
        param_groups: torch-style groups, e.g. [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]; together they must cover every
            trainable parameter. Default: one group of all of them.
        offload_optimizer: tier of master weights and optimizer state: "none" (default),
            "cpu" or "nvme" (or an OffloadOptions / dict); offload_param likewise (stage 3).
        nvme_path: directory (or list) for the nvme tier.
        gradient_clipping, gradient_accumulation_steps: as in Config.
        config: a base Config, a dict of zeroshard/DeepSpeed keys, or a JSON file path; the
            keyword arguments above override it.
        comm: a Communicator; default zeroshard.default_communicator(the model's device): MPI
            under mpirun or srun, NCCL through torch.distributed's store under torchrun on GPUs.
        units: modules whose parameters form one unit each (default: see module doc).
        unit_numel: the size above which a module is split into its children.
        broadcast_init: start every rank from rank 0's parameters and buffers (as DDP does).
        **config_fields: any other Config field (overlap_comm, max_live_units, prefetch,
            shard_alignment, grad_buffers, collective_timeout_s, loss_scale, ...).
    """

    def __init__(self, model, *, stage=None, optimizer=None, lr=None, betas=None, eps=None,
                 weight_decay=None, momentum=None, nesterov=None, param_groups=None,
                 offload_optimizer=None, offload_param=None, nvme_path=None,
                 gradient_clipping=None, gradient_accumulation_steps=None, config=None,
                 comm=None, units=None, unit_numel=1 << 25, broadcast_init=True,
                 **config_fields):
        if not isinstance(model, torch.nn.Module):
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: model must be a torch.nn.Module, got {type(model).__name__}")
        owner = getattr(model, "_zs_optimizer", None)
        if owner is not None and owner() is not None:
            gc.collect()  # one dropped by the trainer lives on in a cycle through its hooks
        if owner is not None and owner() is not None:
            raise _core.InvalidArgumentError(
                "ZeroOptimizer: this model already belongs to a ZeroOptimizer, whose hooks and "
                "engine memory its parameters still use; call close() on that one first")
        self.model = model
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise _core.InvalidArgumentError("ZeroOptimizer: the model has no trainable parameters")
        refuse_sparse(model, {id(p) for p in trainable})
        self._device = self._model_device(model)
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _TORCH_DTYPES:
            raise _core.InvalidArgumentError(
                "ZeroOptimizer: the trainable parameters must share one dtype of float32, "
                f"bfloat16 or float16, got {sorted(str(d) for d in dtypes)}")
        self._torch_dtype = next(iter(dtypes))

        cfg = self._build_config(config, stage, optimizer, lr, betas, eps, weight_decay, momentum,
                                 nesterov, offload_optimizer, offload_param, nvme_path,
                                 gradient_clipping, gradient_accumulation_steps, config_fields)
        self.comm = comm if comm is not None else default_communicator(self._device)
        self.stage = cfg.stage
        self._kind = cfg.optimizer.kind

        # Torch-side param groups, validated; their order defines the engine's groups.
        groups = self._build_groups(param_groups, trainable)
        defaults = self._group_defaults(cfg.optimizer)
        super().__init__(groups, defaults)
        group_of = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        cfg.optimizer = self._options(self.param_groups[0])

        unit_list = partition_units(model, unit_numel, units, {id(p) for p in trainable})
        tied = {}
        if self.stage == 3:
            tied = self._tied_users(model, unit_list)
            # In-use gather buffers: a unit, the units of the modules enclosing it, the units a
            # module shares a weight with, and the next unit of backward while this one's
            # gradients are not yet handed over.
            extra = max((len(v) for v in tied.values()), default=0)
            cfg.max_live_units = max(cfg.max_live_units,
                                     self._nesting(model, unit_list) + 2 + extra)

        self.engine = _core.Engine(cfg, self.comm)
        if self._device.type == "cuda":
            # The engine's kernels and copies run on torch's stream, in order with the model's:
            # no event or synchronisation is needed between them (see the module doc).
            self.engine.set_stream(_stream_handle(torch.cuda.current_stream(self._device)))
        for g in self.param_groups[1:]:
            self.engine.add_group(self._options(g))

        if broadcast_init and self.comm.size() > 1:
            same_model_on_every_rank(model, self.comm)
            self._broadcast_from_rank0(model)

        self._units = []
        for name, module, named in unit_list:
            ps = [p for _, p in named]
            zparams = []
            for (pname, p) in named:
                init = p.detach()
                if init.device.type != "cpu":
                    # The engine reads initial values on the host (Param.init is a CPU tensor
                    # on every device); one copy, dropped after finalize().
                    init = init.cpu()
                if not init.is_contiguous():
                    init = init.contiguous()  # initial values only; read once in finalize()
                zparams.append(_core.Param(pname, list(p.shape), group_of[id(p)], init))
            index = self.engine.add_unit(name, zparams)
            self._units.append(_Unit(index, name, module, [n for n, _ in named], ps))
        self.engine.finalize()

        self._hooks = []
        self._grad_accs = []  # AccumulateGrad nodes: torch holds them weakly, the hooks need them
        self._callback_queued = False
        self._root_armed = False  # the last forward of the model outside backward ran with grad
        # id(p) -> the HandedGrad put in p.grad for gradients the engine holds for the coming
        # step (cleared by step() and zero_grad()); names for the messages.
        self._handed = {}
        self._backwards = 0  # backward passes (micro-steps) since the last step or zero_grad
        self._accum = self.engine.config().gradient_accumulation_steps
        self._names = {id(p): n for u in self._units for n, p in zip(u.names, u.params)}
        self.last_result = None
        self._engine_options = [self._options(g) for g in self.param_groups]
        self._built = True  # param_groups are the engine's from here on (add_param_group)
        if self.stage < 3:
            for u in self._units:
                for p, v in zip(u.params, self.engine.params(u.index)):
                    # Zero-copy view of engine memory (a CUDA tensor on a GPU engine).
                    p.data = _dlpack.from_dlpack(v)
                self._register_grad_hooks(u)
        else:
            for u in self._units:
                self._setup_stage3(u)
            for module, indices in tied.items():
                self._gather_for(module, [self._units[i] for i in indices])
        self._hooks.append(model.register_forward_hook(self._make_root_post(model)))
        # Writes to the parameters from here on (in place, or a load_state_dict() of the model
        # or of any submodule) reach the master weights at the next step; stage 3 refuses
        # loads, since its parameters are shards (see _param_watch.py).
        managed = {id(p) for u in self._units for p in u.params}
        self._watch = ParamWatch(self, [(n, p) for n, p in model.named_parameters()
                                        if id(p) not in managed])
        if self.stage == 3:
            for m in model.modules():
                self._hooks.append(m._register_load_state_dict_pre_hook(self._before_model_load))
        else:
            self._hooks.append(model.register_load_state_dict_post_hook(self._after_model_load))
        model._zs_optimizer = weakref.ref(self)
        self._forward_methods = []  # (module, name, the method before) for close()

    def _before_model_load(self, *args):
        raise _core.InvalidArgumentError(
            "load_state_dict() on the model or a submodule after ZeroOptimizer was built: at "
            "stage 3 each rank holds only shards of the parameters; load the weights before "
            "building the optimizer, or restore with ZeroOptimizer.load_state_dict()")

    def _after_model_load(self, module, incompatible):
        # Stages 0-2: the parameters hold the loaded values; make them the master now, so that
        # a state_dict() or checkpoint before the next step has them too (collective, as loading
        # is on every rank), keeping the optimizer's moments, as DeepSpeed does.
        for u in self._units:
            self._watch.adopt(u, [True] * len(u.params))
        self.engine.commit_shards()
        self._watch.record()

    # ---- construction helpers ------------------------------------------------------------------

    @staticmethod
    def _model_device(model):
        """The one device of the trainable parameters: the CPU or one CUDA device."""
        first = {}
        for n, p in model.named_parameters():
            if p.requires_grad:
                first.setdefault(p.device, n)
        if len(first) > 1:
            where = ", ".join(f"'{n}' on {d}" for d, n in first.items())
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: the trainable parameters are on several devices ({where}); "
                "they must all be on the CPU or all on one CUDA device (model.to(device))")
        (device, n), = first.items()
        if device.type not in ("cpu", "cuda"):
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: parameter '{n}' is on {device}; zeroshard trains models on "
                "the CPU or on one CUDA device")
        return device

    def _build_config(self, config, stage, optimizer, lr, betas, eps, weight_decay, momentum,
                      nesterov, offload_optimizer, offload_param, nvme_path, gradient_clipping,
                      gradient_accumulation_steps, config_fields):
        cfg = _core.Config() if config is None else _coerce_config(config)
        model_dtype = _TORCH_DTYPES[self._torch_dtype]
        if config is not None and cfg.dtype != _core.DType.__members__[model_dtype]:
            json_dtype = {"f32": 'neither "fp16" nor "bf16" enabled',
                          "bf16": '"bf16": {"enabled": true}',
                          "f16": '"fp16": {"enabled": true}'}
            json_fix = {**json_dtype, "f32": 'no "fp16" or "bf16" section enabled'}
            from_json = not isinstance(config, _core.Config)
            said = json_dtype[cfg.dtype.name] if from_json else f"Config.dtype {cfg.dtype.name}"
            fix = json_fix[model_dtype] if from_json else f"Config.dtype = '{model_dtype}'"
            raise _core.ConfigError(
                f"config: dtype is {cfg.dtype.name} ({said}) but the model's parameters are "
                f"{self._torch_dtype}; zeroshard does not convert silently: convert the model "
                f"(model.to({_ZS_TO_TORCH[cfg.dtype]})) or configure {fix}")
        cfg.dtype = model_dtype
        if stage is not None:
            cfg.stage = stage
        if optimizer is not None:
            kind = _core.OptimizerOptions(kind=optimizer).kind
            if kind != cfg.optimizer.kind:
                # A different optimizer starts from torch's defaults for it: weight decay 1e-2
                # for AdamW, 0 for the others (not the previous optimizer's values).
                cfg.optimizer = _core.OptimizerOptions(
                    kind=kind, weight_decay=0.01 if kind == _core.OptimizerKind.adamw else 0.0)
        opt = cfg.optimizer
        for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                           ("momentum", momentum), ("nesterov", nesterov)):
            if value is not None:
                setattr(opt, key, value)
        if betas is not None:
            opt.beta1, opt.beta2 = betas
        if offload_optimizer is not None:
            cfg.offload_optimizer = offload_optimizer
        if offload_param is not None:
            cfg.offload_param = offload_param
        if nvme_path is not None:
            for off in (cfg.offload_optimizer, cfg.offload_param):
                if off.tier == _core.Tier.nvme:
                    off.nvme_paths = nvme_path
        if gradient_clipping is not None:
            cfg.gradient_clipping = gradient_clipping
        if gradient_accumulation_steps is not None:
            cfg.gradient_accumulation_steps = gradient_accumulation_steps
        fields = _core.Config.fields()
        for key, value in config_fields.items():
            if key not in fields or key == "dtype":
                close = difflib.get_close_matches(key, fields + ["stage", "lr", "betas"], n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                why = (" (the dtype is the model's)" if key == "dtype" else "")
                raise _core.ConfigError(
                    f"config: unknown keyword argument '{key}' for ZeroOptimizer{why}{hint}")
            setattr(cfg, key, value)
        self._place_config(cfg, config, config_fields)
        cfg.validate()
        return cfg

    def _place_config(self, cfg, config, config_fields):
        # The engine runs where the model is, as its dtype is the model's. A device the user
        # asked for (device= / device_index=, or a dict's "zeroshard" section) must agree;
        # Config's default, cpu with index -1, follows the model. (A Config object or a JSON
        # file that says cpu cannot be told from the default and follows the model too.)
        section = config.get("zeroshard") if isinstance(config, dict) else None
        asked = (isinstance(section, dict) and "device" in section) or "device" in config_fields
        dev = self._device
        if dev.type == "cpu":
            if cfg.device != _core.Device.cpu:
                raise _core.ConfigError(
                    "config: device is cuda but the model's trainable parameters are on the CPU; "
                    "move the model first (model.cuda()) -- zeroshard does not move it")
            return
        if asked and cfg.device != _core.Device.cuda:
            raise _core.ConfigError(
                f"config: device is {cfg.device.name} but the model's trainable parameters are "
                f"on {dev}; leave device out (it follows the model) or move the model")
        if cfg.device_index not in (-1, dev.index):
            raise _core.ConfigError(
                f"config: device_index is {cfg.device_index} but the model's trainable "
                f"parameters are on {dev}; leave device_index out (it follows the model) or "
                f"move the model (model.to('cuda:{cfg.device_index}'))")
        cfg.device = _core.Device.cuda
        cfg.device_index = dev.index

    def _group_defaults(self, o):
        d = {"lr": o.lr, "weight_decay": o.weight_decay}
        if self._kind in (_core.OptimizerKind.adam, _core.OptimizerKind.adamw,
                          _core.OptimizerKind.lion):
            d["betas"] = (o.beta1, o.beta2)
        if self._kind in (_core.OptimizerKind.adam, _core.OptimizerKind.adamw):
            d["eps"] = o.eps
        if self._kind == _core.OptimizerKind.sgd:
            d["momentum"] = o.momentum
            d["nesterov"] = o.nesterov
        return d

    def _build_groups(self, param_groups, trainable):
        ids = {id(p) for p in trainable}
        if param_groups is None:
            return [{"params": list(trainable)}]
        allowed = set(_GROUP_KEYS[self._kind]) | {"params"}
        groups, seen = [], set()
        names = {id(p): n for n, p in self.model.named_parameters()}
        for gi, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise _core.InvalidArgumentError(
                    f"ZeroOptimizer: param_groups[{gi}] must be a dict with a 'params' entry")
            for k in g:
                if k not in allowed:
                    raise _core.ConfigError(
                        f"config: param_groups[{gi}] has key '{k}', which the "
                        f"{self._kind.name} optimizer does not take (allowed: "
                        f"{', '.join(sorted(allowed))})")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            keep = []
            for p in ps:
                if id(p) not in names:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: param_groups[{gi}] holds a tensor that is not a "
                        "parameter of the model")
                if id(p) in seen:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: parameter '{names[id(p)]}' is in more than one group")
                seen.add(id(p))
                if id(p) in ids:  # frozen parameters are not the engine's
                    keep.append(p)
            if keep:
                groups.append(dict(g, params=keep))
        missing = [names[id(p)] for p in trainable if id(p) not in seen]
        if missing:
            raise _core.InvalidArgumentError(
                "ZeroOptimizer: param_groups leave out trainable parameters "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; every trainable parameter "
                "must be in exactly one group")
        return groups

    def _options(self, group):
        o = _core.OptimizerOptions(kind=self._kind)
        o.lr = float(group["lr"])
        o.weight_decay = float(group["weight_decay"])
        if "betas" in group:
            o.beta1, o.beta2 = (float(b) for b in group["betas"])
        if "eps" in group:
            o.eps = float(group["eps"])
        if "momentum" in group:
            o.momentum = float(group["momentum"])
            o.nesterov = bool(group["nesterov"])
        return o

    def _broadcast_from_rank0(self, model):
        # As DDP does: every rank starts from rank 0's parameters and buffers, so that a model
        # initialised from a different random seed per rank still trains as one. Buffers of any
        # dtype cross as bytes (DLPack has no bool: a mask goes as its uint8 view).
        named = list(model.named_parameters()) + list(model.named_buffers())
        with torch.no_grad():
            for name, t in named:
                if t.numel() == 0:
                    continue
                if not t.is_contiguous():
                    t.data = t.data.contiguous()
                host = t.detach() if t.device.type == "cpu" else t.detach().cpu()
                wire = host.view(torch.uint8) if host.dtype == torch.bool else host
                try:
                    self.comm.broadcast(wire, 0, f"initial value of '{name}' from rank 0")
                except (TypeError, ValueError, RuntimeError, _core.Error) as e:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: cannot send '{name}' ({t.dtype}) from rank 0 to the "
                        f"other ranks: {e}") from e
                if t.device.type != "cpu":  # the communicator takes host memory
                    t.copy_(host)

    @staticmethod
    def _ancestors(model):
        parent = {}
        for n, m in model.named_modules():
            for c in m.children():
                parent.setdefault(id(c), m)
        return parent

    def _nesting(self, model, unit_list):
        parent = self._ancestors(model)
        unit_modules = {id(m) for _, m, _ in unit_list}
        deepest = 0
        for _, m, _ in unit_list:
            depth, cur = 0, m
            while id(cur) in parent:
                cur = parent[id(cur)]
                depth += id(cur) in unit_modules
            deepest = max(deepest, depth)
        return deepest + 1

    def _tied_users(self, model, unit_list):
        """Stage 3: {module: [unit index, ...]} for modules that hold a parameter of a unit and
        can run without that unit's module running around them: a weight tied across modules
        (an output head sharing the embedding's weight), or a submodule registered under two
        parents (a block's MLP shared with another block). Such a module's forward gathers
        those units too, as their own modules' forwards do."""
        owner = {}
        for index, (_, m, named) in enumerate(unit_list):
            for _, p in named:
                owner[id(p)] = (index, m)
        reach = {}

        def outside(unit_module):
            """The modules reachable from the model without passing through unit_module."""
            if id(unit_module) not in reach:
                seen, stack = set(), [model]
                while stack:
                    m = stack.pop()
                    if m is unit_module or id(m) in seen:
                        continue
                    seen.add(id(m))
                    stack.extend(m.children())
                reach[id(unit_module)] = seen
            return reach[id(unit_module)]

        users = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                if id(p) in owner and id(m) in outside(owner[id(p)][1]):
                    found = users.setdefault(m, [])
                    if owner[id(p)][0] not in found:
                        found.append(owner[id(p)][0])
        return users

    # ---- hooks ---------------------------------------------------------------------------------

    def _register_grad_hooks(self, u):
        with torch.enable_grad():
            for i, p in enumerate(u.params):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(acc.register_hook(self._make_grad_hook(u, i)))
                self._grad_accs.append(acc)
                self._hooks.append(p.register_hook(self._make_clear_handed(p)))

    def _make_clear_handed(self, p):
        # Runs before the gradient accumulates into .grad: the HandedGrad of the last backward
        # must not be accumulated into (a new micro-step without zero_grad()), and one the user
        # cleared since is an error (_check_grad). The tensor holds its hooks in C++, where the
        # garbage collector cannot see a cycle back to it: weak references, or the parameter
        # (and through its unit, the engine and its communicator, which finalises MPI) would
        # never be freed.
        ref, opt = weakref.ref(p), weakref.ref(self)

        def hook(grad):
            q, me = ref(), opt()
            if q is not None and me is not None:
                me._check_grad(q, handed_only=True)
                if isinstance(q.grad, HandedGrad):
                    q.grad = None
            return grad
        return hook

    def _make_root_post(self, model):
        # The gradient of the model's output is the first thing the trainer's backward computes:
        # the end-of-backward callback is queued there, on that pass, before any pass nested in
        # it could take it (see _queue_end_of_backward). A copy of the model (copy.deepcopy
        # copies its hooks) is not this optimizer's.
        opt, mine = weakref.ref(self), weakref.ref(model)

        def queue(grad):
            me = opt()
            if me is not None:
                me._queue_end_of_backward()

        def hook(module, inputs, output):
            me = opt()
            if me is None or module is not mine():
                return
            # Whether the trainer's backward will start at this output: not when the model ran
            # under no_grad (inside a reentrant checkpoint); a checkpoint's recomputation inside
            # a backward says nothing of it.
            if _autograd_calls() == (0, 0):
                me._root_armed = torch.is_grad_enabled()
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(queue)
        return hook

    def _check_grad(self, p, handed_only=False):
        """Refuses a .grad that is not what backward left there: the gradients were handed to
        the engine already, so a change to .grad would be silently ignored."""
        want, g = self._handed.get(id(p)), p.grad
        if want is None:
            if handed_only or g is None or isinstance(g, HandedGrad):
                return
            what = "holds a tensor no backward() produced (assigned to .grad)"
        elif g is want and not want._zs_zeroed:
            return
        else:
            what = ("was set to None" if g is None else "was zeroed" if g is want
                    else "was replaced")
            what += " after backward()"
        raise _core.InvalidArgumentError(
            f"ZeroOptimizer: the .grad of '{self._names.get(id(p), '?')}' {what}. "
            f"{GRAD_NOT_READ}")

    def _check_grads(self):
        for u in self._units:
            for p in u.params:
                self._check_grad(p)

    def _make_grad_hook(self, u, i):
        # Weak, as pre_backward in _make_post_forward: an autograd graph the trainer keeps
        # holds the parameters' AccumulateGrad nodes, and with them this hook.
        opt, unit = weakref.ref(self), weakref.ref(u)

        def hook(grad_inputs, grad_outputs):
            me, un = opt(), unit()
            if me is not None and un is not None:
                me._on_grad(un, i)
        return hook

    def _setup_stage3(self, u):
        dtype, device = self._torch_dtype, self._device
        u.placeholder = torch.empty(0, dtype=dtype, device=device)
        for p, shape in zip(u.params, u.shapes):
            full = torch.empty(shape, dtype=dtype, device=device)
            u.full.append(full)
            # AccumulateGrad records the parameter's shape when it is created: create it (and
            # hook it) while .data has the full shape and storage, then release.
            p.data = full
        self._register_grad_hooks(u)
        for p, full in zip(u.params, u.full):
            p.data = u.placeholder
            _resize_storage(full, 0)
            # Reads while released raise (not an empty tensor's shape error, or silent zeros).
            p.__class__ = ShardedParameter
            # Weak: the engine holds the parameter through C++ (its AccumulateGrad node), where
            # the garbage collector cannot see a cycle back to the optimizer.
            p._zs_unit = weakref.ref(u)
        u.pre, u.post = self._make_pre_forward(u), self._make_post_forward(u)
        self._hooks.append(_first_pre_hook(u.module, u.pre))
        self._hooks.append(u.module.register_forward_hook(u.post))

    def _gather_for(self, module, units):
        """module's forward gathers `units` as their own modules' forwards do (and again for
        its backward)."""
        def pre(m, args):
            for u in units:
                u.pre(m, args)

        def post(m, args, out):
            for u in reversed(units):
                u.post(m, args, out)
        self._hooks.append(_first_pre_hook(module, pre))
        self._hooks.append(module.register_forward_hook(post))

    def _make_pre_forward(self, u):
        def hook(module, inputs):
            u.forward_stack.append(u.gathered)
            if not u.gathered:
                self._gather(u)
        return hook

    def _make_post_forward(self, u):
        def hook(module, inputs, output):
            if torch.is_grad_enabled():
                # The outputs' graph outlives this call by as long as the trainer keeps it (an
                # exception's traceback, say), in C++ where the garbage collector cannot follow:
                # it refers to the optimizer weakly, or it would keep the engine alive.
                opt, unit = weakref.ref(self), weakref.ref(u)

                def pre_backward(grad):
                    me, un = opt(), unit()
                    if me is None or un is None:
                        return
                    me._queue_end_of_backward()
                    if un.handed:  # its gradients went to the engine: a second pass through it
                        me._refuse_second_pass(un, un.names[0])
                    if not un.gathered:
                        me._gather_for_backward(un)
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(pre_backward)
            was_gathered = u.forward_stack.pop() if u.forward_stack else True
            if not was_gathered:
                self._release(u)
        return hook

    def _gather_for_backward(self, u):
        try:
            self._gather(u)
        except _core.InvalidArgumentError as e:
            if "max_live_units" not in str(e) or not self._in_grad_pass(_autograd_calls()):
                raise
            # A torch.autograd.grad() pass (create_graph=True) leaves a graph the trainer's
            # backward reads the gathered weights through, with no hook to gather them again.
            live = self.engine.config().max_live_units
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: a torch.autograd.grad() pass (a gradient penalty) reached unit "
                f"'{u.name}' with {live} units gathered: at stage 3 the units such a pass goes "
                "through stay gathered until the trainer's backward, which reads them again. "
                "Raise zeroshard.max_live_units (ZeroOptimizer(..., max_live_units=N)) to the "
                "number of units the pass goes through, plus 2") from e

    def _gather(self, u):
        views = self.engine.gather(u.index)
        for p, full, v, n in zip(u.params, u.full, views, u.numels):
            _resize_storage(full, n)
            full.copy_(_dlpack.from_dlpack(v))
            p.data = full
        u.versions = [p._version for p in u.params]
        u.gathered = True

    def _release(self, u):
        written = [n for n, p, v in zip(u.names, u.params, u.versions) if p._version != v]
        for p, full in zip(u.params, u.full):
            p.data = u.placeholder
            _resize_storage(full, 0)
        self.engine.release(u.index)
        u.gathered = False
        if written:
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: '{written[0]}' (unit '{u.name}') was written in place while "
                "gathered; at stage 3 the gathered values are a copy of the shards, and the write "
                "is lost at release. Change parameters before building the optimizer, or through "
                "its checkpoints")

    def _fills_grads(self):
        """Whether the autograd pass running now accumulates into the parameters' .grad (a
        backward) rather than returning gradients (torch.autograd.grad(), as a gradient penalty
        calls it), asked of autograd: for a hook on an autograd device thread, whose stack does
        not show the pass. (A parameter whose dtype changed since the build has a new
        AccumulateGrad node, which this does not know.)"""
        for acc in self._grad_accs:
            try:
                if torch._C._will_engine_execute_node(acc):
                    return True
            except RuntimeError:  # torch.autograd.grad() of the parameters themselves
                return False
        return False

    def _in_grad_pass(self, calls):
        """Whether the pass running now is a torch.autograd.grad(): seen on the stack (`calls`,
        _autograd_calls()), or, on a device thread whose stack shows no pass, asked of
        autograd."""
        grad, backward = calls
        return grad > 0 or (backward == 0 and not self._fills_grads())

    def _queue_end_of_backward(self):
        """Queues the end-of-backward callback on the trainer's backward: not on a
        torch.autograd.grad() pass, and not on a pass nested in the trainer's when the model's
        output will queue it there (a reentrant checkpoint segment's; where the whole model ran
        inside one checkpoint, that segment's pass is the one there is)."""
        if self._callback_queued:
            return
        calls = _autograd_calls()
        if self._in_grad_pass(calls) or (calls[1] > 1 and self._root_armed):
            return
        if self._backwards == self._accum:  # this backward would be one micro-step too many
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: backward() number {self._backwards + 1} since the last "
                f"step; {self._micro_steps_rule()}")
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._callback_queued = True

    def _micro_steps_rule(self):
        k = self._accum
        return (f"with gradient_accumulation_steps = {k} each backward() is one micro-step and "
                f"a step takes exactly {k}: call step() after every {k} backward() call(s), or "
                "opt.zero_grad() to drop the ones taken")

    def _on_grad(self, u, i):
        self._queue_end_of_backward()
        if u.handed:
            self._refuse_second_pass(u, u.names[i])
        if not u.ready[i]:
            u.ready[i] = True
            u.n_ready += 1
        if u.n_ready == len(u.params):
            self._hand_off(u)

    @staticmethod
    def _refuse_second_pass(u, name):
        raise _core.InvalidArgumentError(
            f"ZeroOptimizer: unit '{u.name}' got gradient of '{name}' after its gradients were "
            "handed to the engine in this backward pass: a parameter whose gradient is "
            "accumulated by more than one autograd pass within one backward, as a module used in "
            "several torch.utils.checkpoint segments with use_reentrant=True is (each segment "
            "runs its own backward); checkpoint with use_reentrant=False")

    def _hand_off(self, u):
        grads = []
        for p, shape in zip(u.params, u.shapes):
            g = p.grad
            if g is None or isinstance(g, HandedGrad):  # unused in this backward: zero
                g = torch.zeros(shape, dtype=self._torch_dtype, device=self._device)
            elif not g.is_contiguous():
                # AccumulateGrad lays .grad out like the parameter (contiguous here); this is
                # only reached if a user hook replaced it with a strided tensor.
                g = g.contiguous()
            grads.append(g.detach())
        self.engine.grads_ready(u.index, grads)  # copies; the reduction starts now
        self._set_handed(u)
        u.handed = True
        if self.stage == 3 and u.gathered:
            self._release(u)

    def _set_handed(self, u):
        # .grad says where the gradient went: reading it raises, naming the alternatives.
        for p, name, shape in zip(u.params, u.names, u.shapes):
            g = handed_grad(shape, p.dtype, p.device, name)
            self._handed[id(p)] = g
            if p.shape == shape:
                p.grad = g
            else:  # a released stage-3 parameter: the setter checks the shape against .data
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(shape)
                p.grad = g
                p.data = u.placeholder

    def _end_of_backward(self):
        # Runs on the autograd thread once backward is done: units some of whose parameters got
        # no gradient are handed over now (in unit order, the same on every rank), from
        # parameters that are still the engine's (the watch names what changed).
        self._callback_queued = False
        self._backwards += 1
        self._watch.check()
        for u in self._units:
            if not u.handed:
                self._hand_off(u)
        for u in self._units:
            u.handed = False
            u.ready = [False] * len(u.params)
            u.n_ready = 0
            if self.stage == 3 and u.gathered and not u.forward_stack:
                self._release(u)

    # ---- the optimizer interface ---------------------------------------------------------------

    def add_param_group(self, param_group):
        # torch.optim.Optimizer's constructor adds the groups through here; afterwards a new
        # group's parameters would never reach the engine, and would silently not train.
        if getattr(self, "_built", False):
            raise _core.InvalidArgumentError(
                "add_param_group(): ZeroOptimizer registers its parameters with the engine when "
                "it is built; pass every group as param_groups=[...] to the constructor (a "
                "group's hyperparameters may still change between steps)")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none=True):
        """Drops the gradients accumulated since the last step (in the engine and in .grad)."""
        if self.engine is None:
            raise _core.InvalidArgumentError("ZeroOptimizer.zero_grad() after close()")
        for u in self._units:
            for p in u.params:
                p.grad = None
            u.ready = [False] * len(u.params)
            u.n_ready = 0
            u.handed = False
        self._handed.clear()
        self._backwards = 0
        self.engine.zero_grad()

    def _sync_hyperparameters(self):
        # Schedulers change group["lr"], and some (OneCycleLR, CyclicLR) betas or momentum too;
        # the engine takes a group's new hyperparameters at any step.
        for gi, (g, o) in enumerate(zip(self.param_groups, self._engine_options)):
            now = self._options(g)
            keys = ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "nesterov")
            if any(getattr(now, k) != getattr(o, k) for k in keys):
                self.engine.set_options(gi, now)
                self._engine_options[gi] = now

    def step(self, closure=None):
        """One optimizer step: finishes the reductions, updates every shard (skipped on f16
        overflow), and brings the parameters up to date. Returns closure's loss, if given;
        the engine's StepResult is in .last_result."""
        if self.engine is None:
            raise _core.InvalidArgumentError("ZeroOptimizer.step() after close()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._check_grads()
        if self._backwards != self._accum:
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer.step() after {self._backwards} backward() call(s) since the "
                f"last step; {self._micro_steps_rule()}")
        self._watch.check()
        self._watch.adopt_writes()
        self.last_result = self.engine.step()
        self._handed.clear()
        self._backwards = 0
        return loss

    def backward(self, loss):
        """loss.backward() with the loss scaled by the engine's loss scale (f16 training)."""
        scale = self.engine.loss_scale()
        (loss * scale if scale != 1.0 else loss).backward()

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ for the engine's gradients: after the last backward of
        the step and before step(), on every rank. Returns the global L2 norm of the averaged,
        unscaled gradients (inf on an f16 overflow) as a tensor, and makes the coming step()
        clip them to max_norm (float('inf'): only measure). After it, no backward until step()
        or zero_grad()."""
        if norm_type != 2.0:
            raise _core.InvalidArgumentError(
                f"clip_grad_norm_(): norm_type {norm_type}; the engine clips by the L2 norm")
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise _core.InvalidArgumentError(f"clip_grad_norm_(): max_norm must be > 0, got "
                                             f"{max_norm}")
        self._check_grads()
        norm = self.engine.clip_grad_norm(0.0 if max_norm == float("inf") else max_norm)
        if error_if_nonfinite and norm == float("inf"):
            raise RuntimeError("clip_grad_norm_(): the total norm of the gradients is "
                               "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
        return torch.tensor(norm, dtype=torch.float32)

    def _units_of(self, modules):
        """The units owning a parameter of `modules` (a module or a list; None: the model)."""
        if modules is None:
            modules = self.model
        if isinstance(modules, torch.nn.Module):
            modules = [modules]
        ids = {id(p) for m in modules for p in m.parameters()}
        return [u for u in self._units if any(id(p) in ids for p in u.params)]

    @contextlib.contextmanager
    def gathered(self, module=None):
        """Stage 3: the parameters of `module` (default: the whole model) present for reading
        outside its forward() -- generate(), evaluation, logging -- under torch.no_grad().
        In-place writes are refused (they would be lost). A no-op at stages 0-2."""
        if self.stage < 3:
            yield
            return
        if torch.is_grad_enabled():
            raise _core.InvalidArgumentError(
                "ZeroOptimizer.gathered() needs torch.no_grad(): its parameters are released on "
                "exit, before a backward could use them; for a method other than forward() "
                "that trains, use opt.register_forward_method(module, 'method')")
        units = self._units_of(module)
        for u in units:
            u.pre(u.module, ())
        try:
            yield
        finally:
            for u in reversed(units):
                u.post(u.module, (), None)

    def register_forward_method(self, module, name, uses=None):
        """Stage 3: makes module.<name>() gather parameters for its call, and again for its
        backward, as forward() does -- for a loss method or a generate() that reads parameters
        directly (logits = h @ self.wte.weight.T). `uses`: the modules (or one) whose parameters
        it reads outside their own forward() (default: all of `module`'s, the whole of it
        gathered at once). A no-op at stages 0-2."""
        method = getattr(module, name)
        if self.stage < 3:
            return
        units = self._units_of(module if uses is None else uses)

        @functools.wraps(method)
        def wrapped(*args, **kwargs):
            for u in units:
                u.pre(module, args)
            out = None
            try:
                out = method(*args, **kwargs)
            finally:
                for u in reversed(units):
                    u.post(module, args, out)
            return out

        self._forward_methods.append((module, name, module.__dict__.get(name)))
        setattr(module, name, wrapped)

    @property
    def loss_scale(self):
        return self.engine.loss_scale()

    @property
    def units(self):
        """[(unit name, [parameter names])] in engine order."""
        return [(u.name, list(u.names)) for u in self._units]

    def memory(self):
        """The engine's MemoryReport (bytes by tier x kind on this rank, with peaks)."""
        return self.engine.memory()

    @torch.no_grad()
    def close(self):
        """Gives the model back (collective at stage 3): every managed parameter becomes an
        ordinary tensor holding its current values (stage 3: gathered whole), with no gradient;
        the hooks and forward-method wrappers go, and the engine with its memory once nothing
        else holds it. The optimizer cannot step afterwards; a new one may take the model."""
        if getattr(self, "_closed", False):
            return
        if self.stage == 3:
            whole = self.model_state_dict()
            by_id = {id(t): whole[k] for k, t in self.model.state_dict(keep_vars=True).items()}
        for u in self._units:
            for p in u.params:
                p.grad = None
                if self.stage == 3:
                    p.__class__ = torch.nn.Parameter
                    p.data = by_id[id(p)]
                else:
                    p.data = p.data.clone()  # off the engine's memory
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for module, name, before in self._forward_methods:
            if before is None:
                delattr(module, name)  # the class's method again
            else:
                setattr(module, name, before)
        self._forward_methods = []
        self.model._zs_optimizer = None
        self._units = []
        self.engine = None
        self._closed = True

    @torch.no_grad()
    def model_state_dict(self):
        """model.state_dict() with every managed parameter whole, as copies on the model's device:
        in stage 3 each unit's parameter shards are all-gathered (collective: call it on every
        rank), so this is how to export or evaluate stage-3 weights outside forward. Other
        entries are model.state_dict()'s."""
        whole = {}
        for u in self._units:
            if self.stage == 3:
                # All-gather the parameter shards directly rather than through Engine.gather():
                # an export between steps must not use gather buffers or enter the gather order
                # the engine records for its prefetch.
                # Over every rank: the first shard group's shards, in rank order, are the unit
                # (with shard_group_size the other groups repeat them).
                si = self.engine.shard_info(u.index)
                shard = _dlpack.from_dlpack(self.engine.read_shard(u.index, _core.StateKind.param))
                flat = torch.empty(si.shard_numel * self.comm.size(), dtype=torch.float32)
                self.comm.all_gather(shard, flat, f"model_state_dict(): unit '{u.name}'")
                offset = 0
                for p, shape, n in zip(u.params, u.shapes, u.numels):
                    # Exact: f32 holds every bf16/f16 value, so this is the parameter itself.
                    whole[id(p)] = flat[offset:offset + n].view(shape).to(
                        self._device, self._torch_dtype)
                    offset += n
            else:
                for p in u.params:
                    whole[id(p)] = p.detach().clone()
        return {k: whole[id(t)] if id(t) in whole else t.detach() for k, t in
                self.model.state_dict(keep_vars=True).items()}

    def save_checkpoint(self, root, tag=None):
        """Collective: writes the engine's checkpoint as root/<tag> (default "step<N>"; root is
        shared by the ranks) and points root/latest at it: master weights, optimizer state, the
        step count, the loss scaler's state and every group's hyperparameters, crash-safe and
        checksummed, in a layout that any world size and any stage can load with
        load_checkpoint(). An existing tag is refused. Returns the tag's path."""
        self._sync_hyperparameters()
        self._watch.adopt_writes()
        return self.engine.save(str(root), tag or "")

    def load_checkpoint(self, path):
        """Collective: loads a checkpoint (a tag directory, or a root's latest tag) written at
        any world size or stage into this optimizer (same model: unit and parameter names,
        shapes, optimizer), after verifying it whole: a failed load changes nothing. The model's
        parameters are rebuilt from the loaded master weights, and the param groups take the
        saved hyperparameters (a scheduler stepped since construction is not rewound)."""
        self.engine.load(str(path))
        for gi, g in enumerate(self.param_groups):
            o = self.engine.options(gi)
            g["lr"] = o.lr
            if "betas" in g:
                g["betas"] = (o.beta1, o.beta2)
            for key in ("eps", "weight_decay", "momentum", "nesterov"):
                if key in g:
                    g[key] = getattr(o, key)
            self._engine_options[gi] = self._options(g)
        self._watch.record()  # the parameters are the loaded ones: nothing to adopt

    def state_dict(self):
        if self.engine is None:
            raise _core.InvalidArgumentError("ZeroOptimizer.state_dict() after close()")
        """This rank's shard of the optimizer: f32 master weights and optimizer state per unit
        (CPU tensors, on a GPU too), step count, loss scale, and the param groups'
        hyperparameters (params as indices)."""
        state_names = _STATE_NAMES[self._kind]
        units = []
        for u in self._units:
            si = self.engine.shard_info(u.index)
            entry = {"name": u.name, "param_names": list(u.names), "numel": si.numel,
                     "padded_numel": si.padded_numel, "shard_offset": si.shard_offset,
                     "shard_numel": si.shard_numel,
                     "master": _dlpack.from_dlpack(
                         self.engine.read_shard(u.index, _core.StateKind.master))}
            for name, kind in zip(state_names, _STATE_KINDS):
                if self.engine.has_state(kind):
                    entry[name] = _dlpack.from_dlpack(self.engine.read_shard(u.index, kind))
            units.append(entry)
        index, groups = 0, []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(d)
        return {"state": {"format": _STATE_FORMAT, "rank": self.engine.rank(),
                          "world_size": self.engine.world_size(), "stage": self.stage,
                          "optimizer": self._kind.name, "step": self.engine.step_count(),
                          "loss_scale": self.engine.loss_scale(),
                          "loss_scaler": _scaler_dict(self.engine.loss_scaler_state()),
                          "units": units},
                "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restores a state_dict() saved by the same rank of a run at the same world size over
        the same model: master weights (and so the model's parameters), optimizer state, step
        count, loss scale and every group's hyperparameters."""
        st = state_dict.get("state") if isinstance(state_dict, dict) else None
        if not isinstance(st, dict) or st.get("format") != _STATE_FORMAT:
            raise _core.InvalidArgumentError(
                "load_state_dict(): not a zeroshard state dict (expected state['format'] == "
                f"'{_STATE_FORMAT}')")
        rank, world = self.engine.rank(), self.engine.world_size()
        if st["world_size"] != world or st["rank"] != rank:
            raise _core.InvalidArgumentError(
                f"load_state_dict(): the state is rank {st['rank']}'s of {st['world_size']} ranks; "
                f"this is rank {rank} of {world} (load each rank's own file, at the same world size)")
        if st["optimizer"] != self._kind.name:
            raise _core.InvalidArgumentError(
                f"load_state_dict(): the state is of optimizer {st['optimizer']}, this optimizer "
                f"is {self._kind.name}")
        if len(st["units"]) != len(self._units):
            raise _core.InvalidArgumentError(
                f"load_state_dict(): the state has {len(st['units'])} units, the model has "
                f"{len(self._units)}")
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            raise _core.InvalidArgumentError(
                f"load_state_dict(): the state has {len(groups)} param groups, this optimizer "
                f"has {len(self.param_groups)}")
        state_names = _STATE_NAMES[self._kind]
        # Check everything before writing anything, so a bad file leaves the optimizer intact.
        for u, entry in zip(self._units, st["units"]):
            si = self.engine.shard_info(u.index)
            for key, want in (("name", u.name), ("numel", si.numel),
                              ("padded_numel", si.padded_numel),
                              ("shard_numel", si.shard_numel)):
                if entry.get(key) != want:
                    raise _core.InvalidArgumentError(
                        f"load_state_dict(): unit '{u.name}': saved {key} = {entry.get(key)!r}, "
                        f"this model has {want!r} (same model, world size and shard_alignment "
                        "needed)")
        for gi, (g, saved) in enumerate(zip(self.param_groups, groups)):
            # Every hyperparameter is restored, except an SGD momentum that would turn the
            # momentum buffer on or off, which the engine fixed when it was built.
            if "momentum" in saved and (_norm(saved["momentum"]) != 0) != (g["momentum"] != 0):
                raise _core.InvalidArgumentError(
                    f"load_state_dict(): param_groups[{gi}]['momentum'] was "
                    f"{saved['momentum']!r}, this optimizer has {g['momentum']!r}: the momentum "
                    "buffer cannot turn on or off (build the optimizer with the saved momentum)")
        for u, entry in zip(self._units, st["units"]):
            self.engine.write_shard(u.index, _core.StateKind.master, _f32(entry["master"]))
            for name, kind in zip(state_names, _STATE_KINDS):
                if name in entry:
                    self.engine.write_shard(u.index, kind, _f32(entry[name]))
        self.engine.commit_shards()
        self.engine.set_step_count(int(st["step"]))
        self.engine.set_loss_scale(float(st["loss_scale"]))
        if "loss_scaler" in st:  # the scaler's counters too, so its schedule goes on exactly
            ls = _core.LossScalerState()
            ls.scale = float(st["loss_scale"])
            for key in ("hysteresis_left", "iteration", "last_overflow"):
                setattr(ls, key, int(st["loss_scaler"][key]))
            self.engine.set_loss_scaler_state(ls)
        for g, saved in zip(self.param_groups, groups):
            for key in _GROUP_KEYS[self._kind]:
                if key in saved:
                    g[key] = tuple(saved[key]) if isinstance(saved[key], list) else saved[key]
        self._sync_hyperparameters()
        self._watch.record()  # the parameters are the loaded ones: nothing to adopt


def _scaler_dict(ls):
    return {"hysteresis_left": ls.hysteresis_left, "iteration": ls.iteration,
            "last_overflow": ls.last_overflow}


def _norm(v):
    return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else v


def _f32(t):
    """A saved shard as the contiguous float32 CPU tensor write_shard() takes."""
    if not isinstance(t, torch.Tensor):
        raise _core.InvalidArgumentError(
            f"load_state_dict(): a saved shard is a {type(t).__name__}, expected a tensor")
    return t.detach().to("cpu", torch.float32).contiguous()


def _coerce_config(config):
    """A fresh Config from a Config (copied), a dict of zeroshard/DeepSpeed keys or a path."""
    if isinstance(config, _core.Config):
        return config.copy()
    if isinstance(config, dict):
        return _core.Config.from_dict(config)
    return _core.Config.from_json_file(str(config))
