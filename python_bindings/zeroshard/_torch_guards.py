"""What a managed parameter and its .grad look like to code that does not know the engine.

ZeroOptimizer hands each unit's gradients to the engine at the end of backward, and at stage 3
a parameter's values exist only while its unit is gathered. Code written for torch.optim reads
both anyway (clip_grad_norm_, gradient logging, GradScaler, a loss method on the model, a
generate() loop). Left as they are, those reads see None or an empty tensor and go on silently
(clip_grad_norm_ returns 0 for parameters without .grad). Here each of them raises instead, with
the parameter's name and what to use.
"""

import torch

from . import _core

# Calls that only touch a tensor's metadata or Python identity: let them through.
_METADATA = frozenset({"__get__", "__set__", "__hash__", "size", "dim", "numel", "register_hook",
                       "requires_grad_", "__reduce_ex__", "__deepcopy__", "is_floating_point",
                       "is_complex", "_has_compatible_shallow_copy_type",
                       # what torch.compile's tracer asks of a parameter's .grad
                       "_is_view", "stride", "storage_offset", "is_contiguous", "data_ptr",
                       "untyped_storage", "_storage", "is_inference", "is_sparse", "is_nested",
                       "_is_zerotensor", "is_neg", "is_conj", "element_size", "nbytes",
                       "itemsize", "_typed_storage", "_version"})
# Conversions, by the dtype and device each one asks for (None: unchanged); "to" parses its own.
_CONVERSIONS = {"float": (torch.float32, None), "double": (torch.float64, None),
                "half": (torch.float16, None), "bfloat16": (torch.bfloat16, None),
                "cpu": (None, torch.device("cpu"))}


def _conversion_target(func, args, kwargs):
    """(dtype, device) that a conversion call asks for, or None if func is no conversion."""
    name = getattr(func, "__name__", "")
    if name in _CONVERSIONS:
        return _CONVERSIONS[name]
    if name == "to":
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **(kwargs or {}))
        return dtype, device
    return None


def _converts_to_itself(t, target):
    """Whether a conversion to `target` (_conversion_target()) leaves tensor t as it is."""
    dtype, device = target
    if dtype is not None and dtype != t.dtype:
        return False
    if device is None:
        return True
    device = torch.device(device)
    return device.type == t.device.type and device.index in (None, t.device.index)


_PROPERTIES_WITH_VALUES = frozenset({"data"})


def _reads_values(func):
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: only .data exposes the values
        return getattr(getattr(func, "__self__", None), "__name__", "") in _PROPERTIES_WITH_VALUES
    return name not in _METADATA


def _call(func, args, kwargs):
    with torch._C.DisableTorchFunction():
        return func(*args, **(kwargs or {}))


class HandedGrad(torch.Tensor):
    """What p.grad holds after backward: the parameter's shape, dtype and device, no values. The
    gradient itself went to the engine (averaged over ranks, sharded from stage 2). Reading it
    raises; model.zero_grad() (zero_, requires_grad_, detach_) passes, and a zero_() of
    gradients the engine still holds for the coming step is refused by that step (they were
    reduced already); the next backward replaces it (ZeroOptimizer's hook on the parameter
    clears it first)."""

    _ZEROING = frozenset({"zero_", "requires_grad_", "detach_"})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls._ZEROING:
            if name == "zero_" and isinstance(args[0], HandedGrad):
                args[0]._zs_zeroed = True
            return args[0]
        target = _conversion_target(func, args, kwargs)  # model.to(its own device), say
        if target is not None and args and _converts_to_itself(args[0], target):
            return args[0]
        if not _reads_values(func):
            return _call(func, args, kwargs)
        who = next((a._zs_name for a in args if isinstance(a, HandedGrad)), "a parameter")
        raise _core.InvalidArgumentError(
            f"ZeroOptimizer: the gradient of '{who}' is not in .grad (read by {name}()): each "
            "unit's gradients go to the engine at the end of backward, to be averaged over "
            "ranks and sharded. Clip with opt.clip_grad_norm_(max_norm) (the global norm, "
            "returned; float('inf') only measures it) or gradient_clipping=...; the norm of "
            "every step is in opt.last_result.grad_norm; f16 loss scaling is the engine's "
            "(opt.backward(loss)), not torch's GradScaler")


