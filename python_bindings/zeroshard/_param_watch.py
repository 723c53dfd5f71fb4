"""What a trainer does to a model's parameters once ZeroOptimizer holds them.

At stages 0-2 each managed parameter is a view of the engine's parameter buffer, and the engine
keeps the f32 master weights the next step() updates from: apart from the parameters when they
are bf16/f16 or the optimizer state is offloaded. torch.optim users write parameters in place
between steps (a pruning mask, nn.init on a layer, a submodule's load_state_dict(), weights
copied in by hand) and expect the write to stay. ParamWatch remembers each parameter's
version counter (torch bumps it on every in-place write; the engine's own writes go around
torch and do not), and step() adopts what changed into the master weights first, parameter by
parameter, so the write stays and the update continues from it (the optimizer's moments are
kept, as torch.optim keeps them).

It also refuses, at step(), what the engine cannot follow and would otherwise get wrong
silently: a parameter whose requires_grad changed after the optimizer was built (an unfrozen
one would never train, a frozen one would still move), and at stages 0-2 one whose tensor is no
longer the engine's memory (model.to(), .float(), .data replaced).
"""

import torch

from . import _core


class ParamWatch:
    def __init__(self, opt, frozen):
        self._opt = opt
        self._frozen = frozen  # [(name, parameter)] left out of the optimizer when built
        self.record()

    def record(self):
        """The parameters as they are now are the engine's (after construction or a load)."""
        if self._opt.stage == 3:
            return
        for u in self._opt._units:
            u.versions = [p._version for p in u.params]
            u.storage = [p.data_ptr() for p in u.params]

    def check(self):
        """Raises for a change the engine cannot follow (see the module doc)."""
        opt = self._opt
        for u in opt._units:
            for name, p in zip(u.names, u.params):
                if not p.requires_grad:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: '{name}' was frozen (requires_grad=False) after the "
                        "optimizer was built; the engine would still update it (no gradient "
                        "counts as zero, and its momentum and weight decay move it). Freeze "
                        "parameters before building the optimizer, or set its group's lr and "
                        "weight_decay to 0")
        for name, p in self._frozen:
            if p.requires_grad:
                raise _core.InvalidArgumentError(
                    f"ZeroOptimizer: '{name}' was unfrozen (requires_grad=True) after the "
                    "optimizer was built, which left it out; it would never train. Build the "
                    "optimizer after setting requires_grad (ZeroOptimizer.state_dict() carries "
                    "the state of the others over)")
        if opt.stage == 3:
            return
        for u in opt._units:
            for name, p, ptr, shape in zip(u.names, u.params, u.storage, u.shapes):
                if p.data_ptr() != ptr or p.dtype != opt._torch_dtype or tuple(p.shape) != shape:
                    raise _core.InvalidArgumentError(
                        f"ZeroOptimizer: '{name}' is no longer the engine's memory ({p.dtype}, "
                        f"{tuple(p.shape)}): model.to(), .float(), .half() or an assignment to "
                        ".data after the optimizer was built gave it a new tensor, which the "
                        "engine neither reads nor updates. Convert or move the model before "
                        "building the optimizer")

    def adopt_writes(self):
        """Stages 0-2: makes the parameters written in place since the last step the master
        weights of their elements. Collective at stage 0 (every rank decides together, since
        its whole f32 state is rebuilt from the shards); local otherwise."""
        opt = self._opt
        if opt.stage == 3:
            return
        changed = [u for u in opt._units
                   if any(p._version != v for p, v in zip(u.params, u.versions))]
        commit = False
        if opt.stage == 0 and opt.comm.size() > 1:
            flag = torch.tensor([1.0 if changed else 0.0], dtype=torch.float64)
            opt.comm.all_reduce(flag, "max", "in-place parameter writes (stage 0)")
            commit = flag.item() > 0
        elif opt.stage == 0:
            commit = bool(changed)
        for u in changed:
            self.adopt(u, [p._version != v for p, v in zip(u.params, u.versions)])
        if commit:
            opt.engine.commit_shards()
        if changed:
            self.record()

    def adopt(self, u, which):
        """This rank's shard of unit u's master weights takes the values of the parameters
        `which` marks (all: a whole load), element by element where the parameter differs from
        its master rounded to the parameter's dtype: the other elements keep their f32 master
        (a pruning mask applied every step must not round the whole master to bf16)."""
        opt = self._opt
        si = opt.engine.shard_info(u.index)
        master = torch.from_dlpack(opt.engine.read_shard(u.index, _core.StateKind.master))
        lo_shard, hi_shard = si.shard_offset, si.shard_offset + si.shard_numel
        offset = 0
        with torch.no_grad():
            for p, n, take in zip(u.params, u.numels, which):
                lo, hi = max(offset, lo_shard), min(offset + n, hi_shard)
                if take and hi > lo:
                    flat = p.detach().reshape(-1)[lo - offset:hi - offset].cpu()
                    m = master[lo - lo_shard:hi - lo_shard]
                    written = flat != m.to(flat.dtype)  # what the engine last made it
                    m[written] = flat[written].float()
                offset += n
        opt.engine.write_shard(u.index, _core.StateKind.master, master)


def refuse_sparse(model, trainable_ids):
    """Sparse gradients (nn.Embedding(sparse=True)) cannot be reduced into a unit's flat buffer."""
    for name, m in model.named_modules():
        if (isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
                and any(id(p) in trainable_ids for p in m.parameters(recurse=False))):
            raise _core.InvalidArgumentError(
                f"ZeroOptimizer: '{name or '<root>'}' ({type(m).__name__}) has sparse=True; its "
                "gradients would be sparse tensors, which the engine's flat gradient buffers do "
                "not take. Build it with sparse=False (the default)")


def same_model_on_every_rank(model, comm):
    """Collective: raises ModelMismatchError on every rank, naming the first difference, unless
    every rank has rank 0's parameters and buffers (names, shapes, dtypes, requires_grad):
    before the initial values are broadcast, which would otherwise pair different tensors and
    wait until the collectives time out."""
    mine = [f"{'parameter' if is_param else 'buffer'} '{n}' {tuple(t.shape)} {t.dtype}"
            + (" trainable" if is_param and t.requires_grad else "")
            for is_param, named in ((True, model.named_parameters()),
                                    (False, model.named_buffers()))
            for n, t in named]
    text = "\n".join(mine).encode()
    size = torch.tensor([len(text)], dtype=torch.int64)
    comm.broadcast(size, 0, "the model's description (size) from rank 0")
    wire = torch.zeros(int(size.item()), dtype=torch.uint8)
    if comm.rank() == 0:
        wire = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    if wire.numel():
        comm.broadcast(wire, 0, "the model's description from rank 0")
    theirs = bytes(wire.tolist()).decode().split("\n") if wire.numel() else []
    why = ""
    if theirs != mine:
        for i in range(max(len(theirs), len(mine))):
            a = theirs[i] if i < len(theirs) else "nothing more"
            b = mine[i] if i < len(mine) else "nothing more"
            if a != b:
                why = (f"rank {comm.rank()}'s model differs from rank 0's at entry {i}: rank 0 "
                       f"has {a}, rank {comm.rank()} has {b}")
                break
    flag = torch.tensor([float(comm.rank()) if why else -1.0], dtype=torch.float64)
    comm.all_reduce(flag, "max", "whether every rank has rank 0's model")
    if flag.item() >= 0:
        raise _core.ModelMismatchError(
            "ZeroOptimizer: " + (why or f"rank {int(flag.item())}'s model differs from rank "
                                        "0's (its error names the first difference)")
            + "; every rank must build the same model before the optimizer")
