"""Stage 3: gathering a unit's parameters around its module's forward and backward, releasing them
after, and gathering on demand (gathered(), register_forward_method())."""

import contextlib
import functools
import types
import weakref

import torch
from torch.utils import dlpack as _dlpack

from .. import _core
from .._torch_guards import ShardedParameter

from ._private import _autograd_calls, _first_pre_hook, _resize_storage
from ._units import GradState, _tensors


def _eager(hook):
    """hook, run eagerly under torch.compile: the gathering and releasing around a unit's
    forward calls the engine and swaps the parameters' storage, which a graph cannot hold, so
    Dynamo breaks the graph there (inside a loop, it runs the rest of the caller eagerly).
    compile_modules() keeps these hooks out of the compiled code instead."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(hook) if disable is not None else hook


def _own_frame(fn, name):
    """fn behind a function of its own code object, hence its own Dynamo cache: one per module.
    torch.compile would put a function of torch's own modules (nn.Linear.forward) behind a
    wrapper whose code every such function shares, and one function shared by a class's
    modules keeps an entry per module where they differ (a layer index, a shape); either way
    one cache passes its recompile limit (8), which fullgraph=True makes an error. The
    signature stays fn's (generate() and Trainer read it)."""
    def forward(*args, **kwargs):
        return fn(*args, **kwargs)
    functools.update_wrapper(forward, fn)
    forward.__code__ = forward.__code__.replace(co_name=name)
    return forward


class _GatherPart:
    """The stage-3 gathering part of ZeroOptimizer."""

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
        u.pre, u.post = _eager(self._make_pre_forward(u)), _eager(self._make_post_forward(u))
        self._hook_forward(u.module, u.pre, u.post)

    def _gather_for(self, module, units):
        """module's forward gathers `units` as their own modules' forwards do (and again for
        its backward)."""
        def pre(m, args):
            for u in units:
                u.pre(m, args)

        def post(m, args, out):
            for u in reversed(units):
                u.post(m, args, out)
        self._hook_forward(module, _eager(pre), _eager(post))

    def _hook_forward(self, module, pre, post):
        self._hooks.append(_first_pre_hook(module, pre))
        self._hooks.append(module.register_forward_hook(post))
        self._gathering.add(id(module))

    def compile_modules(self, **options):
        """torch.compile the forward() of each largest module that has trainable parameters and
        no gathering inside it (a stage-3 unit's or tied module's hooks, a method given to
        register_forward_method()); returns their names ("" for the model itself). At stage 3
        those are the units' modules (each transformer block, say) and the modules that read
        another unit's weight (a tied head): their gathering hooks run around forward(),
        outside the compiled code, and each compiles whole with fullgraph=True (the default
        there; `options` are torch.compile's keywords), so with no graph break, as FSDP2's
        per-block compile does. The code around them (the loop over blocks, the loss) stays
        eager. At stages 0-2 it is the model's forward, with torch.compile's defaults: no
        graph break of zeroshard's, though the model's own code may have some. Not for
        mode="reduce-overhead" at stage 3 (CUDA graphs): every gathering gives the
        parameters new storage. Modules compiled by an earlier call stay as they are; close()
        gives them their own forward() back. See docs/python.md for torch.compile(model)."""
        if self.engine is None:
            raise _core.InvalidArgumentError("ZeroOptimizer.compile_modules() after close()")
        if not hasattr(torch, "compile"):
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer.compile_modules() needs torch.compile (torch >= 2.0); this is "
                f"torch {torch.__version__}")
        options = {"fullgraph": self.stage == 3, **options}
        compiled, seen = [], set(self._compiled)

        def visit(name, m):
            if id(m) in seen or not any(p.requires_grad for p in m.parameters()):
                return
            seen.add(id(m))
            gathering = any(id(c) in self._gathering for c in m.modules() if c is not m) or \
                any(id(c) in self._gathering_methods for c in m.modules())
            if type(m).forward is not torch.nn.Module.forward and not gathering:
                # Its forward, not nn.Module.compile(), which compiles the hooks as well: the
                # function bound to m anew, so that a deep copy of the model runs its own.
                f = m.forward
                bound = getattr(f, "__self__", None) is m
                frame = _own_frame(f.__func__ if bound else f, f"{type(m).__qualname__}_"
                                   f"{name.replace('.', '_') or 'model'}_forward")
                fn = torch.compile(frame, **options)
                self._replace_method(m, "forward", types.MethodType(fn, m) if bound else fn)
                self._compiled.add(id(m))
                compiled.append(name)
                return
            for n, c in m.named_children():
                visit(f"{name}.{n}" if name else n, c)

        visit("", self.model)
        return compiled

    def _replace_method(self, module, name, fn):
        """module.<name> = fn, undone by close()."""
        self._forward_methods.append((module, name, module.__dict__.get(name)))
        setattr(module, name, fn)

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
                    if un.grads is GradState.HANDED:  # went to the engine: a second pass
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

    @contextlib.contextmanager
    def gathered(self, module=None, modifier_rank=None):
        """Stage 3: the parameters of `module` (default: the whole model) present for reading
        outside its forward() -- generate(), evaluation, logging -- under torch.no_grad().
        In-place writes are refused (they would be lost), unless `modifier_rank` is given
        (DeepSpeed's GatheredParameters(..., modifier_rank=r), as initialisation code uses):
        then what rank r writes in place reaches every rank's parameters and the master
        weights on exit (collective; the moments are kept). A no-op at stages 0-2 without
        modifier_rank."""
        if modifier_rank is not None:
            with self._modified(module, modifier_rank):
                yield
            return
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

    @contextlib.contextmanager
    def _modified(self, module, rank):
        """gathered(module, modifier_rank=rank): on exit, the parameters `rank` wrote in place
        become every rank's (broadcast from it) and the master weights (write_full)."""
        if not 0 <= rank < self.comm.size():
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer.gathered(): modifier_rank {rank} is not a rank of "
                f"{self.comm.size()}")
        units = self._units_of(module)
        if self.stage == 3:
            for u in units:
                u.pre(u.module, ())
        before = [[p._version for p in u.params] for u in units]
        try:
            with torch.no_grad():
                yield
            # Which parameters the modifier wrote: its flags, broadcast.
            flags = torch.tensor([float(p._version != v) for u, vs in zip(units, before)
                                  for p, v in zip(u.params, vs)], dtype=torch.float64)
            if flags.numel():
                self.comm.broadcast(flags, rank, "gathered(): written parameters")
            written, k = [], 0
            for u, vs in zip(units, before):
                for i, p in enumerate(u.params):
                    if flags[k] != 0:
                        written.append((u, i, p.detach().to("cpu", torch.float32).clone()))
                    k += 1
                u.versions = [p._version for p in u.params]  # released without complaint
        finally:
            if self.stage == 3:
                for u in reversed(units):
                    u.post(u.module, (), None)
        for u, i, value in written:
            self.comm.broadcast(value, rank, f"gathered(): '{u.names[i]}' from rank {rank}")
            self._write_full(u.params[i], _core.StateKind.master, value.view(u.shapes[i]))

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

        self._gathering_methods.add(id(module))
        self._replace_method(module, name, wrapped)
