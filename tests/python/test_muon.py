"""ZeroOptimizer(optimizer="muon") on one rank: matrices by Muon, the rest by AdamW, against a
reference written here in float64 (torch.optim.Muon's algorithm), at every stage and on the host
tier; against torch.optim.Muon itself where this torch has it; and the errors of a wrong group."""

import copy

import pytest

torch = pytest.importorskip("torch")

import zeroshard as zs  # noqa: E402
import zeroshard.torch as zt  # noqa: E402
from zs_testutil import batches, loss_fn, make_model, max_abs_diff  # noqa: E402

LR, ADAM_LR, WD, MOMENTUM = 2e-2, 1e-2, 0.1, 0.95


def muon_params(model):
    # The usual hybrid: the hidden matrix by Muon; embedding, head, biases, norm by AdamW.
    return [model.proj.weight]


def param_groups(model):
    ids = {id(p) for p in muon_params(model)}
    return [{"params": muon_params(model), "use_muon": True, "lr": LR, "weight_decay": WD},
            {"params": [p for p in model.parameters() if id(p) not in ids], "use_muon": False,
             "lr": ADAM_LR, "weight_decay": 0.0}]


def orthogonalise(g, steps=5, eps=1e-7):
    """torch.optim.Muon's Newton-Schulz iteration, in float64."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def train_reference(model, data):
    """The float64 reference: Muon (averaged momentum, Nesterov) for the matrix, AdamW for the
    rest, one process, the whole batch."""
    ref = copy.deepcopy(model).double()
    ids = {id(p) for p in muon_params(ref)}
    rest = [p for p in ref.parameters() if id(p) not in ids]
    adam = torch.optim.AdamW(rest, lr=ADAM_LR, weight_decay=0.0, eps=1e-8)
    bufs = {id(p): torch.zeros_like(p) for p in muon_params(ref)}
    for tokens, labels in data:
        ref.zero_grad()
        loss_fn(ref, tokens, labels).backward()
        with torch.no_grad():
            for p in muon_params(ref):
                buf = bufs[id(p)]
                buf.mul_(MOMENTUM).add_(p.grad, alpha=1 - MOMENTUM)
                d = (1 - MOMENTUM) * p.grad + MOMENTUM * buf
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                p.mul_(1 - LR * WD)
                p.add_(orthogonalise(d), alpha=-LR * scale)
        adam.step()
    return ref, bufs[id(ref.proj.weight)]


def run(model, data, stage, **kw):
    opt = zt.ZeroOptimizer(model, stage=stage, optimizer="muon", param_groups=param_groups(model),
                           comm=zs.make_self_communicator(), **kw)
    for tokens, labels in data:
        opt.zero_grad()
        loss_fn(model, tokens, labels).backward()
        opt.step()
    return opt


@pytest.mark.parametrize("stage,offload", [(0, None), (1, None), (2, "cpu"), (3, None),
                                           (3, "cpu")])
def test_matches_a_float64_reference(stage, offload):
    model, data = make_model(), batches(12)
    ref, momentum = train_reference(model, data)
    opt = run(model, data, stage, offload_optimizer=offload)
    got = opt.model_state_dict()
    want = {k: v.float() for k, v in ref.state_dict().items()}
    assert max_abs_diff(got, want) <= 2e-5
    assert max_abs_diff(got, make_model().state_dict()) > 0.05  # it trained
    # The matrix's momentum is read back under torch.optim.Muon's name.
    m = opt.full_optimizer_state(model.proj.weight, "momentum_buffer")
    assert (m - momentum.float()).abs().max().item() <= 1e-6
    opt.close()


def test_default_split_by_dimensions_and_use_muon():
    model = make_model()
    model.embed.weight.use_muon = False  # DeepSpeed's attribute: embeddings stay with AdamW
    opt = zt.ZeroOptimizer(model, stage=1, optimizer="muon", lr=LR,
                           comm=zs.make_self_communicator())
    muon, adamw = opt.param_groups
    assert muon["use_muon"] and not adamw["use_muon"]
    assert {id(p) for p in muon["params"]} == {id(model.proj.weight), id(model.head.weight)}
    assert muon["momentum"] == 0.95 and muon["nesterov"] and muon["ns_steps"] == 5
    assert adamw["betas"] == (0.9, 0.999) and "momentum" not in adamw
    opt.close()
    # A configuration's Muon settings reach the Muon group (and the engine).
    model = make_model()
    opt = zt.ZeroOptimizer(model, stage=1, comm=zs.make_self_communicator(), config={
        "optimizer": {"type": "Muon", "params": {"lr": 0.01, "momentum": 0.9, "ns_steps": 3,
                                                 "match_rms_adamw": True}}})
    muon = opt.param_groups[0]
    assert (muon["momentum"], muon["ns_steps"], muon["adjust_lr_fn"]) == (0.9, 3,
                                                                          "match_rms_adamw")
    o = opt.engine.options(0)
    assert (o.ns_steps, o.match_rms_adamw, round(o.momentum, 6)) == (3, True, 0.9)
    opt.close()


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_close_to_torch_optim_muon():
    # torch.optim.Muon runs its iteration in bf16 (ns_bf16 here): the same algorithm, rounded
    # differently, so the steps agree closely, not bitwise.
    model, data = make_model(), batches(8)
    ref = copy.deepcopy(model)
    ids = {id(p) for p in muon_params(ref)}
    tm = torch.optim.Muon(muon_params(ref), lr=LR, weight_decay=WD, momentum=MOMENTUM)
    ta = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in ids], lr=ADAM_LR,
                           weight_decay=0.0)
    for tokens, labels in data:
        ref.zero_grad()
        loss_fn(ref, tokens, labels).backward()
        tm.step()
        ta.step()
    groups = param_groups(model)
    groups[0]["ns_bf16"] = True
    opt = zt.ZeroOptimizer(model, stage=2, optimizer="muon", param_groups=groups,
                           comm=zs.make_self_communicator())
    start = make_model().proj.weight.detach()
    for tokens, labels in data:
        opt.zero_grad()
        loss_fn(model, tokens, labels).backward()
        opt.step()
    ours = (model.proj.weight.detach() - start).flatten()
    theirs = (ref.proj.weight.detach() - start).flatten()
    cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item()
    assert cos > 0.999, cos
    assert (ours.norm() / theirs.norm() - 1).abs().item() < 0.01
    opt.close()


def test_wrong_groups_are_refused():
    model = make_model()
    with pytest.raises(zs.InvalidArgumentError, match="norm.weight"):
        zt.ZeroOptimizer(model, optimizer="muon", comm=zs.make_self_communicator(),
                         param_groups=[{"params": list(model.parameters())}])
    with pytest.raises(zs.ConfigError, match="first param group"):
        zt.ZeroOptimizer(model, optimizer="muon", comm=zs.make_self_communicator(),
                         param_groups=[{"params": [model.norm.weight], "use_muon": False},
                                       {"params": [model.proj.weight]}])
    with pytest.raises(zs.ConfigError, match="betas"):
        zt.ZeroOptimizer(model, optimizer="muon", comm=zs.make_self_communicator(),
                         param_groups=[{"params": [model.proj.weight], "betas": (0.9, 0.9)}])


def test_state_dict_round_trip_and_a_group_of_another_kind_refused():
    # A Muon engine's state_dict() loads into a fresh one, which then trains on bitwise like the
    # first; a state whose groups have other kinds is refused before anything is written.
    model, data = make_model(), batches(6)
    opt = run(model, data[:3], 2)
    saved = opt.state_dict()
    twin = make_model()
    other = zt.ZeroOptimizer(twin, stage=2, optimizer="muon", param_groups=param_groups(twin),
                             comm=zs.make_self_communicator())
    other.load_state_dict(saved)
    for m, o in ((model, opt), (twin, other)):
        for tokens, labels in data[3:]:
            o.zero_grad()
            loss_fn(m, tokens, labels).backward()
            o.step()
    a, b = opt.model_state_dict(), other.model_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = copy.deepcopy(saved)  # three steps behind `other`: a load would change it
    state["param_groups"][1]["use_muon"] = True
    before = other.state_dict()["state"]["units"][0]["master"].clone()
    with pytest.raises(zs.InvalidArgumentError, match="was a Muon group"):
        other.load_state_dict(state)
    assert torch.equal(other.state_dict()["state"]["units"][0]["master"], before)
    opt.close()
    other.close()
