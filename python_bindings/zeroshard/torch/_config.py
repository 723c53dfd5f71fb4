"""The configuration of a ZeroOptimizer: zeroshard.Config from keywords, a dict, a JSON file or a
Config; torch-style parameter groups and their hyperparameters; the device the model is on."""

import difflib
import struct

import torch

from .. import _core


_TORCH_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


_ZS_TO_TORCH = {_core.DType.f32: torch.float32, _core.DType.bf16: torch.bfloat16,
                _core.DType.f16: torch.float16}


# Hyperparameters a torch param group may carry, per optimizer kind.
_GROUP_KEYS = {
    _core.OptimizerKind.adam: ("lr", "betas", "eps", "weight_decay"),
    _core.OptimizerKind.adamw: ("lr", "betas", "eps", "weight_decay"),
    _core.OptimizerKind.lion: ("lr", "betas", "weight_decay"),
    _core.OptimizerKind.sgd: ("lr", "momentum", "nesterov", "weight_decay"),
    # A Muon engine's groups: Muon ones (use_muon, the default for parameters of two or more
    # dimensions) and AdamW ones beside them (docs/muon.md).
    _core.OptimizerKind.muon: ("lr", "weight_decay", "use_muon", "momentum", "nesterov", "eps",
                               "ns_steps", "ns_bf16", "adjust_lr_fn", "betas"),
}

# torch.optim.AdamW's defaults for an AdamW group beside Muon groups (which take theirs from the
# configuration: torch.optim.Muon's unless it says otherwise).
_AUX_ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8}
_MUON_ONLY = ("momentum", "nesterov", "ns_steps", "ns_bf16", "adjust_lr_fn")


# cudaStreamLegacy, the legacy default stream as a handle (DLPack spells it 1 too).
_CUDA_STREAM_LEGACY = 1


def _stream_handle(stream):
    """A torch.cuda.Stream as the int Engine.set_stream() takes. torch reports its default
    stream as 0, which set_stream() reads as "the engine's own stream" (a non-blocking one that
    would not be ordered with torch's work), so the default stream is passed as
    cudaStreamLegacy."""
    return stream.cuda_stream or _CUDA_STREAM_LEGACY


def _coerce_config(config):
    """A fresh Config from a Config (copied), a dict of zeroshard/DeepSpeed keys or a path."""
    if isinstance(config, _core.Config):
        return config.copy()
    if isinstance(config, dict):
        return _core.Config.from_dict(config)
    return _core.Config.from_json_file(str(config))


def _as_written(x):
    """The shortest decimal that rounds to the same f32 as `x` (an f32 value read back as a
    Python float): what the user wrote, where that was a short decimal."""
    x = float(x)
    f32 = struct.unpack("f", struct.pack("f", x))[0]
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", y))[0] == f32:
            return y
    return x


