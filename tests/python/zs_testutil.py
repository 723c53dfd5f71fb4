"""Shared pieces of the Python tests: the small torch model, the parameter groups, the
reference training loop (torch.optim.AdamW on one process with the whole batch) and the
rank-agreeing assertion used under mpirun."""

import array
import copy
import functools

import pytest
import torch
import torch.nn as nn

import zeroshard

# torch.compile's tests: torch 1.13, the oldest torch supported, has no torch.compile.
needs_compile = pytest.mark.skipif(not hasattr(torch, "compile"),
                                   reason=f"torch {torch.__version__} has no torch.compile")

VOCAB, DIM, HIDDEN, CLASSES, SEQ = 50, 16, 32, 7, 5
BATCH = 16  # the global batch; each of the ranks takes an equal slice


class TinyLM(nn.Module):
    """Embedding -> mean over the sequence -> Linear -> tanh -> LayerNorm -> Linear."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, tokens):
        h = self.embed(tokens).mean(1)
        h = torch.tanh(self.proj(h))
        return self.head(self.norm(h))


def make_model(seed=0):
    torch.manual_seed(seed)
    m = TinyLM()
    # Biases and LayerNorm parameters start away from 0 and 1, so that decaying them (which the
    # groups forbid) would move them visibly.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if no_decay(n):
                p.uniform_(-0.5, 0.5)
    return m


def no_decay(name):
    return name.endswith("bias") or name.startswith("norm.")


def groups(model, weight_decay=0.1):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]


# Hyperparameters shared by the reference and zeroshard. eps is large on purpose: with
# eps = 1e-8 Adam's step m/sqrt(v) hardly depends on the gradient's scale, so a wrong average
# over ranks (a sum, say) would go unseen; with eps = 1e-3 it changes the result at once.
LR, EPS, CLIP = 1e-2, 1e-3, 1.0


def batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        out.append((torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                    torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return out


def loss_fn(model, tokens, labels):
    return nn.functional.cross_entropy(model(tokens), labels)


def train_reference(model, data):
    """torch.optim.AdamW on one process with the whole batch, clipped like the engine."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)
    for tokens, labels in data:
        opt.zero_grad()
        loss_fn(ref, tokens, labels).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
    return ref


def rank_slice(rank, world, n=BATCH):
    assert n % world == 0, "the global batch must split evenly over the ranks"
    return slice(rank * n // world, (rank + 1) * n // world)


def train_zero(opt, model, data, rank, world, micro=1):
    """Each rank trains on its slice of every global batch, in `micro` micro-steps."""
    for tokens, labels in data:
        opt.zero_grad()
        mine = rank_slice(rank, world)
        t, y = tokens[mine], labels[mine]
        per = t.shape[0] // micro
        for k in range(micro):
            loss_fn(model, t[k * per:(k + 1) * per], y[k * per:(k + 1) * per]).backward()
        opt.step()


def max_abs_diff(a, b):
    """Largest |a - b| over the parameters of two state dicts with the same keys."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def agree(comm, ok):
    """True on every rank iff `ok` is true on every rank, so all ranks fail an assertion
    together (a lone failing rank would otherwise run into the next test's collectives)."""
    flag = array.array("d", [1.0 if ok else 0.0])
    comm.all_reduce(flag, "min", "test assertion")
    return flag[0] > 0


def world():
    c = zeroshard.default_communicator()
    return c, c.rank(), c.size()


@functools.lru_cache(maxsize=None)
def code_8bit(signed):
    """The 8-bit code as zeroshard/quantize.hpp defines it, built from that definition (not from
    float bit patterns): magnitude code c >= 1 is the c-th smallest of the points (1 + f/8) 2^e
    (f = 0..7) up to 1.0, 127 of them (signed) or 255; code 0 is 0; a signed code 128 + c is
    minus code c. Returns the 256 points in code order, the magnitudes ascending (code 0 first),
    and the midpoints between consecutive magnitudes. Built once per code (callers do not
    change the tensors)."""
    top = 127 if signed else 255
    mags = sorted({(1 + f / 8) * 2.0 ** e for e in range(-40, 0) for f in range(8)} | {1.0})
    mags = torch.tensor([0.0] + mags[-top:], dtype=torch.float64)
    points = torch.zeros(256, dtype=torch.float64)
    points[:top + 1] = mags
    if signed:
        points[128:] = -mags
    return points.float(), mags.float(), ((mags[:-1] + mags[1:]) / 2).float()


def codes_8bit(y, signed):
    """The codes of y (already divided by its block's absmax): the nearest magnitude, ties to the
    larger (the count of midpoints at or below |y|), saturating at 1.0; the sign above it."""
    _, mags, mid = code_8bit(signed)
    c = torch.searchsorted(mid, y.abs(), right=True)
    c = torch.where(torch.isnan(y), torch.tensor(mags.numel() - 1), c)
    if signed:
        c = torch.where((y < 0) & (c > 0), c + 128, c)
    return c.to(torch.uint8)


def requantize(flat, block, signed):
    """flat's values after one trip through 8-bit blocks: absmax = max |x| per block, the code of
    x * (1 / absmax), value = point x absmax, all in f32, as the CPU kernels do it (for finite
    values whose 1 / absmax does not overflow)."""
    points, _, _ = code_8bit(signed)
    out = torch.zeros_like(flat)
    for b in range(0, flat.numel(), block):
        x = flat[b:b + block]
        absmax = x.abs().max()
        if absmax > 0:
            q = codes_8bit(x * (torch.tensor(1.0) / absmax), signed)
            out[b:b + block] = points[q.long()] * absmax
    return out
