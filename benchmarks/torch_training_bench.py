#!/usr/bin/env python3
"""Data-parallel PyTorch training on CPU ranks: zeroshard's ZeroOptimizer against DDP with
torch.optim.AdamW and against DDP with torch's ZeroRedundancyOptimizer, on the same model.

Run on every rank of an MPI launch (zeroshard's collectives go over MPI; torch's over gloo,
bootstrapped from Open MPI's rank variables):

  mpirun -np 2 .venv/bin/python benchmarks/torch_training_bench.py            # step times
  mpirun -np 2 .venv/bin/python benchmarks/torch_training_bench.py --memory zeroshard

Time mode: each rank holds one copy of the model per implementation and every round runs one
training step (forward, backward, optimizer step) of each, in an order that rotates per round, so
drift hits all alike; a fourth "local" step runs the same model with torch AdamW and no
communication at all (DDP's no_sync()), the compute every implementation shares. Exposed
communication: zeroshard reports it itself (StepResult.comm_exposed_s, the time the trainer
waited on collectives); for the torch implementations, whose collectives run inside backward and
step, it is estimated as their step time minus the local step's.

Memory mode (one implementation per process, so nothing else is resident): the rank's resident
set above its size before the model was built, at its peak during the optimizer's construction
and, after the peak is reset (/proc/self/clear_refs), at its peak during training and at the end.

The model: a small GPT (token and position embeddings, an nn.ModuleList of pre-norm transformer
blocks, a head tied to the token embedding), trained on random tokens (the bench times steps; it
does not need the loss to mean anything).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, dim, heads, layers, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x, self.mask)
        return self.head(self.ln(x))


def rank_env():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    return rank, size


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def make(impl, a):
    """(model, step function) of one implementation; step(x, y) runs one training step."""
    torch.manual_seed(0)
    model = GPT(a.vocab, a.dim, a.heads, a.layers, a.seq)
    if impl == "zeroshard":
        import zeroshard.torch as zt
        opt = zt.ZeroOptimizer(model, stage=a.stage, **HYPER)

        def step(x, y):
            opt.zero_grad()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            r = opt.last_result
            return r.comm_exposed_s
        return model, step
    ddp = nn.parallel.DistributedDataParallel(model)
    if impl == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **HYPER)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **HYPER)
    local = impl == "local"

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        if local:
            with ddp.no_sync():
                F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        else:
            F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        return None
    return model, step


def data(a, rank, rounds):
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(a.vocab, (a.batch, a.seq), generator=g),
             torch.randint(a.vocab, (a.batch, a.seq), generator=g)) for _ in range(rounds)]


def time_mode(a, rank, size):
    impls = ["local", "ddp", "zero1", "zeroshard"]
    steps = {i: make(i, a)[1] for i in impls}
    nparams = sum(p.numel() for p in GPT(a.vocab, a.dim, a.heads, a.layers, a.seq).parameters())
    batches = data(a, rank, a.rounds + a.warmup)
    t = {i: [] for i in impls}
    exposed = []
    for r, (x, y) in enumerate(batches):
        for k in range(len(impls)):
            impl = impls[(r + k) % len(impls)]
            dist.barrier()  # every rank starts each step together
            t0 = time.perf_counter()
            e = steps[impl](x, y)
            dt = time.perf_counter() - t0
            if r >= a.warmup:
                t[impl].append(dt)
                if e is not None:
                    exposed.append(e / dt)
    if rank != 0:
        return
    med = {i: statistics.median(v) for i, v in t.items()}
    print(f"{size} ranks, {nparams / 1e6:.2f} M parameters ({a.layers} blocks of width {a.dim}, "
          f"tied head), batch {a.batch} x {a.seq} tokens per rank, {a.rounds} rounds after "
          f"{a.warmup} warm-up, torch {torch.__version__} with {torch.get_num_threads()} "
          f"thread(s) per rank; load average {os.getloadavg()[0]:.2f}\n")
    print("| implementation | step s (median) | exposed communication, share of the step | "
          "zeroshard speed-up, median of per-round ratios (min–max) |")
    print("|---|---|---|---|")
    for i in impls:
        if i == "zeroshard":
            share = f"{statistics.median(exposed):.1%} (measured)"
        else:
            share = "—" if i == "local" else f"{max(0.0, 1 - med['local'] / med[i]):.1%} (estimated)"
        ratios = [a_ / b_ for a_, b_ in zip(t[i], t["zeroshard"])]
        sp = "1" if i == "zeroshard" else (f"{statistics.median(ratios):.2f}× "
                                          f"({min(ratios):.2f}–{max(ratios):.2f})")
        print(f"| {i} | {med[i]:.4f} | {share} | {sp} |")
    print(f"\nzeroshard's step against the local step (its exposed share, estimated the torch "
          f"way): {max(0.0, 1 - med['local'] / med['zeroshard']):.1%}")


def memory_mode(a, rank, size):
    if a.memory == "zeroshard":  # the library and MPI are loaded before the baseline
        import zeroshard
        zeroshard.default_communicator()
    base = rss_kib("VmRSS")
    reset_peak()
    model, step = make(a.memory, a)
    built_peak = rss_kib("VmHWM") - base
    built = rss_kib("VmRSS") - base
    reset_peak()
    for x, y in data(a, rank, a.rounds):
        step(x, y)
    train_peak = rss_kib("VmHWM") - base
    end = rss_kib("VmRSS") - base
    out = torch.tensor([built_peak, built, train_peak, end], dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(size)]
    dist.all_gather(gathered, out)
    if rank == 0:
        print(f"{a.memory}: MiB above the rank's resident set before the model was built "
              "(construction peak, after construction, training peak, end of training)")
        for r, g in enumerate(gathered):
            print(f"  rank {r}: " + ", ".join(f"{v / 1024:.1f}" for v in g.tolist()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--stage", type=int, default=2, help="zeroshard's ZeRO stage (default 2)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory", choices=["ddp", "zero1", "zeroshard"],
                   help="memory mode: build and train this implementation alone")
    a = p.parse_args()
    rank, size = rank_env()
    if size < 2:
        sys.exit("torch_training_bench: run under mpirun -np 2 (or more)")
    # Ranks share the machine's cores: torch's intra-op threads like zeroshard's arena.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    if a.memory:
        memory_mode(a, rank, size)
    else:
        time_mode(a, rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