class _ConfigPart:
    """The configuration part of ZeroOptimizer (config, groups, hyperparameters)."""

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
                if kind == _core.OptimizerKind.muon:  # torch.optim.Muon's
                    cfg.optimizer.momentum, cfg.optimizer.nesterov = 0.95, True
                    cfg.optimizer.eps = 1e-7
        opt = cfg.optimizer
        for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                           ("momentum", momentum), ("nesterov", nesterov)):
            if value is not None:
                setattr(opt, key, value)
        if betas is not None:
            self._check_betas(betas, "betas")
            opt.beta1, opt.beta2 = (float(b) for b in betas)
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
        # The engine keeps hyperparameters in f32; the groups show the values as written (0.02,
        # not 0.019999999552965164), which round to the same f32.
        d = {"lr": _as_written(o.lr), "weight_decay": _as_written(o.weight_decay)}
        if self._kind == _core.OptimizerKind.muon:
            return d  # each group carries the rest, by its kind (_muon_groups())
        if self._kind in (_core.OptimizerKind.adam, _core.OptimizerKind.adamw,
                          _core.OptimizerKind.lion):
            d["betas"] = (_as_written(o.beta1), _as_written(o.beta2))
        if self._kind in (_core.OptimizerKind.adam, _core.OptimizerKind.adamw):
            d["eps"] = _as_written(o.eps)
        if self._kind == _core.OptimizerKind.sgd:
            d["momentum"] = _as_written(o.momentum)
            d["nesterov"] = o.nesterov
        return d

    @staticmethod
    def _check_betas(betas, where):
        # As torch.optim refuses them: one float and one Tensor.
        if (betas is not None and len(betas) == 2
                and isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor)):
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: {where}: betas must be either both floats or both Tensors")

    def _grouped(self, param_groups, trainable):
        """The trainable parameters the engine manages: those of `param_groups` (every one
        when None), in the model's order. As in torch.optim, a trainable parameter in no group
        is not optimised: it stays a plain torch parameter, its .grad accumulates as usual, and
        nothing steps it. Checks that the groups name parameters of the model, once each."""
        if param_groups is None:
            return trainable
        names = {id(p): n for n, p in self.model.named_parameters()}
        seen = set()
        for gi, g in enumerate(param_groups):
            if not isinstance(g, dict) or "params" not in g:
                raise _core.InvalidArgumentError(
                    f"ZeroOptimizer: param_groups[{gi}] must be a dict with a 'params' entry")
            for p in self._group_params(g):
                if id(p) not in names:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: param_groups[{gi}] holds a tensor that is not a "
                        "parameter of the model")
                if id(p) in seen:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: parameter '{names[id(p)]}' is in more than one group")
                seen.add(id(p))
        managed = [p for p in trainable if id(p) in seen]
        if not managed:
            raise _core.InvalidArgumentError(
                "ZeroOptimizer: param_groups hold no trainable parameter of the model")
        return managed

    @staticmethod
    def _group_params(g):
        return [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])

    def _build_groups(self, param_groups, managed):
        """torch-style groups of the managed parameters (frozen ones left out), in the order
        given; a group left with no parameter stays, as in torch (a scheduler keeps one entry per
        group)."""
        if self._kind == _core.OptimizerKind.muon:
            return self._muon_groups(param_groups, managed)
        if param_groups is None:
            return [{"params": list(managed)}]
        ids = {id(p) for p in managed}
        groups = []
        for gi, g in enumerate(param_groups):
            self._check_group_keys(gi, g)
            self._check_betas(g.get("betas"), f"param_groups[{gi}]")
            groups.append(dict(g, params=[p for p in self._group_params(g) if id(p) in ids]))
        return groups

    def _check_group_keys(self, gi, g):
        allowed = set(_GROUP_KEYS[self._kind]) | {"params"}
        for k in g:
            if k not in allowed:
                raise _core.ConfigError(
                    f"config: param_groups[{gi}] has key '{k}', which the {self._kind.name} "
                    f"optimizer does not take (allowed: {', '.join(sorted(allowed))})")

    def _muon_groups(self, param_groups, managed):
        """A Muon engine's groups. Without param_groups: the parameters of two or more
        dimensions in a Muon group, the others in an AdamW group (a parameter's own `use_muon`
        attribute, as DeepSpeed reads it, overrides its shape: set it False on embeddings and
        output heads, which Muon's authors leave to AdamW). A given group is Muon's when its
        "use_muon" says so (default True). Each group is completed with the defaults of its
        kind: a Muon group the configuration's (torch.optim.Muon's defaults unless it or the
        constructor says otherwise), an AdamW group torch.optim.AdamW's, or the constructor's
        betas and eps."""
        if param_groups is None:
            def use(p):
                return bool(getattr(p, "use_muon", p.dim() >= 2))
            param_groups = [{"params": [p for p in managed if use(p)], "use_muon": True},
                            {"params": [p for p in managed if not use(p)], "use_muon": False}]
        ids = {id(p) for p in managed}
        base = self._muon_base  # the configuration's Muon settings, the constructor's included
        muon_defaults = {"momentum": _as_written(base.momentum), "nesterov": base.nesterov,
                         "eps": _as_written(base.eps),
                         "ns_steps": base.ns_steps, "ns_bf16": base.ns_bf16,
                         "adjust_lr_fn": "match_rms_adamw" if base.match_rms_adamw else "original"}
        # An AdamW group takes the constructor's betas and eps where given, else AdamW's.
        given = {k: v for k, v in self._muon_given.items() if k in _AUX_ADAMW_DEFAULTS}
        groups = []
        for gi, g in enumerate(param_groups):
            self._check_group_keys(gi, g)
            muon = bool(g.get("use_muon", True))
            wrong = [k for k in (("betas",) if muon else _MUON_ONLY) if k in g]
            if wrong:
                kind = "a Muon group (use_muon true)" if muon else "an AdamW group (use_muon false)"
                raise _core.ConfigError(
                    f"config: param_groups[{gi}] is {kind}, which does not take "
                    f"{', '.join(wrong)}")
            self._check_betas(g.get("betas"), f"param_groups[{gi}]")
            params = [p for p in self._group_params(g) if id(p) in ids]
            if muon:
                flat = [self._names_of.get(id(p), "?") for p in params if p.dim() < 2]
                if flat:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: param_groups[{gi}] is a Muon group but holds "
                        f"{', '.join(flat)} of fewer than two dimensions; Muon orthogonalises "
                        "matrices: put them in a group with \"use_muon\": False (AdamW)")
            own = dict(muon_defaults) if muon else {**_AUX_ADAMW_DEFAULTS, **given}
            own.update(g)
            own["use_muon"] = muon
            own["params"] = params
            groups.append(own)
        if not groups[0]["use_muon"]:
            raise _core.ConfigError(
                "config: with optimizer \"muon\" the first param group is the engine's Muon "
                "group: put a group with \"use_muon\": True first (AdamW groups after it)")
        return groups

    def _options(self, group):
        if self._kind == _core.OptimizerKind.muon:
            return self._muon_options(group)
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

    def _muon_options(self, group):
        muon = group["use_muon"]
        o = _core.OptimizerOptions(
            kind=_core.OptimizerKind.muon if muon else _core.OptimizerKind.adamw)
        o.lr = float(group["lr"])
        o.weight_decay = float(group["weight_decay"])
        o.eps = float(group["eps"])
        if muon:
            o.momentum = float(group["momentum"])
            o.nesterov = bool(group["nesterov"])
            o.ns_steps = int(group["ns_steps"])
            o.ns_bf16 = bool(group["ns_bf16"])
            fn = group["adjust_lr_fn"]
            if fn not in (None, "original", "match_rms_adamw"):
                raise _core.ConfigError(
                    f"config: adjust_lr_fn = {fn!r}: must be \"original\" (or None) or "
                    "\"match_rms_adamw\", as in torch.optim.Muon")
            o.match_rms_adamw = fn == "match_rms_adamw"
        else:
            o.beta1, o.beta2 = (float(b) for b in group["betas"])
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

    def _sync_hyperparameters(self):
        # Schedulers change group["lr"], and some (OneCycleLR, CyclicLR) betas or momentum too;
        # the engine takes a group's new hyperparameters at any step.
        for gi, (g, o) in enumerate(zip(self.param_groups, self._engine_options)):
            now = self._options(g)
            keys = ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "nesterov",
                    "ns_steps", "ns_bf16", "match_rms_adamw")
            if any(getattr(now, k) != getattr(o, k) for k in keys):
                self.engine.set_options(gi, now)
                self._engine_options[gi] = now
