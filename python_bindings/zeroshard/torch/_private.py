"""Every call zeroshard.torch makes into PyTorch's private or version-dependent API, in one place.

Each was checked against torch 1.13 (Debian 12's python3-torch, the CI's) and torch 2.11 (with
CUDA 13, on the H100 of 2026-11-24); a new torch version is checked here first. Besides these,
the package reads Tensor._version (the in-place write counter: _gather.py, ../_param_watch.py)
and subclasses Tensor for the guards of ../_torch_guards.py."""

import sys

import torch

# The Python frames of torch.autograd.backward() and grad(), which _autograd_calls() looks for.
_BACKWARD_CODE = torch.autograd.backward.__code__
_GRAD_CODE = torch.autograd.grad.__code__


def _autograd_calls():
    """(grad, backward): the torch.autograd.grad() and backward() calls on this thread's Python
    stack. On the CPU they are the call that started the pass running now and those it is nested
    in (a use_reentrant=True checkpoint runs a backward of its own per segment inside the
    trainer's); a hook that runs on an autograd device thread (CUDA) sees only the passes
    started on that thread, usually none."""
    if _compiling():  # Dynamo cannot trace sys._getframe; a compiled forward runs in no pass
        return 0, 0
    grad = backward = 0
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _BACKWARD_CODE:
            backward += 1
        elif f.f_code is _GRAD_CODE:
            grad += 1
        f = f.f_back
    return grad, backward


def _compiling():
    """Whether Dynamo is tracing this call (torch.compile); False on torch without it."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):  # torch >= 2.3
        return compiler.is_compiling()
    dynamo = getattr(torch, "_dynamo", None)
    return bool(dynamo is not None and hasattr(dynamo, "is_compiling") and dynamo.is_compiling())


def _resize_storage(t, numel):
    """Frees (numel = 0) or re-allocates a tensor's storage in place, keeping its identity, so
    views autograd saved of it see the new memory."""
    if hasattr(t, "untyped_storage"):  # torch >= 2.0
        t.untyped_storage().resize_(numel * t.element_size())
    else:
        t.storage().resize_(numel)


def _first_pre_hook(module, hook):
    """A forward pre-hook that runs before those registered earlier (weight_norm's and
    spectral_norm's read the parameters it gathers)."""
    try:
        return module.register_forward_pre_hook(hook, prepend=True)
    except TypeError:  # torch before 2.0
        handle = module.register_forward_pre_hook(hook)
        module._forward_pre_hooks.move_to_end(handle.id, last=False)
        return handle


def _accumulate_grad_node(p):
    """The AccumulateGrad node of leaf `p`, whose hook runs once p.grad is complete (torch 1.13 has
    no register_post_accumulate_grad_hook, which 2.1 added)."""
    return p.expand_as(p).grad_fn.next_functions[0][0]


def _engine_will_execute(node):
    """Whether the autograd pass running now will execute `node` (torch._C, both versions)."""
    return torch._C._will_engine_execute_node(node)


def _queue_callback(fn):
    """Runs `fn` when the autograd pass running now ends (the engine's private queue_callback,
    both versions)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
