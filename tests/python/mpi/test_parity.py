"""Run on every rank of `mpirun -np 2 python -m pytest tests/python/mpi` (any world size that
divides the batch of 16 works). Each rank trains on its slice of every global batch with
ZeroOptimizer; each rank also trains torch.optim.AdamW on the whole batch in one process, the
reference, and compares.

The bound. Both sides run the same float32 math in a different order: the mean over the batch
is two half-batch means averaged by the engine instead of one mean, and the engine's fused
AdamW parenthesises the bias corrections differently from torch's (same formula). Each step's
update therefore differs by a few float32 ulps of the update (at most lr = 1e-2 per element),
about 1e-8 absolute, and these differences feed back through the following steps' gradients.
Measured over 20 steps the largest difference is about 1.5e-6 (in the embedding, whose rows see
few, noisy updates). The bound, 2e-5, leaves a factor of 10 above that and is 1e-4 of the
distance the parameters travel (20 steps x lr = 0.2); the errors it exists to catch are far
larger: decaying a no-decay parameter once moves it by lr x 0.1 x |p| ~ 5e-4, one update
missing or doubled moves ~1e-2, and a sum instead of a mean over ranks changes Adam's step by
~10 % because eps = 1e-3 is comparable to the gradients (see zs_testutil).
"""

import io
import time

import pytest
import torch

import zeroshard as zs
import zeroshard.torch as zt
from zs_testutil import (CLIP, EPS, LR, agree, batches, groups, make_model, max_abs_diff,
                         needs_compile, train_reference, train_zero, world)

BOUND = 2e-5
STEPS = 20


def zero_opt(model, stage, offload="none", **kw):
    return zt.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, gradient_clipping=CLIP,
                            param_groups=groups(model), offload_optimizer=offload,
                            collective_timeout_s=120, **kw)


@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_adamw_on_the_whole_batch(stage, offload):
    comm, rank, size = world()
    model, data = make_model(), batches(STEPS)
    ref = train_reference(model, data)
    opt = zero_opt(model, stage, offload)
    train_zero(opt, model, data, rank, size)
    got = opt.model_state_dict()
    diff = max_abs_diff(got, ref.state_dict())
    moved = max_abs_diff(got, make_model().state_dict())
    ok = diff <= BOUND and moved > 100 * BOUND and opt.last_result.step == STEPS
    if offload == "cpu":  # the optimizer state really is on the host tier
        ok = ok and opt.memory().at(zs.Tier.host, zs.MemKind.optim_state) > 0
    assert agree(comm, ok), (f"rank {rank}: stage {stage} offload {offload}: max |zero - adamw| "
                             f"= {diff:.3g} (bound {BOUND}), moved {moved:.3g}")


@needs_compile
def test_stage3_compiled_modules_match_adamw():
    # compile_modules() on every rank: the units' forwards compiled whole (fullgraph), their
    # gathering around them, collective, as in eager.
    comm, rank, size = world()
    model, data = make_model(), batches(STEPS)
    ref = train_reference(model, data)
    from torch._dynamo.utils import counters
    opt = zero_opt(model, 3)
    torch._dynamo.reset()
    counters.clear()
    names = opt.compile_modules(backend="aot_eager")
    train_zero(opt, model, data, rank, size)
    diff = max_abs_diff(opt.model_state_dict(), ref.state_dict())
    graphs = counters["stats"]["unique_graphs"]  # one per module class: they ran compiled
    assert agree(comm, diff <= BOUND and names == ["embed", "proj", "norm", "head"]
                 and graphs >= 3), (f"rank {rank}: max |zero - adamw| = {diff:.3g} (bound "
                                    f"{BOUND}), compiled {names}, {graphs} graphs")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hierarchical_sharding_matches_adamw(stage):
    # Groups of one rank: every rank holds whole shards, replicated; the reduced gradients are
    # all-reduced across the groups, in another order than a flat reduce-scatter sums them.
    comm, rank, size = world()
    model, data = make_model(), batches(STEPS)
    ref = train_reference(model, data)
    opt = zero_opt(model, stage, shard_group_size=1)
    train_zero(opt, model, data, rank, size)
    got = opt.model_state_dict()
    diff = max_abs_diff(got, ref.state_dict())
    g = opt.engine.shard_group()
    r = opt.last_result
    ok = (diff <= BOUND and (g.rank, g.size, g.index, g.count) == (0, 1, rank, size)
          and (size == 1 or r.comm_bytes > 0) and r.inter_node_bytes == 0)
    assert agree(comm, ok), (f"rank {rank}: stage {stage}: max |zero - adamw| = {diff:.3g}, "
                             f"group {g.rank}/{g.size} #{g.index}/{g.count}, bytes {r.comm_bytes}")


