"""zeroshard.torch on the habits of torch.optim users, one rank: weights tied across modules,
parameters read outside forward(), and .grad after backward (clip_grad_norm_, logging)."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import zeroshard as zs  # noqa: E402
import zeroshard.torch as zt  # noqa: E402
from zs_testutil import (  # noqa: E402
    CLIP, DIM, EPS, LR, VOCAB, batches, groups, make_model, max_abs_diff,
    train_reference, train_zero)

BOUND = 2e-5  # as in test_torch.py


def zero(model, stage, **kw):
    kw.setdefault("gradient_clipping", CLIP)
    return zt.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, param_groups=groups(model),
                            comm=zs.make_self_communicator(), **kw)


class TiedLM(nn.Module):
    """A GPT-shaped model whose output head shares the token embedding's weight: the head is a
    sibling module (its own unit when it has a bias, none when it has not)."""

    def __init__(self, head_bias):
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, DIM),
                                          "h": nn.ModuleList([nn.Linear(DIM, DIM)
                                                              for _ in range(2)]),
                                          "ln_f": nn.LayerNorm(DIM)})
        self.lm_head = nn.Linear(DIM, VOCAB, bias=head_bias)
        self.lm_head.weight = self.transformer.wte.weight

    def hidden(self, tokens):
        x = self.transformer.wte(tokens).mean(1)
        for block in self.transformer.h:
            x = x + torch.tanh(block(x))
        return self.transformer.ln_f(x)

    def forward(self, tokens):
        return self.lm_head(self.hidden(tokens))


def labels_in_vocab(data):
    return [(t, y % VOCAB) for t, y in data]


@pytest.mark.parametrize("head_bias", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tied_weights_match_adamw(stage, head_bias):
    model, data = TiedLM(head_bias), labels_in_vocab(batches(10))
    ref = train_reference(model, data)
    opt = zero(model, stage)
    train_zero(opt, model, data, 0, 1)
    got = opt.model_state_dict()
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])
    assert max_abs_diff(got, ref.state_dict()) <= BOUND
    assert max_abs_diff(got, TiedLM(head_bias).state_dict()) > 100 * BOUND


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_grad_after_backward_raises_and_names_clip_grad_norm(stage):
    model, data = make_model(), batches(2)
    opt = zero(model, stage)
    tokens, labels = data[0]
    nn.functional.cross_entropy(model(tokens), labels).backward()
    # torch's own clipping would return 0 and clip nothing if .grad were None: it raises.
    with pytest.raises(zs.InvalidArgumentError, match=r"clip_grad_norm_\(max_norm\)"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(zs.InvalidArgumentError, match="'proj.weight'"):
        model.proj.weight.grad.norm()
    assert model.proj.weight.grad.shape == (32, 16)  # metadata reads pass
    # Zeroing .grad before step() drops the step's gradients in torch; here they were reduced
    # already, so step() refuses rather than apply them silently (test_torch_autograd_passes).
    model.zero_grad(set_to_none=False)
    with pytest.raises(zs.InvalidArgumentError, match="was zeroed after backward"):
        opt.step()
    # A new micro-step without zero_grad() replaces the placeholders (no accumulation into
    # them), and training matches the reference.
    ref = train_reference(make_model(), data)
    model2 = make_model()
    opt2 = zero(model2, stage)
    for tokens, labels in data:
        nn.functional.cross_entropy(model2(tokens), labels).backward()
        opt2.step()
    assert max_abs_diff(opt2.model_state_dict(), ref.state_dict()) <= BOUND


@pytest.mark.parametrize("stage", [0, 3])
def test_clip_grad_norm_matches_torch(stage):
    model, data = make_model(), batches(8)
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)
    opt = zero(model, stage, gradient_clipping=0.0)
    engaged = 0
    for tokens, labels in data:
        ropt.zero_grad()
        nn.functional.cross_entropy(ref(tokens), labels).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)  # the norms are ~0.8
        ropt.step()
        opt.zero_grad()
        nn.functional.cross_entropy(model(tokens), labels).backward()
        got = opt.clip_grad_norm_(0.5)
        opt.step()
        assert abs(got.item() - want.item()) <= 1e-4 * want.item()
        assert (opt.last_result.clip_factor < 1.0) == (want.item() > 0.5)
        engaged += want.item() > 0.5
    assert engaged > 0
    assert max_abs_diff(opt.model_state_dict(), ref.state_dict()) <= BOUND
    # inf only measures; bad arguments are refused.
    nn.functional.cross_entropy(model(data[0][0]), data[0][1]).backward()
    assert opt.clip_grad_norm_(float("inf")).item() > 0
    opt.step()
    assert opt.last_result.clip_factor == 1.0
    with pytest.raises(zs.InvalidArgumentError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=1)


def test_stage3_read_of_a_released_parameter_raises_with_the_way_out():
    model = make_model()
    opt = zero(model, 3)
    with pytest.raises(zs.InvalidArgumentError,
                       match=r"'proj.weight' of unit 'proj'.*register_forward_method"):
        model.proj.weight.sum()
    with pytest.raises(zs.InvalidArgumentError, match="opt.model_state_dict"):
        model.state_dict()  # its values would be empty tensors
    with torch.no_grad(), opt.gathered(model.proj):
        w = model.proj.weight.clone()
    assert torch.equal(w, opt.model_state_dict()["proj.weight"])
    with pytest.raises(zs.InvalidArgumentError, match="torch.no_grad"):
        with opt.gathered():
            pass
    with pytest.raises(zs.InvalidArgumentError, match="written in place"):
        with torch.no_grad(), opt.gathered(model.proj):
            model.proj.weight.zero_()  # would be lost at release
    assert torch.equal(w, opt.model_state_dict()["proj.weight"])


class LossMethodLM(nn.Module):
    """The output projection is the embedding's weight, read in a loss method, not forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, tokens):
        return torch.tanh(self.proj(self.embed(tokens).mean(1)))

    def loss(self, tokens, labels):
        logits = self(tokens) @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits, labels)


