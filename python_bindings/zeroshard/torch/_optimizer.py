"""ZeroOptimizer: a torch.optim.Optimizer over a zeroshard Engine (see the package's doc); its
parts are the mixins of _config, _units, _grads, _gather and _state."""

import gc
import weakref

import torch
from torch.utils import dlpack as _dlpack

from .. import _core
from .._launch import default_communicator
from .._param_watch import ParamWatch, refuse_sparse, same_model_on_every_rank

from ._config import _TORCH_DTYPES, _ConfigPart, _stream_handle
from ._gather import _GatherPart
from ._grads import _GradsPart
from ._state import _StatePart
from ._units import GradState, _Unit, _UnitsPart, partition_units


class ZeroOptimizer(_ConfigPart, _UnitsPart, _GradsPart, _GatherPart, _StatePart,
                     torch.optim.Optimizer):
    """A torch.optim.Optimizer whose parameters, gradients and optimizer state are owned and
    sharded by a zeroshard Engine (ZeRO stage 0-3, optional offload).

    Args:
        model: the nn.Module to train. Its trainable parameters must share one dtype (float32,
            bfloat16 or float16), which becomes the engine's Config.dtype, and one device: the
            CPU, or one CUDA device, which becomes Config.device cuda with its device_index
            (see "Devices" in the module doc: the model runs on torch's current stream at
            construction, the default stream unless changed).
        stage: ZeRO stage 0-3.
        optimizer: "adamw" (default), "adam", "sgd", "lion" or "muon". With "muon", matrices
            are updated by Muon and the rest by AdamW: by default the parameters of two or
            more dimensions (a parameter's `use_muon` attribute overrides that), or as groups
            with "use_muon" say, the first group a Muon one (docs/muon.md).
        lr, betas, eps, weight_decay, momentum, nesterov: hyperparameters of every group not
            given its own (torch's meanings; "adam" adds weight decay to the gradient, "adamw"
            decouples it).
        param_groups: torch-style groups, e.g. [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]. As in torch.optim, a trainable
            parameter in no group is not optimised (it stays a plain torch parameter, never
            sharded), and a group may be empty. Default: one group of all of them.
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
        trainable = self._grouped(param_groups, trainable)
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
        self._muon_given = {k: v for k, v in (("eps", eps), ("betas", betas)) if v is not None}
        self._muon_base = cfg.optimizer
        self._names_of = {id(p): n for n, p in model.named_parameters()}
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
        self._gathering = set()  # stage 3: ids of the modules whose forward hooks gather
        self._gathering_methods = set()  # stage 3: of those with register_forward_method()s
        self._compiled = set()  # of the modules compile_modules() compiled
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
        # The frozen parameters (a trainable one in no group is the trainer's, as in torch).
        self._watch = ParamWatch(self, [(n, p) for n, p in model.named_parameters()
                                        if id(p) not in managed and not p.requires_grad])
        if self.stage == 3:
            for m in model.modules():
                self._hooks.append(m._register_load_state_dict_pre_hook(self._before_model_load))
        else:
            self._hooks.append(model.register_load_state_dict_post_hook(self._after_model_load))
        model._zs_optimizer = weakref.ref(self)
        self._forward_methods = []  # (module, name, the method before) for close()

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
        """Drops the gradients accumulated since the last step (in the engine and in .grad).
        With set_to_none=False, as in torch, a parameter that had a .grad gets a zero tensor
        there instead (stages 0-2; at stage 3 a parameter is a shard between forwards, and
        .grad stays None rather than hold a whole zero gradient on every rank)."""
        if self.engine is None:
            raise _core.InvalidArgumentError("ZeroOptimizer.zero_grad() after close()")
        zeros = not set_to_none and self.stage < 3
        for u in self._units:
            for p in u.params:
                p.grad = torch.zeros_like(p) if zeros and p.grad is not None else None
            u.set_grads(GradState.WAITING)
        self._handed.clear()
        self._backwards = 0
        self.engine.zero_grad()

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
        for module, name, before in reversed(self._forward_methods):  # the last change first
            if before is None:
                delattr(module, name)  # the class's method again
            else:
                setattr(module, name, before)
        self._forward_methods = []
        self.model._zs_optimizer = None
        self._units = []
        self.engine = None
        self._closed = True
