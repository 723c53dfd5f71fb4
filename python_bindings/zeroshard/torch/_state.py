"""State dicts and checkpoints: the optimizer's state_dict()/load_state_dict() (this rank's shard),
the model's whole state (model_state_dict, collective), and the engine's own checkpoints."""


import torch
from torch.utils import dlpack as _dlpack

from .. import _core
from ._config import _GROUP_KEYS, _as_written

# torch's dtypes a checkpoint's module tensors come in, as safetensors spells them.
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


# Optimizer state slots by optimizer kind, named as torch names them.
_STATE_NAMES = {
    _core.OptimizerKind.adam: ("exp_avg", "exp_avg_sq"),
    _core.OptimizerKind.adamw: ("exp_avg", "exp_avg_sq"),
    _core.OptimizerKind.lion: ("exp_avg",),
    _core.OptimizerKind.sgd: ("momentum_buffer",),
    # A Muon engine's first moment is a Muon parameter's momentum_buffer (torch.optim.Muon's
    # name, also taken by _state_kind()) or an AdamW parameter's exp_avg.
    _core.OptimizerKind.muon: ("exp_avg", "exp_avg_sq"),
}


_STATE_KINDS = (_core.StateKind.state0, _core.StateKind.state1)


_STATE_FORMAT = "zeroshard.sharded/1"


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