# Why a change to .grad cannot reach the step, and what to do instead.
GRAD_NOT_READ = (
    "Each unit's gradients go to the engine as backward produces them (reduced over ranks at "
    "once), so .grad is not what the step reads and changing it cannot change the step. To drop "
    "this step's gradients call opt.zero_grad(); to keep parameters fixed, set "
    "requires_grad=False before building the optimizer or give their group lr 0; to scale or "
    "edit gradients, use a hook (p.register_hook) that runs during backward")

_ZERO = {}


def handed_grad(shape, dtype, device, name):
    """A HandedGrad for parameter `name` (a zero-stride view of one shared element)."""
    key = (dtype, device)
    if key not in _ZERO:
        _ZERO[key] = torch.zeros((), dtype=dtype, device=device)  # expands to any shape, () too
    g = torch.Tensor._make_subclass(HandedGrad, _ZERO[key].expand(shape))
    g._zs_name = name
    g._zs_zeroed = False
    return g


class ShardedParameter(torch.nn.Parameter):
    """A stage-3 parameter: an nn.Parameter whose values exist only while its unit is gathered
    (`_zs_unit().gathered`, a weak reference to ZeroOptimizer's bookkeeping). Any use of its
    values while released raises, naming what to use."""

    def _refuse_copy(self):
        u = self._zs_unit()
        if u is None or not u.gathered:
            raise _core.InvalidArgumentError(
                "ZeroOptimizer: a released stage-3 parameter cannot be pickled or copied (its "
                "values are shards in the engine). Something saved or copied holds the "
                "parameters: the model, or an optimizer's param_groups, which torch 1.13's "
                "OneCycleLR/CyclicLR state_dict() reaches through its bound anneal_func (drop "
                "that key before saving). Save the model with opt.model_state_dict() and the "
                "optimizer with opt.state_dict()")

    def __reduce_ex__(self, proto):
        self._refuse_copy()
        return super().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        self._refuse_copy()
        return super().__deepcopy__(memo)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if (getattr(func, "__name__", "") == "__set__" and len(args) == 2
                and getattr(getattr(func, "__self__", None), "__name__", "") == "grad"
                and args[1] is not None and not isinstance(args[1], HandedGrad)):
            u = args[0]._zs_unit()
            name = u.names[next(i for i, q in enumerate(u.params) if q is args[0])] if u else "?"
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: a tensor was assigned to the .grad of stage-3 parameter "
                f"'{name}'. {GRAD_NOT_READ}")
        target = _conversion_target(func, args, kwargs)
        if target is not None and args and isinstance(args[0], ShardedParameter) and (
                args[0]._zs_unit() is None or not args[0]._zs_unit().gathered):
            # model.to(device), .float(), .cpu() go through every parameter: to what it
            # already is, a released parameter is itself; anything else cannot be done. (A
            # gathered one converts as any tensor: weight.float() inside forward.)
            p, (dtype, device) = args[0], target
            if _converts_to_itself(p, target):
                return p
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: a released stage-3 parameter cannot be converted to "
                f"{dtype or p.dtype} on {device or p.device}: the engine owns it. Move or "
                "convert the model before building the optimizer; inside a forward, read it "
                "while its own module runs (or opt.register_forward_method / opt.gathered)")
        if _reads_values(func):
            for a in args:
                if isinstance(a, ShardedParameter):
                    u = a._zs_unit()
                    if u is None or not u.gathered:
                        _released(a, u, func)
        return _call(func, args, kwargs)


def _released(p, u, func):
    if u is None:
        raise _core.InvalidArgumentError(
            "ZeroOptimizer: a stage-3 parameter was read after its optimizer was freed; it "
            "holds no values (save them with opt.model_state_dict() before dropping it)")
    name = u.names[next(i for i, q in enumerate(u.params) if q is p)]
    raise _core.InvalidArgumentError(
        f"ZeroOptimizer: parameter '{name}' of unit '{u.name}' was read by "
        f"{getattr(func, '__name__', func)}() while released: at stage 3 a parameter exists "
        "only while its unit's module runs. For another module's forward that reads it (a "
        "shared weight), zeroshard.torch.register_external_parameter(module, parameter) "
        "before building the optimizer; for a method other than forward() that trains "
        "(a loss method), opt.register_forward_method(module, 'method'); to read parameters "
        "(generate(), evaluation) under torch.no_grad(), `with opt.gathered(module):`; "
        "their values, opt.model_state_dict()")