@pytest.mark.parametrize("uses", ["module", "embed"])
def test_register_forward_method_trains_a_loss_method_at_stage3(uses):
    data = labels_in_vocab(batches(8))
    ref = copy.deepcopy(LossMethodLM())
    ropt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)
    for tokens, labels in data:
        ropt.zero_grad()
        ref.loss(tokens, labels).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ropt.step()
    model = LossMethodLM()
    opt = zero(model, 3)
    with pytest.raises(zs.InvalidArgumentError, match="'embed.weight'"):
        model.loss(*data[0])  # not registered: the embedding is released there
    opt.zero_grad()
    opt.register_forward_method(model, "loss", uses=None if uses == "module" else model.embed)
    for tokens, labels in data:
        opt.zero_grad()
        model.loss(tokens, labels).backward()
        opt.step()
    assert max_abs_diff(opt.model_state_dict(), ref.state_dict()) <= BOUND


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_is_freed_with_its_model(stage):
    # The engine holds parameters through C++ (AccumulateGrad nodes, tensor hooks) where the
    # garbage collector cannot see cycles: a strong reference back to the optimizer from
    # there would keep the engine and its communicator alive to the end of the process, and
    # under mpirun the process would then exit without finalising MPI.
    import gc
    import weakref
    # A graph the trainer keeps (a loss it never ran backward on, an exception's traceback)
    # holds the parameters' AccumulateGrad nodes and the outputs' hooks, in C++ too.
    model = TiedLM(head_bias=True)
    opt = zero(model, stage)
    data = labels_in_vocab(batches(2))
    train_zero(opt, model, data, 0, 1)
    kept = model(data[0][0]).sum()
    gone = weakref.ref(opt)
    del opt, model
    gc.collect()
    assert gone() is None
    assert kept.requires_grad


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resume_restores_hyperparameters_and_continues_bitwise(stage, tmp_path):
    data = batches(8)
    a_model = make_model()
    a = zero(a_model, stage)
    train_zero(a, a_model, data[:4], 0, 1)
    a.param_groups[0]["lr"] = LR / 3  # as a scheduler would
    a.param_groups[1]["betas"] = (0.8, 0.99)
    tag = a.save_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text() == "step00000004\n" and tag.name == "step00000004"
    with pytest.raises(zs.InvalidArgumentError, match="exists"):
        a.save_checkpoint(tmp_path)  # a tag is never overwritten
    b_model = make_model(seed=5)
    b = zero(b_model, stage)
    b.load_checkpoint(tmp_path)
    assert abs(b.param_groups[0]["lr"] - LR / 3) < 1e-9
    assert b.param_groups[1]["betas"] == pytest.approx((0.8, 0.99))
    train_zero(a, a_model, data[4:], 0, 1)
    train_zero(b, b_model, data[4:], 0, 1)
    got, want = b.model_state_dict(), a.model_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # Damage is found before anything changes.
    (tag / "rank00000.master").write_bytes(b"\0" * 100)
    before = b.model_state_dict()
    with pytest.raises(zs.Error, match="rank00000.master"):
        b.load_checkpoint(tmp_path)
    assert all(torch.equal(before[k], v) for k, v in b.model_state_dict().items())