def test_gradient_accumulation_matches():
    # Two micro-steps per step on each rank: the engine averages over ranks and micro-steps.
    comm, rank, size = world()
    model, data = make_model(), batches(10)
    ref = train_reference(model, data)
    opt = zero_opt(model, 2, gradient_accumulation_steps=2)
    train_zero(opt, model, data, rank, size, micro=2)
    diff = max_abs_diff(opt.model_state_dict(), ref.state_dict())
    assert agree(comm, diff <= BOUND), f"rank {rank}: max diff {diff:.3g}"


def test_ranks_hold_shards_not_copies():
    comm, rank, size = world()
    model = make_model()
    opt = zero_opt(model, 3)
    info = [opt.engine.shard_info(u) for u in range(opt.engine.num_units())]
    ok = all(i.shard_numel * size == i.padded_numel and i.shard_offset == rank * i.shard_numel
             for i in info)
    # Stage 3 keeps 1/size of the parameters per rank (an f32 model's master weights alias
    # them and are counted once, as parameters).
    mem = opt.memory()
    held = sum(mem.at(t, k) for t in (zs.Tier.device, zs.Tier.host)
               for k in (zs.MemKind.param, zs.MemKind.master))
    ok = ok and held == sum(i.shard_numel for i in info) * 4
    ok = ok and all(p.numel() == 0 for p in model.parameters())  # released outside forward
    assert agree(comm, ok), f"rank {rank}: shards {info}, parameter bytes {held}"


@pytest.mark.parametrize("stage", [1, 3])
def test_state_dict_round_trip_continues_identically(stage):
    comm, rank, size = world()
    data = batches(8)
    a_model = make_model()
    a = zero_opt(a_model, stage)
    train_zero(a, a_model, data[:4], rank, size)
    buf = io.BytesIO()  # each rank saves and loads its own shard
    torch.save(a.state_dict(), buf)
    train_zero(a, a_model, data[4:], rank, size)

    b_model = make_model(seed=99)
    b = zero_opt(b_model, stage)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    train_zero(b, b_model, data[4:], rank, size)
    got, want = b.model_state_dict(), a.model_state_dict()
    same = all(torch.equal(got[k], want[k]) for k in want)
    assert agree(comm, same), f"rank {rank}: resumed training differs from uninterrupted"


def test_different_models_fail_on_every_rank():
    comm, rank, size = world()
    if size < 2:
        pytest.skip("needs two ranks")
    e = zs.Engine(zs.Config(stage=2, collective_timeout_s=60), comm)
    e.add_unit("layer", [zs.Param("w", shape=[10 + rank])])  # rank 1 registers a bigger one
    with pytest.raises(zs.ModelMismatchError) as info:
        e.finalize()
    assert "layer" in str(info.value) or "w" in str(info.value)
    assert agree(comm, True)


def test_initial_parameters_come_from_rank0():
    comm, rank, size = world()
    model = make_model(seed=rank)  # a different initialisation on every rank
    zero_opt(model, 2)
    rank0 = make_model(seed=0).state_dict()
    ok = all(torch.equal(model.state_dict()[k], rank0[k]) for k in rank0)
    assert agree(comm, ok), f"rank {rank}: parameters were not broadcast from rank 0"


def shared_tmpdir(comm, rank):
    """One new directory for all ranks: rank 0 makes it and broadcasts its path."""
    import tempfile
    buf = torch.zeros(512, dtype=torch.uint8)
    if rank == 0:
        path = tempfile.mkdtemp(prefix="zeroshard-ckpt-").encode()
        buf[:len(path)] = torch.tensor(list(path), dtype=torch.uint8)
    comm.broadcast(buf, 0, "checkpoint directory")
    return bytes(buf[buf != 0].tolist()).decode()


