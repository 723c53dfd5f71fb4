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
any world size and any stage; save_checkpoint_async(root) writes one while training goes on and
finish_checkpoint() publishes it.
state_dict() is the torch.optim form: this rank's shard of the f32 master weights and optimizer
state (plus step count, loss scale and hyperparameters), to torch.save one file per rank and
load into an optimizer over the same model at the same world size. Either way loading also
restores the model's parameters (they are rebuilt from the master weights).
"""

from .._torch_guards import HandedGrad
from ._config import _TORCH_DTYPES  # noqa: F401  (zeroshard.plan reads it)
from ._optimizer import ZeroOptimizer
from ._units import partition_units, register_external_parameter

__all__ = ["ZeroOptimizer", "partition_units", "register_external_parameter", "HandedGrad"]
