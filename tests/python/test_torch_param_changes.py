"""What trainers do to a model's parameters after building ZeroOptimizer, one rank: write them in
place (pruning masks, re-initialising a layer, copying weights in, a submodule's
load_state_dict()), change requires_grad, convert the model, and models whose modules read
their parameters in unusual ways (nn.MultiheadAttention's out_proj, weight_norm's pre-hook,
sparse embeddings, a second optimizer over the same model)."""

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import zeroshard as zs  # noqa: E402
import zeroshard.torch as zt  # noqa: E402
from zs_testutil import (EPS, LR, batches, groups, loss_fn, make_model,  # noqa: E402
                         max_abs_diff)

BOUND = 2e-5  # as in test_torch.py


def zero(model, stage, **kw):
    return zt.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, param_groups=groups(model),
                            comm=zs.make_self_communicator(), **kw)


def prune(model):
    """Writes in place, as pruning and re-initialisation do."""
    with torch.no_grad():
        model.proj.weight[:, ::2] = 0
        model.head.bias.fill_(0.25)


def train(opt_step, model, data, at, change):
    for i, (tokens, labels) in enumerate(data):
        if i == at:
            change(model)
        opt_step(model, tokens, labels)


# Stages 0-2 keep an f32 master apart from the parameters when they are bf16 or the state is
# offloaded: a write to a parameter must reach the master, or the next step undoes it.
@pytest.mark.parametrize("offload", [None, "cpu"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_in_place_writes_between_steps_are_kept(stage, offload):
    data = batches(6)
    ref = make_model()
    ropt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)

    def ref_step(m, tokens, labels):
        ropt.zero_grad()
        loss_fn(m, tokens, labels).backward()
        ropt.step()

    train(ref_step, ref, data, 3, prune)
    model = make_model()
    opt = zero(model, stage, offload_optimizer=offload)

    def zs_step(m, tokens, labels):
        opt.zero_grad()
        loss_fn(m, tokens, labels).backward()
        opt.step()

    train(zs_step, model, data, 3, prune)
    assert max_abs_diff(opt.model_state_dict(), ref.state_dict()) <= BOUND
    # Without the write the result is far off: the check above can fail.
    plain = make_model()
    popt = torch.optim.AdamW(groups(plain), lr=LR, eps=EPS)
    for tokens, labels in data:
        popt.zero_grad()
        loss_fn(plain, tokens, labels).backward()
        popt.step()
    assert max_abs_diff(plain.state_dict(), ref.state_dict()) > 100 * BOUND


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_parameters_written_in_place_stay_written(stage):
    model = make_model().to(torch.bfloat16)
    opt = zero(model, stage)
    tokens, labels = batches(1)[0]
    for g in opt.param_groups:
        g["lr"] = 0.0
    with torch.no_grad():
        model.proj.weight.zero_()
    loss_fn(model, tokens, labels).float().backward()
    opt.step()
    assert model.proj.weight.abs().max().item() == 0.0
    # The master weights took the write: state_dict() and checkpoints see it too.
    assert opt.model_state_dict()["proj.weight"].abs().max().item() == 0.0


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_submodule_load_state_dict_is_kept(stage):
    model = make_model()
    opt = zero(model, stage, offload_optimizer="cpu")
    pretrained = make_model(seed=5)
    model.proj.load_state_dict(pretrained.proj.state_dict())  # the root's hooks do not see it
    for g in opt.param_groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    tokens, labels = batches(1)[0]
    loss_fn(model, tokens, labels).backward()
    opt.step()
    assert torch.equal(model.proj.weight, pretrained.proj.weight)


def test_submodule_load_state_dict_at_stage_3_is_refused_clearly():
    model = make_model()
    zero(model, 3)
    with pytest.raises(zs.InvalidArgumentError, match="load_state_dict"):
        model.proj.load_state_dict(make_model(seed=5).proj.state_dict())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_requires_grad_changed_after_build_is_refused(stage):
    tokens, labels = batches(1)[0]
    model = make_model()
    model.norm.weight.requires_grad_(False)
    opt = zero(model, stage)
    model.norm.weight.requires_grad_(True)  # unfrozen: the engine would never train it
    # Refused at the end of backward, or else at the step.
    with pytest.raises(zs.InvalidArgumentError, match=r"'norm.weight'.*requires_grad"):
        loss_fn(model, tokens, labels).backward()
        opt.step()

    model = make_model()
    opt = zero(model, stage)
    model.proj.weight.requires_grad_(False)  # frozen: the engine would still move it
    with pytest.raises(zs.InvalidArgumentError, match=r"'proj.weight'.*requires_grad"):
        loss_fn(model, tokens, labels).backward()
        opt.step()


def test_model_converted_after_build_is_refused():
    model = make_model()
    opt = zero(model, 2)
    model.to(torch.bfloat16)  # new tensors: no longer the engine's memory
    tokens, labels = batches(1)[0]
    with pytest.raises(zs.InvalidArgumentError, match=r"'embed.weight'.*model.to"):
        loss_fn(model, tokens, labels).float().backward()  # at its end, or else at the step
        opt.step()


def test_sparse_embedding_is_refused_when_built():
    model = make_model()
    model.embed = nn.Embedding(50, 16, sparse=True)
    with pytest.raises(zs.InvalidArgumentError, match=r"'embed'.*sparse"):
        zero(model, 2)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_second_optimizer_needs_the_first_closed(stage):
    data = batches(4)
    model = make_model()
    first = zero(model, stage)
    with pytest.raises(zs.InvalidArgumentError, match=r"already belongs.*close\(\)"):
        zero(model, stage)
    tokens, labels = data[0]
    loss_fn(model, tokens, labels).backward()
    first.step()
    trained = first.model_state_dict()
    first.close()
    with pytest.raises(zs.InvalidArgumentError, match="after close"):
        first.step()
    # The model is ordinary again, with the values it had, and trains under torch.optim ...
    assert all(type(p) is nn.Parameter and p.grad is None for p in model.parameters())
    assert max_abs_diff(model.state_dict(), trained) == 0
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)
    for tokens, labels in data[1:]:
        ropt.zero_grad()
        loss_fn(ref, tokens, labels).backward()
        ropt.step()
    # ... and under a new ZeroOptimizer, as torch.optim does from there.
    second = zero(model, stage)
    for tokens, labels in data[1:]:
        second.zero_grad()
        loss_fn(model, tokens, labels).backward()
        second.step()
    assert max_abs_diff(second.model_state_dict(), ref.state_dict()) <= BOUND


class Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj's weight itself; out_proj's forward never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 7)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


class WeightNormed(nn.Module):
    """weight_norm registers its forward pre-hook before the optimizer's gather hook."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.utils.weight_norm(nn.Linear(16, 32))
        self.head = nn.Linear(32, 7)

    def forward(self, tokens):
        return self.head(torch.tanh(self.proj(self.embed(tokens).mean(1))))


@pytest.mark.parametrize("make", [Attention, WeightNormed])
def test_modules_that_read_their_parameters_unusually_train_at_stage_3(make):
    # unit_numel below the attention's size: it would be split into its children otherwise.
    assert_trains_like_adamw(make, 3, unit_numel=600)


def assert_trains_like_adamw(make, stage, **kw):
    """Four steps of ZeroOptimizer on make() against torch.optim.AdamW on another make() (the
    same seed: weight_norm's module cannot be deep-copied)."""
    data = batches(4)
    ref, model = make(), make()
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    opt = zt.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, comm=zs.make_self_communicator(),
                           **kw)
    for tokens, labels in data:
        ropt.zero_grad()
        loss_fn(ref, tokens, labels).backward()
        ropt.step()
        opt.zero_grad()
        loss_fn(model, tokens, labels).backward()
        opt.step()
    assert max_abs_diff(opt.model_state_dict(), ref.state_dict()) <= BOUND


class SharedMlp(nn.Module):
    """One MLP object registered under two blocks: its parameters are the first block's unit,
    and the second block runs it without the first block's forward around it."""

    class Block(nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.mlp = mlp

        def forward(self, x):
            return x + self.mlp(self.ln(x))

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        shared = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
        self.b0, self.b1 = self.Block(shared), self.Block(shared)
        self.head = nn.Linear(16, 7)

    def forward(self, tokens):
        return self.head(self.b1(self.b0(self.embed(tokens).mean(1))))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_submodule_shared_by_two_parents_trains(stage):
    assert_trains_like_adamw(SharedMlp, stage)


def test_a_write_keeps_the_f32_master_of_the_elements_it_did_not_change():
    # A bf16 model's master weights are f32: a mask applied to a few elements must not round the
    # master of the rest of the parameter to bf16 (updates below half a bf16 step would be lost).
    model = make_model().to(torch.bfloat16)
    opt = zero(model, 2)
    tokens, labels = batches(1)[0]
    loss_fn(model, tokens, labels).float().backward()
    opt.step()  # the masters now hold values bf16 cannot
    unit = next(u for u in opt._units if "proj.weight" in u.names)
    before = torch.from_dlpack(opt.engine.read_shard(unit.index, zs.StateKind.master)).clone()
    assert not torch.equal(before, before.to(torch.bfloat16).float())
    with torch.no_grad():
        model.proj.weight[0, 0] = 0
    for g in opt.param_groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    loss_fn(model, tokens, labels).float().backward()
    opt.step()
    after = torch.from_dlpack(opt.engine.read_shard(unit.index, zs.StateKind.master))
    at = unit.names.index("proj.weight")
    offset = sum(unit.numels[:at])
    assert after[offset].item() == 0.0
    changed = (after != before).nonzero().flatten().tolist()
    assert changed == [offset], f"elements {changed[:5]} of the master changed"


def test_stage_3_model_to_what_it_already_is_passes_and_a_real_move_is_refused():
    model = make_model()
    opt = zero(model, 3)
    for call in (lambda: model.to("cpu"), lambda: model.to(torch.float32), model.float,
                 model.cpu, lambda: model.to(torch.device("cpu"))):
        call()
    with pytest.raises(zs.InvalidArgumentError, match="cannot be converted.*before building the optimizer"):
        model.to(torch.bfloat16)
    tokens, labels = batches(1)[0]  # and training goes on
    loss_fn(model, tokens, labels).backward()
    opt.step()
    assert opt.last_result.step == 1
    # With the gradients handed over (.grad holds placeholders) too.
    loss_fn(model, tokens, labels).backward()
    model.to("cpu")
    opt.step()


class CastsInForward(nn.Module):
    """A bf16 model whose head converts its gathered weight in its own forward (as a LayerNorm
    computed in f32 does)."""

    class Head(nn.Linear):
        def forward(self, x):
            return x.float() @ self.weight.float().t() + self.bias.to(torch.float32)

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.head = self.Head(16, 7)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def test_stage_3_gathered_parameters_convert_inside_forward():
    model = CastsInForward().to(torch.bfloat16)
    opt = zt.ZeroOptimizer(model, stage=3, lr=LR, comm=zs.make_self_communicator())
    tokens, labels = batches(1)[0]
    loss_fn(model, tokens, labels).backward()
    opt.step()
    assert opt.last_result.step == 1