@pytest.mark.parametrize("stage", [1, 3])
def test_asynchronous_checkpoint_holds_the_state_of_its_call(stage, tmp_path):
    # checkpoint_async=True makes the snapshot with the optimizer; the save written while the
    # optimizer trains on holds the state of its call, and a load of it continues bitwise.
    data = batches(8)
    a_model = make_model()
    a = zero(a_model, stage, checkpoint_async=True)
    snapshot = [b.bytes for b in a.memory().buffers if b.name == "checkpoint_snapshot"]
    assert snapshot and snapshot[0] > 0, "no snapshot made with the optimizer"
    assert a.finish_checkpoint() is None, "nothing is pending yet"
    train_zero(a, a_model, data[:4], 0, 1)
    at_call = {k: v.clone() for k, v in a.model_state_dict().items()}
    a.save_checkpoint_async(tmp_path)
    train_zero(a, a_model, data[4:6], 0, 1)  # changes the state while the files are written
    tag = a.finish_checkpoint()
    assert tag is not None and tag.name == "step00000004"
    assert (tmp_path / "latest").read_text() == "step00000004\n"
    assert [b.bytes for b in a.memory().buffers if b.name == "checkpoint_snapshot"] == snapshot
    b_model = make_model(seed=5)
    b = zero(b_model, stage)
    b.load_checkpoint(tag)
    got = b.model_state_dict()
    assert all(torch.equal(got[k], v) for k, v in at_call.items()), "not the state of its call"
    assert not all(torch.equal(a.model_state_dict()[k], v) for k, v in at_call.items())
    train_zero(b, b_model, data[4:6], 0, 1)
    got, want = b.model_state_dict(), a.model_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("stage", [0, 3])
def test_load_checkpoint_takes_deepspeeds_choices(stage, tmp_path):
    # load_module_only (or load_optimizer_states=False) takes the weights alone: the moments,
    # the step count and the groups' hyperparameters stay this optimizer's.
    data = batches(4)
    a_model, b_model = make_model(), make_model(seed=5)
    a, b = zero(a_model, stage), zero(b_model, stage)
    train_zero(a, a_model, data, 0, 1)
    a.param_groups[0]["lr"] = 0.004
    a.save_checkpoint(tmp_path)
    train_zero(b, b_model, data[:1], 0, 1)
    b.param_groups[0]["lr"] = LR / 2
    p = b_model.head.weight
    moments = b.full_optimizer_state(p, "exp_avg")
    b.load_checkpoint(tmp_path, load_module_only=True)
    assert torch.equal(b.full_fp32_param(p), a.full_fp32_param(a_model.head.weight))
    assert torch.equal(b.full_optimizer_state(p, "exp_avg"), moments)
    assert b.engine.step_count() == 1 and b.param_groups[0]["lr"] == LR / 2
    b.load_checkpoint(tmp_path, load_lr_scheduler_states=False)
    assert b.engine.step_count() == 4 and b.param_groups[0]["lr"] == LR / 2
    assert torch.equal(b.full_optimizer_state(p, "exp_avg"),
                       a.full_optimizer_state(a_model.head.weight, "exp_avg"))
    b.load_checkpoint(tmp_path)
    assert b.param_groups[0]["lr"] == 0.004  # as written, not its f32 (0.004000000189989805)


