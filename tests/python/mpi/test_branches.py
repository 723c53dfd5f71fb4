"""Control flow that differs per rank, under `mpirun -np 2` (any world size dividing 16): an
auxiliary head that only some ranks use in a step. At stages 0-2 the engine's collectives run
in one order whatever the ranks' backward passes did, so each rank's unused parameters count as
zero gradients and the update equals torch.optim.AdamW on the mean of the ranks' losses,
computed in one process. At stage 3 the head's forward gathers its parameters, a collective
only the ranks running it call: every rank fails with an error, none aborts or mixes units."""

import copy

import pytest
import torch
import torch.nn as nn

import zeroshard as zs
import zeroshard.torch as zt
from zs_testutil import (CLIP, DIM, EPS, LR, VOCAB, agree, batches, groups, max_abs_diff,
                         rank_slice, world)

BOUND = 2e-5  # as in test_parity.py
STEPS = 12


class AuxLM(nn.Module):
    """Embedding -> Linear -> head, plus an auxiliary head (its own unit) that a rank uses only
    when `use_aux` says so for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 7)
        self.aux = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, 7))

    def forward(self, tokens, use_aux):
        h = torch.tanh(self.proj(self.embed(tokens).mean(1)))
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def use_aux(rank, step):
    # Rank 0 always, other ranks on alternate steps: in some steps only one rank runs the
    # branch, so the ranks' backward passes hand the units over in different orders.
    return rank == 0 or step % 2 == 1


def rank_loss(model, tokens, labels, rank, world_size, step):
    mine = rank_slice(rank, world_size)
    logits = model(tokens[mine], use_aux(rank, step))
    return nn.functional.cross_entropy(logits, labels[mine])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_branch_on_some_ranks_matches_adamw(stage):
    comm, rank, size = world()
    model, data = AuxLM(), batches(STEPS)
    ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(groups(ref), lr=LR, eps=EPS)
    for step, (tokens, labels) in enumerate(data):
        ropt.zero_grad()
        loss = sum(rank_loss(ref, tokens, labels, r, size, step) for r in range(size)) / size
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ropt.step()
    opt = zt.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, gradient_clipping=CLIP,
                           param_groups=groups(model), collective_timeout_s=120)
    for step, (tokens, labels) in enumerate(data):
        opt.zero_grad()
        rank_loss(model, tokens, labels, rank, size, step).backward()
        opt.step()
    diff = max_abs_diff(opt.model_state_dict(), ref.state_dict())
    assert agree(comm, diff <= BOUND and opt.last_result.step == STEPS), \
        f"rank {rank}: stage {stage}: max |zero - adamw| = {diff:.3g} (bound {BOUND})"


def test_stage3_branch_on_some_ranks_fails_every_rank():
    comm, rank, size = world()
    if size == 1:
        pytest.skip("needs 2 ranks")
    model, (tokens, labels) = AuxLM(), batches(1)[0]
    # A communicator of its own: the one that fails stays unusable (its collectives in flight
    # may still be completed by MPI), the test suite's goes on.
    own = zs.make_mpi_communicator()
    opt = zt.ZeroOptimizer(model, stage=3, lr=LR, param_groups=groups(model), comm=own,
                           collective_timeout_s=5)
    error = ""
    try:
        rank_loss(model, tokens, labels, rank, size, step=0).backward()  # aux on rank 0 only
        opt.step()
    except zs.Error as e:
        error = str(e)
    ok = "unit '" in error and ("different collectives" in error or "did not complete" in error)
    assert agree(comm, ok), f"rank {rank}: {error!r}"
