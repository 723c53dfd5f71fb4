#!/usr/bin/env python3
"""torch.compile at stage 3: zeroshard's ZeroOptimizer against FSDP2 (torch's fully_shard on each
block and on the model), on one CPU rank, with the GPT of torch_training_bench.py.

  .venv-torch2/bin/python benchmarks/torch_compile_bench.py            # every case, a table
  .venv-torch2/bin/python benchmarks/torch_compile_bench.py --backend aot_eager --rounds 5

Two ways of compiling, each against the same implementation run eagerly in the same process:
- "model": torch.compile(model), what a user types first;
- "blocks": each block's forward compiled whole (fullgraph=True, so a graph break raises), the
  sharding hooks outside: zeroshard's opt.compile_modules(); for FSDP2 the same call on each
  block it shards (`block.forward = torch.compile(block.forward, fullgraph=True)`).
Each case runs in a process of its own (Dynamo's counters and caches are per process) and
reports what Dynamo counted (graph breaks, frames it gave up on and ran eagerly, graphs, the
calls traced into them), the largest parameter difference from the eager run after the same
steps, and the median over rounds of the compiled step's time over the eager one's (one
training step each per round, alternating which goes first; the first two rounds, which
compile, are left out).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_training_bench import GPT, HYPER  # noqa: E402


def build(impl, a, compiled):
    """(model, step) of one implementation; step(x, y) runs one training step."""
    torch.manual_seed(0)
    model = GPT(a.vocab, a.dim, a.heads, a.layers, a.seq)
    if impl == "zeroshard":
        import zeroshard as zs
        import zeroshard.torch as zt
        opt = zt.ZeroOptimizer(model, stage=3, comm=zs.make_self_communicator(), **HYPER)
        if compiled == "blocks":
            opt.compile_modules(backend=a.backend)
        state = opt.model_state_dict
    else:
        from torch.distributed.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
            if compiled == "blocks":
                b.forward = torch.compile(b.forward, fullgraph=True, backend=a.backend)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)

        def state():
            return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                    for k, v in model.state_dict().items()}
    run = torch.compile(model, backend=a.backend) if compiled == "model" else model

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(run(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return step, state


def one_case(a):
    if a.impl == "fsdp2":
        import torch.distributed as dist
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    from torch._dynamo.utils import counters
    torch.set_num_threads(a.threads)
    eager, compiled = build(a.impl, a, None), build(a.impl, a, a.mode)
    g = torch.Generator().manual_seed(1)
    ratios = []
    for r in range(a.rounds):
        x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        took = {}
        for name, (step, _) in sorted({"eager": eager, "compiled": compiled}.items(),
                                      reverse=r % 2 == 1):
            t = time.perf_counter()
            step(x, y)
            took[name] = time.perf_counter() - t
        if r >= 2:
            ratios.append(took["compiled"] / took["eager"])
    want, got = eager[1](), compiled[1]()
    diff = max(torch.where(got[k] == w, 0.0, (got[k].float() - w.float()).abs()).max().item()
               for k, w in want.items() if w.is_floating_point())  # the mask's -inf are equal
    skipped = sum(n for reason, n in counters["unimplemented"].items()
                  if "Skipping the frame" in reason or "frame skipped" in reason)
    print(json.dumps({"impl": a.impl, "mode": a.mode, "backend": a.backend,
                      "graph_breaks": sum(counters["graph_break"].values()),
                      "frames_run_eagerly": skipped,
                      "graphs": counters["stats"].get("unique_graphs", 0),
                      "calls_traced": counters["stats"].get("calls_captured", 0),
                      "max_param_diff": diff,
                      "compiled_over_eager": statistics.median(ratios) if ratios else None,
                      "torch": torch.__version__}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--impl", choices=["zeroshard", "fsdp2"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["model", "blocks"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.impl:
        one_case(a)
        return
    rows = []
    for impl in ("fsdp2", "zeroshard"):
        for mode in ("model", "blocks"):
            print(f"torch_compile_bench: {impl}, {mode} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--impl", impl, "--mode", mode]
                                 + sys.argv[1:], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"torch_compile_bench: {impl}, {mode} failed:\n{out.stderr[-4000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"torch {rows[0]['torch']}, backend {a.backend}, GPT of {a.layers} blocks of width "
          f"{a.dim}, batch {a.batch} x {a.seq}, {a.rounds} rounds")
    print("| implementation | compiled | graph breaks | frames run eagerly | graphs | calls "
          "traced | max param diff | compiled / eager step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["compiled_over_eager"]
        print(f"| {r['impl']} | {r['mode']} | {r['graph_breaks']} | {r['frames_run_eagerly']} | "
              f"{r['graphs']} | {r['calls_traced']} | {r['max_param_diff']:.1e} | "
              f"{'—' if ratio is None else f'{ratio:.3f}'} |")


if __name__ == "__main__":
    main()