def test_checkpoint_loads_at_another_world_size_and_stage():
    comm, rank, size = world()
    data = batches(8)
    model = make_model()
    opt = zero_opt(model, 1)
    train_zero(opt, model, data[:4], rank, size)
    path = shared_tmpdir(comm, rank)
    opt.save_checkpoint(path)

    # Every rank, on its own, loads the checkpoint into a one-rank stage-3 optimizer.
    solo_model = make_model(seed=7)
    solo = zt.ZeroOptimizer(solo_model, stage=3, lr=LR, eps=EPS, gradient_clipping=CLIP,
                            param_groups=groups(solo_model), comm=zs.make_self_communicator())
    solo.load_checkpoint(path)
    loaded, saved = solo.model_state_dict(), opt.model_state_dict()
    exact = all(torch.equal(loaded[k], v) for k, v in saved.items())
    exact = exact and solo.engine.step_count() == 4
    # Both go on: the sharded run on its slices, the single rank on whole batches.
    train_zero(opt, model, data[4:], rank, size)
    train_zero(solo, solo_model, data[4:], 0, 1)
    diff = max_abs_diff(solo.model_state_dict(), opt.model_state_dict())
    assert agree(comm, exact and diff <= BOUND), (
        f"rank {rank}: loaded weights equal: {exact}; after 4 more steps max diff {diff:.3g}")
    comm.barrier("checkpoint test done")
    if rank == 0:
        import shutil
        shutil.rmtree(path)


def test_buffers_of_every_dtype_start_from_rank_0():
    # Masks (bool) and counters (int64) are buffers too: every rank starts from rank 0's, as
    # DDP does; DLPack has no bool, so a mask must cross as bytes (it failed before).
    comm, rank, size = world()
    model = make_model()
    model.register_buffer("mask", torch.tensor([rank % 2 == 0, True, rank > 0]))
    model.register_buffer("count", torch.tensor([rank * 7, -rank], dtype=torch.int64))
    zero_opt(model, 2)
    ok = (model.mask.tolist() == [True, True, False] and model.count.tolist() == [0, 0])
    assert agree(comm, ok), f"rank {rank}: mask {model.mask.tolist()}, count {model.count.tolist()}"


def test_a_model_with_a_layer_more_on_one_rank_fails_at_once_on_every_rank():
    # Before the initial values are broadcast: pairing different tensors would otherwise wait
    # for the collectives' timeout (120 s here) and then report something unrelated.
    comm, rank, size = world()
    if size < 2:
        pytest.skip("needs two ranks")
    model = make_model()
    if rank == 1:
        model.extra = torch.nn.Linear(4, 4)
    start = time.monotonic()
    with pytest.raises(zs.ModelMismatchError) as info:
        zero_opt(model, 2)
    took = time.monotonic() - start
    named = "'extra.weight'" in str(info.value) or "rank 1's model differs" in str(info.value)
    assert agree(comm, named and took < 30), f"rank {rank}: {took:.1f} s: {info.value}"


@pytest.mark.parametrize("stage", [0, 2])
def test_in_place_writes_on_every_rank_are_kept(stage):
    # The master weights are apart from the parameters (offloaded): each rank's write reaches
    # its shard of them (at stage 0, collectively, the whole state on every rank).
    comm, rank, size = world()
    data = batches(6)
    ref = make_model()
    ropt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)
    model = make_model()
    opt = zero_opt(model, stage, "cpu")
    for i, (tokens, labels) in enumerate(data):
        if i == 3:
            for m in (ref, model):
                with torch.no_grad():
                    m.proj.weight[:, ::2] = 0
                    m.head.bias.fill_(0.25)
        ropt.zero_grad()
        torch.nn.functional.cross_entropy(ref(tokens), labels).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ropt.step()
        train_zero(opt, model, [(tokens, labels)], rank, size)
    diff = max_abs_diff(opt.model_state_dict(), ref.state_dict())
    assert agree(comm, diff <= BOUND), f"rank {rank}: stage {stage}: {diff:.3g}"


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "cpu"), (2, "none"), (3, "none"),
                                           (3, "cpu")])
