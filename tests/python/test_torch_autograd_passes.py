"""Autograd passes other than one plain backward, and .grad changed after it.

- torch.utils.checkpoint with use_reentrant=True (torch 1.13's default) runs a backward of its
  own for each segment, inside the trainer's: the end of the trainer's backward must not be
  taken from the first segment's (it handed every other unit over as zeros, then again).
- torch.autograd.grad() inside the loss (a gradient penalty) runs a pass that fills no .grad:
  at stage 3 it released units the real backward then read. The Python stack shows which pass a
  hook runs in; on a GPU's device thread, where it shows none, autograd is asked whether the
  pass fills .grad (torch._C._will_engine_execute_node), checked here from a CPU hook.
- The whole model inside one reentrant checkpoint: its forward runs under no_grad, and the end
  of backward can only be taken from the checkpoint's own pass.
- A 0-dim parameter (a logit scale, a ReZero gate).
- A .grad set to None, zeroed or replaced between backward() and step() was silently ignored:
  the engine already held those gradients. Now step() refuses it.
Each is checked against torch.optim.AdamW on the same model and batches, one process.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import zeroshard as zs  # noqa: E402
import zeroshard.torch as zt  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

LR, EPS = 1e-2, 1e-3


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class CheckpointedLM(nn.Module):
    """Every block checkpointed (reentrant), the head tied to the embedding: through F.linear
    (stages 0-2), the first parameter gradients of backward are those of the last segment's own
    pass; at stage 3, where a parameter is read in its own module's forward, through a tied
    nn.Linear."""

    def __init__(self, vocab=20, d=16, layers=3, shared=False, scalar=False, head_module=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        block = Block(d)
        self.h = nn.ModuleList([block if shared else Block(d) for _ in range(layers)])
        self.scale = nn.Parameter(torch.tensor(1.5)) if scalar else None
        self.head = nn.Linear(d, vocab, bias=False) if head_module else None
        if self.head is not None:
            self.head.weight = self.wte.weight

    def forward(self, tokens):
        x = self.wte(tokens)
        for b in self.h:
            x = checkpoint(b, x, use_reentrant=True)
        logits = self.head(x) if self.head is not None else F.linear(x, self.wte.weight)
        return logits * self.scale if self.scale is not None else logits


def data(steps=3, vocab=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (4, 6), generator=g),
             torch.randint(0, vocab, (4, 6), generator=g)) for _ in range(steps)]


def lm_loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def make(cls=CheckpointedLM, **kw):
    torch.manual_seed(0)
    return cls(**kw)


def train_both(model, loss, stage, micro=1, steps=3, **config_fields):
    """(max |zeroshard - torch.optim.AdamW|, zeroshard's model) after `steps` steps of
    `micro` micro-batches each."""
    ref = copy.deepcopy(model)
    topt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    opt = zt.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, weight_decay=0.01,
                           gradient_accumulation_steps=micro, comm=zs.make_self_communicator(),
                           **config_fields)
    batches = data(steps * micro)
    for s in range(steps):
        topt.zero_grad()
        for tokens, targets in batches[s * micro:(s + 1) * micro]:
            (loss(ref, tokens, targets) / micro).backward()
            loss(model, tokens, targets).backward()
        topt.step()
        opt.step()
        opt.zero_grad()
    diff = max((a - b).abs().max().item()
               for a, b in zip(opt.model_state_dict().values(), ref.state_dict().values()))
    opt.close()
    return diff


@pytest.mark.parametrize("stage,micro", [(0, 1), (2, 1), (3, 1), (2, 2), (3, 2)])
def test_reentrant_checkpoint_segments_train_like_adamw(stage, micro):
    assert train_both(make(head_module=stage == 3), lm_loss, stage, micro) < 2e-5


@pytest.mark.parametrize("stage", [1, 3])
def test_a_block_in_several_reentrant_segments_is_refused_with_the_way_out(stage):
    model = make(shared=True, head_module=stage == 3)
    opt = zt.ZeroOptimizer(model, stage=stage, comm=zs.make_self_communicator())
    tokens, targets = data(1)[0]
    with pytest.raises(Exception, match="use_reentrant=False"):
        lm_loss(model, tokens, targets).backward()
    opt.close()


class Trunk(nn.Module):
    """Blocks and a head, run whole inside one reentrant checkpoint by its loss."""

    def __init__(self, d=16, layers=3):
        super().__init__()
        self.h = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.h(x))


def whole_model_checkpointed_loss(model, tokens, targets):
    # The model's own forward runs under no_grad; its backward pass is the checkpoint's, nested
    # in the trainer's: the end of backward can only be taken from there.
    x = (tokens.float() / 20).repeat(1, 3)[:, :16].requires_grad_(True)
    out = checkpoint(model, x, use_reentrant=True)
    return (out - targets[:, :1].float() / 20).pow(2).mean()


@pytest.mark.parametrize("stage,micro", [(0, 1), (2, 2), (3, 1)])
def test_the_whole_model_in_one_reentrant_checkpoint_trains_like_adamw(stage, micro):
    assert train_both(make(Trunk), whole_model_checkpointed_loss, stage, micro) < 2e-5


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def penalised_loss(model, tokens, targets):
    # A WGAN-GP / R1 style penalty: the gradient of the output with respect to the input,
    # through the model, inside the loss.
    x = (torch.cat([tokens, tokens], 1)[:, :8].float() / 20).requires_grad_(True)
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + 0.5 * gx.pow(2).sum()


def test_autograd_says_which_passes_fill_grad():
    # What a hook on a GPU's autograd device thread goes by, where the Python stack shows no
    # pass: checked here from a CPU hook, against the passes it runs in.
    model = make(Critic)
    opt = zt.ZeroOptimizer(model, stage=1, comm=zs.make_self_communicator())
    seen = []
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    out.register_hook(lambda g: seen.append(opt._fills_grads()))
    torch.autograd.grad(out.sum(), x, retain_graph=True)
    torch.autograd.grad(out.sum(), list(model.parameters()), retain_graph=True)
    out.sum().backward()
    assert seen == [False, False, True]
    opt.step()
    opt.close()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_gradient_penalty_trains_like_adamw(stage):
    assert train_both(make(Critic), penalised_loss, stage) < 2e-5


class DeepCritic(nn.Module):
    def __init__(self, layers=5):
        super().__init__()
        self.h = nn.ModuleList([nn.Linear(8 if i == 0 else 16, 16) for i in range(layers)])
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        for m in self.h:
            x = torch.tanh(m(x))
        return self.out(x)


def test_a_stage_3_gradient_penalty_through_many_units_names_max_live_units():
    # Every unit the penalty's pass gathers stays gathered until the trainer's backward reads it
    # again through the penalty's graph: the engine's bare "already gathered" said nothing of it.
    model = make(DeepCritic)
    opt = zt.ZeroOptimizer(model, stage=3, comm=zs.make_self_communicator())
    tokens, targets = data(1)[0]
    with pytest.raises(zs.InvalidArgumentError, match=r"gradient penalty.*max_live_units"):
        penalised_loss(model, tokens, targets)
    opt.close()
    assert train_both(make(DeepCritic), penalised_loss, 3, max_live_units=8) < 2e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_a_0_dim_parameter_trains_like_adamw(stage):
    assert train_both(make(scalar=True, head_module=stage == 3), lm_loss, stage) < 2e-5


def clear_none(model):
    model.h[0].fc.weight.grad = None


def clear_zero(model):
    model.h[0].fc.weight.grad.zero_()


def clear_module(model):
    model.h[1].zero_grad(set_to_none=False)


def clear_replace(model):
    model.h[0].fc.bias.grad = torch.zeros(16)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("clear", [clear_none, clear_zero, clear_module, clear_replace])
def test_a_grad_changed_between_backward_and_step_is_refused(stage, clear):
    model = make(head_module=stage == 3)
    opt = zt.ZeroOptimizer(model, stage=stage, comm=zs.make_self_communicator())
    tokens, targets = data(1)[0]
    lm_loss(model, tokens, targets).backward()
    try:
        clear(model)  # a tensor assigned to a released stage-3 parameter's .grad: refused here
        with pytest.raises(zs.InvalidArgumentError, match=r"after backward\(\)"):
            opt.step()
    except zs.InvalidArgumentError as e:
        assert stage == 3 and clear is clear_replace and "was assigned to the .grad" in str(e)
        assert "opt.zero_grad()" in str(e)
    # The way out the message gives works, and clearing after the step is the usual loop.
    opt.zero_grad()
    lm_loss(model, tokens, targets).backward()
    opt.step()
    model.zero_grad(set_to_none=False)
    lm_loss(model, tokens, targets).backward()
    opt.step()
    opt.close()


def test_a_grad_cleared_between_micro_steps_is_refused():
    model = make()
    opt = zt.ZeroOptimizer(model, stage=2, gradient_accumulation_steps=2,
                           comm=zs.make_self_communicator())
    tokens, targets = data(1)[0]
    lm_loss(model, tokens, targets).backward()
    model.zero_grad(set_to_none=True)  # meant to drop the first micro-step
    with pytest.raises(Exception, match="was set to None after backward"):
        lm_loss(model, tokens, targets).backward()
    opt.close()


def test_a_grad_assigned_without_backward_is_refused():
    model = make(Critic)
    opt = zt.ZeroOptimizer(model, stage=2, comm=zs.make_self_communicator())
    x = torch.randn(4, 8)
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    with pytest.raises(zs.InvalidArgumentError, match="no backward"):
        opt.step()
    opt.close()


def test_micro_steps_that_do_not_add_up_are_named_in_torch_terms():
    # The engine's own words were "each unit needs grads_ready() once per micro-step".
    model = make(Critic)
    opt = zt.ZeroOptimizer(model, stage=2, gradient_accumulation_steps=2,
                           comm=zs.make_self_communicator())
    x = torch.randn(4, 8)
    model(x).sum().backward()
    with pytest.raises(zs.InvalidArgumentError, match=r"after 1 backward\(\) call.*= 2"):
        opt.step()
    model(x).sum().backward()
    opt.step()  # two: a step
    for _ in range(2):
        model(x).sum().backward()
    with pytest.raises(Exception, match=r"backward\(\) number 3 since the last step"):
        model(x).sum().backward()
    opt.zero_grad()
    opt.close()
