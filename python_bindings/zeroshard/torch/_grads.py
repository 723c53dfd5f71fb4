"""Gradient hand-over: hooks on each parameter's AccumulateGrad node, the hand-off of a unit's
gradients to the engine when all have arrived, and the end-of-backward callback that hands over
the rest."""

import weakref

import torch

from .. import _core
from .._torch_guards import GRAD_NOT_READ, HandedGrad, handed_grad

from ._private import _accumulate_grad_node, _autograd_calls, _engine_will_execute, _queue_callback
from ._units import GradState, _tensors


class _GradsPart:
    """The gradient hand-over part of ZeroOptimizer."""

    def _register_grad_hooks(self, u):
        with torch.enable_grad():
            for i, p in enumerate(u.params):
                acc = _accumulate_grad_node(p)
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

    def _fills_grads(self):
        """Whether the autograd pass running now accumulates into the parameters' .grad (a
        backward) rather than returning gradients (torch.autograd.grad(), as a gradient penalty
        calls it), asked of autograd: for a hook on an autograd device thread, whose stack does
        not show the pass. (A parameter whose dtype changed since the build has a new
        AccumulateGrad node, which this does not know.)"""
        for acc in self._grad_accs:
            try:
                if _engine_will_execute(acc):
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
        _queue_callback(self._end_of_backward)
        self._callback_queued = True

    def _micro_steps_rule(self):
        k = self._accum
        return (f"with gradient_accumulation_steps = {k} each backward() is one micro-step and "
                f"a step takes exactly {k}: call step() after every {k} backward() call(s), or "
                "opt.zero_grad() to drop the ones taken")

    def _on_grad(self, u, i):
        self._queue_end_of_backward()
        if u.grads is GradState.HANDED:
            self._refuse_second_pass(u, u.names[i])
        if u.grad_arrived(i):
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
        for p in u.params:
            g = p.grad
            if g is None or isinstance(g, HandedGrad):
                # Unused in this backward: none. As in torch, a parameter without a gradient on
                # every rank in every micro-step is left alone by the step.
                grads.append(None)
                continue
            if not g.is_contiguous():
                # AccumulateGrad lays .grad out like the parameter (contiguous here); this is
                # only reached if a user hook replaced it with a strided tensor.
                g = g.contiguous()
            grads.append(g.detach())
        self.engine.grads_ready(u.index, grads)  # copies; the reduction starts now
        self._set_handed(u)
        u.set_grads(GradState.HANDED)
        if self.stage == 3 and u.gathered:
            self._release(u)

    def _set_handed(self, u):
        # .grad says where the gradient went: reading it raises, naming the alternatives. A
        # parameter that got none keeps None, as in torch.
        for p, name, shape in zip(u.params, u.names, u.shapes):
            if p.grad is None:
                continue
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
            if u.grads is not GradState.HANDED:
                self._hand_off(u)
        for u in self._units:
            u.set_grads(GradState.WAITING)
            if self.stage == 3 and u.gathered and not u.forward_stack:
                self._release(u)