def test_full_state_per_parameter_as_deepspeed_reads_and_writes_it(stage, offload):
    # full_fp32_param / full_optimizer_state (DeepSpeed's safe_get_full_*) give each parameter
    # whole on every rank, equal to torch's AdamW; the setters change exactly that parameter.
    comm, rank, size = world()
    model, data = make_model(), batches(4)
    ref = make_model()  # torch's AdamW on the whole batch, keeping its optimizer's state
    ropt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)
    for tokens, labels in data:
        ropt.zero_grad()
        torch.nn.functional.cross_entropy(ref(tokens), labels).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ropt.step()
    ropt_state = {n: ropt.state[p] for n, p in ref.named_parameters()}
    opt = zero_opt(model, stage, offload)
    train_zero(opt, model, data, rank, size)
    refs = dict(ref.named_parameters())
    ok = True
    for name, p in model.named_parameters():
        w = opt.full_fp32_param(p)
        m = opt.full_optimizer_state(p, "exp_avg")
        v = opt.full_optimizer_state(p, "exp_avg_sq")
        ok &= tuple(w.shape) == tuple(refs[name].shape)
        ok &= (w - refs[name].detach()).abs().max().item() <= BOUND
        ok &= (m - ropt_state[name]["exp_avg"]).abs().max().item() <= BOUND
        ok &= (v - ropt_state[name]["exp_avg_sq"]).abs().max().item() <= BOUND
    assert agree(comm, ok), f"rank {rank}: a full state differs from torch's"
    # Setting one parameter's master moves that parameter only, on every rank.
    target = model.head.weight
    before = opt.model_state_dict()
    shape = tuple(make_model().head.weight.shape)  # at stage 3 the parameter is a shard
    new = torch.full(shape, 0.25)
    opt.set_full_fp32_param(target, new)
    opt.set_full_optimizer_state(target, "exp_avg", torch.zeros(shape))
    after = opt.model_state_dict()
    ok = torch.equal(opt.full_fp32_param(target), new)
    ok &= torch.equal(after["head.weight"], new)
    ok &= bool((opt.full_optimizer_state(target, "exp_avg") == 0).all())
    ok &= all(torch.equal(after[k], before[k]) for k in before if k != "head.weight")
    with pytest.raises(zs.InvalidArgumentError, match="keeps exp_avg, exp_avg_sq"):
        opt.full_optimizer_state(target, "momentum_buffer")
    assert agree(comm, ok), f"rank {rank}: set_full_* changed the wrong values"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_gathered_with_modifier_rank_reaches_every_rank(stage):
    # DeepSpeed's GatheredParameters(..., modifier_rank=0): what rank 0 writes reaches every
    # rank's parameters and shards of the master weights; the ranks then train on as one.
    comm, rank, size = world()
    model, data = make_model(), batches(2)
    opt = zero_opt(model, stage)
    with opt.gathered(model.head, modifier_rank=0):
        if rank == 0:
            model.head.weight.fill_(0.5)
    shape = tuple(make_model().head.weight.shape)
    ok = torch.equal(opt.full_fp32_param(model.head.weight), torch.full(shape, 0.5))
    ok &= torch.equal(opt.model_state_dict()["head.weight"], torch.full(shape, 0.5))
    train_zero(opt, model, data, rank, size)
    mine = opt.model_state_dict()["head.weight"].contiguous()
    first = mine.clone()
    comm.broadcast(first, 0, "rank 0's head.weight")
    ok &= torch.equal(mine, first) and not torch.equal(mine, torch.full(shape, 0.5))
    assert agree(comm, ok), f"rank {rank}: stage {stage}: rank 0's write did not reach every rank"


def test_module_tensors_a_rank_cannot_take_fail_every_rank():
    # The checkpoint's buffers are checked against each rank's model before the engine's
    # (collective) load: a rank whose buffer differs fails by name, every other rank with it,
    # and none waits in the engine's load for it.
    comm, rank, size = world()
    model = make_model()
    model.register_buffer("counts", torch.arange(4))
    opt = zero_opt(model, 2)
    train_zero(opt, model, batches(2), rank, size)
    path = shared_tmpdir(comm, rank)
    opt.save_checkpoint(path)
    other = make_model(seed=3)
    other.register_buffer("counts", torch.zeros(4, dtype=torch.long))
    b = zero_opt(other, 2)
    if rank == size - 1:
        other.counts = torch.zeros(5, dtype=torch.long)  # this rank's model changed since
    with pytest.raises(zs.InvalidArgumentError) as e:
        b.load_checkpoint(path)
    want = "'counts' is [4] in the checkpoint" if rank == size - 1 else "another rank"
    assert want in str(e.value), str(e.value)
    comm.barrier("module test done")
    if rank == 0:
        import shutil
        shutil.rmtree(path)