class _StatePart:
    """The state-dict and checkpoint part of ZeroOptimizer."""

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

    # Full-state access per parameter, as DeepSpeed's safe_get_full_* and safe_set_full_*: every
    # stage and tier, collective (call on every rank, between steps).

    def _locate(self, param):
        for u in self._units:
            for i, p in enumerate(u.params):
                if p is param:
                    return u, i
        raise _core.InvalidArgumentError(
            "ZeroOptimizer: the tensor is not a parameter this optimizer manages (frozen, in no "
            "param group, or of another model)")

    def _state_kind(self, key):
        if self._kind == _core.OptimizerKind.muon and key == "momentum_buffer":
            return _core.StateKind.state0
        names = _STATE_NAMES[self._kind]
        if key not in names:
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: the {self._kind.name} optimizer keeps {', '.join(names) or 'no'} "
                f"state per parameter, not '{key}'")
        if self._kind == _core.OptimizerKind.sgd and not self.engine.has_state(
                _core.StateKind.state0):
            raise _core.InvalidArgumentError(
                "ZeroOptimizer: sgd without momentum keeps no momentum_buffer")
        return (_core.StateKind.state0, _core.StateKind.state1)[names.index(key)]

    def _read_full(self, param, kind):
        u, i = self._locate(param)
        self._watch.adopt_writes()  # writes to the parameters since the last step come first
        flat = _dlpack.from_dlpack(self.engine.read_full(u.index, i, kind))
        return flat.view(u.shapes[i])

    def _write_full(self, param, kind, value):
        u, i = self._locate(param)
        value = torch.as_tensor(value).detach().to("cpu", torch.float32).contiguous()
        if tuple(value.shape) != u.shapes[i]:
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: '{u.names[i]}' has shape {u.shapes[i]}, got "
                f"{tuple(value.shape)}")
        self._watch.adopt_writes()
        self.engine.write_full(u.index, i, kind, value.reshape(-1))
        self._watch.record()  # the engine wrote the parameters, not the trainer

    def full_fp32_param(self, param):
        """The f32 master weights of `param`, whole, as a new CPU tensor of its shape
        (DeepSpeed's safe_get_full_fp32_param). Collective."""
        return self._read_full(param, _core.StateKind.master)

    def full_optimizer_state(self, param, key):
        """One optimizer state of `param` ("exp_avg", "exp_avg_sq", "momentum_buffer"), whole,
        as a new f32 CPU tensor of its shape (DeepSpeed's safe_get_full_optimizer_state).
        Collective."""
        return self._read_full(param, self._state_kind(key))

    def full_grad(self, param):
        """The reduced gradient of `param`, whole, as a new f32 CPU tensor of its shape
        (DeepSpeed's safe_get_full_grad): the mean over the ranks and the micro-steps, unscaled
        by the loss scale, before clipping. Read it after backward and before step(); like
        clip_grad_norm_() it closes the micro-steps, so call it on every rank, in the same
        order. Zeros for a parameter that got no gradient on any rank. Collective."""
        u, i = self._locate(param)
        self._check_grads()
        flat = _dlpack.from_dlpack(self.engine.read_full_grad(u.index, i))
        return flat.view(u.shapes[i])

    def set_full_fp32_param(self, param, value):
        """Overwrites the master weights of `param` with `value` (its shape; the same on every
        rank) and the parameter with them (DeepSpeed's safe_set_full_fp32_param). Collective."""
        self._write_full(param, _core.StateKind.master, value)

    def set_full_optimizer_state(self, param, key, value):
        """Overwrites one optimizer state of `param` (DeepSpeed's
        safe_set_full_optimizer_state). Collective."""
        self._write_full(param, self._state_kind(key), value)

    def _module_state(self):
        """What save() carries of the model besides the engine's state: the state_dict's
        tensors the engine does not train (frozen parameters, persistent buffers) as
        (name, dtype, shape, bytes), and the other names of trained ones (tied weights) as
        (name, the engine's name)."""
        tensors, aliases = [], []
        for key, t in self.model.state_dict(keep_vars=True).items():
            name = self._names.get(id(t))
            if name is not None:
                if key != name:
                    aliases.append((key, name))
                continue
            t = t.detach()
            if t.dtype not in _ST_DTYPES:
                raise _core.InvalidArgumentError(
                    f"save_checkpoint(): '{key}' is a {t.dtype} tensor, which a checkpoint "
                    f"cannot hold (it holds {', '.join(str(d) for d in _ST_DTYPES)})")
            flat = t.cpu().contiguous().reshape(-1)
            raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
            tensors.append((key, _ST_DTYPES[t.dtype], list(t.shape), raw.numpy().tobytes()))
        return tensors, aliases

    def save_checkpoint(self, root, tag=None):
        """Collective: writes the engine's checkpoint as root/<tag> (default "step<N>"; root is
        shared by the ranks) and points root/latest at it: master weights, optimizer state, the
        step count, the loss scaler's state and every group's hyperparameters, crash-safe and
        checksummed, in a layout that any world size and any stage can load with
        load_checkpoint(). Rank 0's frozen parameters and persistent buffers go with it, and
        every other name of a tied weight, so that the checkpoint (and `zeroshard ckpt export`)
        holds every name of the model's state_dict. An existing tag is refused. Returns the
        tag's path."""
        return self.engine.save(str(root), tag or "", *self._checkpoint_module())

    def _checkpoint_module(self):
        """What a save takes besides the engine's state: rank 0's module tensors and aliases,
        after the hyperparameters and the trainer's parameter writes are the engine's."""
        self._sync_hyperparameters()
        self._watch.adopt_writes()
        return self._module_state() if self.comm.rank() == 0 else ([], [])

    def save_checkpoint_async(self, root, tag=None):
        """Collective: save_checkpoint() of the state as it is now, written by a thread while
        training goes on; finish_checkpoint() (collective) waits for it and publishes the tag,
        as the next save or load does first. The state is copied into a snapshot in host memory
        (kept for the next save; `memory()` shows it as "checkpoint_snapshot"), whose copy the
        next step() waits for if it is not done; rank 0's frozen parameters and buffers are
        copied now. With checkpoint_async=True (JSON zeroshard.checkpoint_async) the snapshot
        is made with the optimizer and its pages faulted in while training starts, so the first
        save costs the trainer what later ones do. close() with a save pending abandons it (no
        tag appears)."""
        self.engine.save_async(str(root), tag or "", *self._checkpoint_module())

    def finish_checkpoint(self):
        """Collective: waits for the pending save_checkpoint_async() and publishes its tag;
        returns the tag's path, or None when none is pending. Raises the save's error on every
        rank if a rank failed to write."""
        path = self.engine.finish_save()
        return path if str(path) not in ("", ".") else None

    def _read_module(self, path):
        """The checkpoint's module tensors, checked against the model before any state changes:
        [(the model's tensor, a CPU tensor of the saved values)]."""
        tensors, _ = _core.read_module_state(str(path))
        have = self.model.state_dict(keep_vars=True)
        out = []
        for name, dtype, shape, raw in tensors:
            t = have.get(name)
            if t is None or id(t) in self._names:
                raise _core.InvalidArgumentError(
                    f"load_checkpoint({path}): the checkpoint holds '{name}', which this model "
                    "has no frozen parameter or buffer of")
            if list(t.shape) != list(shape):
                raise _core.InvalidArgumentError(
                    f"load_checkpoint({path}): '{name}' is {list(shape)} in the checkpoint, "
                    f"{list(t.shape)} in this model")
            saved = torch.frombuffer(bytearray(raw), dtype=_TORCH_DTYPES[dtype]) if raw else \
                torch.empty(0, dtype=_TORCH_DTYPES[dtype])
            out.append((t, saved.reshape(shape)))
        return out

    def load_checkpoint(self, path, load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        """Collective: loads a checkpoint (a tag directory, or a root's latest tag) written at
        any world size or stage into this optimizer (same model: unit and parameter names,
        shapes, optimizer), in one pass: a load refused by the manifest or a file's header
        changes nothing; a damaged block leaves the optimizer refusing to step until a load
        succeeds. The model's
        parameters are rebuilt from the loaded master weights, and the param groups take the
        saved hyperparameters (a scheduler stepped since construction is not rewound).
        DeepSpeed's choices: load_optimizer_states=False keeps this optimizer's moments, step
        count and loss scale; load_lr_scheduler_states=False keeps the groups' hyperparameters;
        load_module_only=True does both (the weights alone)."""
        states = load_optimizer_states and not load_module_only
        hyper = load_lr_scheduler_states and not load_module_only
        failure = None
        try:
            module = self._read_module(path)
        except _core.Error as e:
            failure = e
        if self.comm.size() > 1:  # every rank fails, or none: the engine's load is collective
            flag = torch.tensor([0.0 if failure is None else 1.0], dtype=torch.float64,
                                device=self._device)
            self.comm.all_reduce(flag, "max", "load_checkpoint(): the module's tensors")
            if failure is None and flag.item() != 0.0:
                raise _core.InvalidArgumentError(
                    f"load_checkpoint({path}): another rank could not take the checkpoint's "
                    "module tensors (its error names why)")
        if failure is not None:
            raise failure
        self.engine.load(str(path), optimizer_states=states, hyperparameters=hyper)
        with torch.no_grad():
            for t, saved in module:
                t.copy_(saved)
        for gi, g in enumerate(self.param_groups if hyper else ()):
            o = self.engine.options(gi)
            g["lr"] = _as_written(o.lr)
            if "betas" in g:
                g["betas"] = (_as_written(o.beta1), _as_written(o.beta2))
            for key in ("eps", "weight_decay", "momentum"):
                if key in g:
                    g[key] = _as_written(getattr(o, key))
            if "nesterov" in g:
                g["nesterov"] = o.nesterov
            if "ns_steps" in g:  # a Muon group
                g["ns_steps"] = o.ns_steps
                g["ns_bf16"] = o.ns_bf16
                g["adjust_lr_fn"] = "match_rms_adamw" if o.match_rms_adamw else "original"
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
            if (self._kind == _core.OptimizerKind.sgd and "momentum" in saved
                    and (_norm(saved["momentum"]) != 0) != (g["momentum"] != 0)):
                raise _core.InvalidArgumentError(
                    f"load_state_dict(): param_groups[{gi}]['momentum'] was "
                    f"{saved['momentum']!r}, this optimizer has {g['momentum']!r}: the momentum "
                    "buffer cannot turn on or off (build the optimizer with the saved momentum)")
            # A Muon engine's groups keep their kind (the engine fixed it when it was built).
            if "use_muon" in saved and bool(saved["use_muon"]) != g["use_muon"]:
                raise _core.InvalidArgumentError(
                    f"load_state_dict(): param_groups[{gi}] was a "
                    f"{'Muon' if saved['use_muon'] else 'AdamW'} group, here it is "
                    f"{'a Muon' if g['use_muon'] else 'an AdamW'} one: build the optimizer with "
                    "the saved groups")
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