@pytest.mark.parametrize("fmt", ["f32", "8bit"])
def test_export_is_read_by_the_safetensors_package(fmt, tmp_path):
    from safetensors.torch import load_file
    model, data = make_model(), batches(3)
    opt = zero(model, 2, optimizer_state=fmt, state_block=64)
    train_zero(opt, model, data, 0, 1)
    tag = opt.save_checkpoint(tmp_path / "ckpt")
    zs.export_checkpoint(tag, tmp_path / "out")
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = opt.model_state_dict()
    assert set(weights) == {n for n, p in model.named_parameters()}
    assert all(torch.equal(weights[k], want[k]) for k in weights)  # f32: master == parameter
    state = load_file(str(tmp_path / "out" / "optimizer.safetensors"))
    assert set(state) == {f"{n}.{s}" for n in weights for s in ("exp_avg", "exp_avg_sq")}
    assert state["proj.weight.exp_avg_sq"].shape == model.proj.weight.shape
    assert (state["proj.weight.exp_avg_sq"] > 0).any()
    # The moments as the optimizer keeps them (8-bit: saved as codes and absmax, exported as
    # code x absmax), unit by unit.
    for entry in opt.state_dict()["state"]["units"]:
        for key in ("exp_avg", "exp_avg_sq"):
            flat = torch.cat([state[f"{n}.{key}"].flatten() for n in entry["param_names"]])
            assert torch.equal(flat, entry[key][:entry["numel"]]), (entry["name"], key)
    # And back: an engine starts from the exported weights.
    fresh = make_model(seed=9)
    opt2 = zero(fresh, 2)
    opt2.engine.load_safetensors(str(tmp_path / "out" / "model.safetensors"))
    got = opt2.model_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in weights)
    assert "proj.weight [32, 16]" in zs.describe_checkpoint(tag)
    assert zs.verify_checkpoint(tmp_path / "ckpt") > 0


def test_pickling_or_copying_released_stage3_parameters_names_the_way_out():
    # torch 1.13's OneCycleLR state_dict() holds the optimizer (its bound anneal_func), so a
    # torch.save of it pickles param_groups: the error said only "read by __get__()".
    import io
    model = make_model()
    opt = zero(model, 3)
    with pytest.raises(zs.InvalidArgumentError, match=r"cannot be pickled or copied.*anneal_func"):
        torch.save(opt.param_groups, io.BytesIO())
    with pytest.raises(zs.InvalidArgumentError, match=r"cannot be pickled or copied"):
        copy.deepcopy(model)
    torch.save(opt.model_state_dict(), io.BytesIO())  # the way out
    opt.close()
    copy.deepcopy(model)  # given back: ordinary parameters


class FrozenLM(TiedLM):
    """TiedLM with what a checkpoint must carry besides the trained weights: a frozen
    parameter, persistent buffers of two dtypes, and a non-persistent one (not in state_dict)."""

    def __init__(self, seed):
        super().__init__(head_bias=True)
        torch.manual_seed(seed)
        self.adapter = nn.Linear(DIM, DIM)
        self.adapter.weight.requires_grad_(False)  # frozen; its bias trains
        self.register_buffer("position_ids", torch.arange(7) + seed)
        self.register_buffer("scale", torch.rand(DIM, dtype=torch.float64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, tokens):
        return self.lm_head(self.adapter(self.hidden(tokens)) * self.scale.float())


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_carries_frozen_parameters_buffers_and_tied_names(stage, tmp_path):
    # Saved, loaded into a model whose frozen parameter and buffers differ, and exported under
    # every name of the model's state_dict, so that a model built afresh loads it strictly.
    from safetensors.torch import load_file
    data = labels_in_vocab(batches(3))
    a_model, b_model = FrozenLM(seed=1), FrozenLM(seed=2)
    a, b = zero(a_model, stage), zero(b_model, stage)
    train_zero(a, a_model, data, 0, 1)
    tag = a.save_checkpoint(tmp_path / "ckpt")
    assert not torch.equal(b_model.adapter.weight, a_model.adapter.weight)
    b.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(b_model.adapter.weight, a_model.adapter.weight)
    assert torch.equal(b_model.position_ids, a_model.position_ids)
    assert torch.equal(b_model.scale, a_model.scale) and b_model.scale.dtype == torch.float64
    got, want = b.model_state_dict(), a.model_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)

    zs.export_checkpoint(tag, tmp_path / "out", max_shard_bytes=4096)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    weights = {}
    for f in set(index["weight_map"].values()):
        weights.update(load_file(str(tmp_path / "out" / f)))
    fresh = FrozenLM(seed=3)
    assert set(weights) == set(fresh.state_dict())  # tied names and buffers, not "scratch"
    fresh.load_state_dict(weights, strict=True)
    assert torch.equal(fresh.lm_head.weight, fresh.transformer.wte.weight)
    assert torch.equal(fresh.position_ids, a_model.position_ids)
    assert torch.equal(fresh.adapter.weight, a_model.adapter.weight)
    have = fresh.state_dict()
    assert all(torch.equal(have[k], v.to(have[k].dtype)) for k, v in a.model_state_dict().items())
