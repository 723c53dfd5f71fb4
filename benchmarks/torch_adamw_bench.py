#!/usr/bin/env python3
"""zeroshard's fused CPU AdamW step against PyTorch's CPU AdamW on the same sizes, and with
--state 8bit, zeroshard's 8-bit moments against bitsandbytes' CPU AdamW8bit.

Both sides update N f32 parameters (100 M by default) with f32 gradients:
  torch:     torch.optim.AdamW over a list of tensors (f32 moments), in its default (for-loop)
             implementation and with foreach=True;
  bnb:       (--state 8bit) bitsandbytes.optim.AdamW8bit over the same list, its 8-bit moments
             (the dynamic map, blocks of 256) on the CPU; needs torch 2 and bitsandbytes;
  zeroshard: zeroshard::cpu::optimizer_update, the engine's path (64 Ki-element chunks on a
             oneTBB arena; f32 moments, or with --state 8bit the 8-bit ones in blocks of
             --block), run by benchmarks/adamw_step_server in a child process.
Each round runs one step of each, in an order that rotates per round, so the machine's memory
bandwidth drift (rule 9: +-30 % between runs) hits all of them alike; while torch runs, the
child blocks on its stdin. The figure is the median over rounds of their time / zeroshard's
time (how many times faster zeroshard's step is). Before timing, a small run checks that both
compute the same update (3 steps, same data, max abs difference from torch's AdamW printed;
with 8-bit moments zeroshard's must be within a tenth of how far the parameters moved, and
bitsandbytes' difference is printed beside it).

usage: python3 benchmarks/torch_adamw_bench.py [--server build/benchmarks/adamw_step_server]
                        [--n 100000000] [--tensors 100] [--threads 2] [--rounds 9]
                        [--state f32|8bit] [--block 2048]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

try:
    import torch
except ImportError:
    sys.exit("torch_adamw_bench: PyTorch is missing; on Debian: apt-get install python3-torch")

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class Server:
    """The zeroshard side: one process holding its own state, one command per line."""

    def __init__(self, path, n, threads, state="f32", block=2048):
        b1, b2 = HYPER["betas"]
        args = [path, "--n", str(n), "--threads", str(threads), "--lr", str(HYPER["lr"]), "--beta1", str(b1),
                "--beta2", str(b2), "--eps", str(HYPER["eps"]), "--wd", str(HYPER["weight_decay"]),
                "--state", state, "--block", str(block)]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.banner = self.p.stdout.readline().strip()
        if not self.banner.startswith("ready"):
            sys.exit(f"torch_adamw_bench: {path} did not start: {self.banner!r}")

    def cmd(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline().strip()
        if out.startswith("error"):
            sys.exit(f"torch_adamw_bench: server: {out}")
        return out

    def close(self):
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        self.p.wait()


def reference(params, state):
    """The optimizer zeroshard is compared with: torch's AdamW, or bitsandbytes' AdamW8bit."""
    if state == "8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            sys.exit("torch_adamw_bench: --state 8bit needs bitsandbytes (pip install bitsandbytes, torch 2)")
        return bnb.optim.AdamW8bit(params, min_8bit_size=0, **HYPER)
    return torch.optim.AdamW(params, **HYPER)


def check_same_update(server_path, threads, state, block):
    """3 AdamW steps on the same 4099 values: zeroshard's result against torch's AdamW (f32
    moments, the exact reference). With 8-bit moments also bitsandbytes' AdamW8bit against it.
    Returns zeroshard's max |difference|, how far the parameters moved, and bitsandbytes' max
    |difference| (None with f32 moments)."""
    n = 4099
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.bin"), os.path.join(d, "out.bin")
        with open(src, "wb") as f:
            f.write(p0.numpy().tobytes() + grad.numpy().tobytes())
        s = Server(server_path, n, threads, state, min(block, 4096))
        s.cmd(f"load {src}")
        for _ in range(3):
            s.cmd("step")
        s.cmd(f"dump {dst}")
        s.close()
        with open(dst, "rb") as f:
            ours = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)

    def three_steps(state_of_reference):
        p = p0.clone().requires_grad_(True)
        opt = reference([p], state_of_reference)
        for _ in range(3):
            p.grad = grad.clone()
            opt.step()
        return p.detach()

    exact = three_steps("f32")
    theirs = (three_steps("8bit") - exact).abs().max().item() if state == "8bit" else None
    return (ours - exact).abs().max().item(), (exact - p0).abs().max().item(), theirs


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default=os.path.join(here, "..", "build", "benchmarks", "adamw_step_server"))
    ap.add_argument("--n", type=int, default=100_000_000)
    ap.add_argument("--tensors", type=int, default=100, help="torch parameters the N values are split into")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--state", choices=("f32", "8bit"), default="f32")
    ap.add_argument("--block", type=int, default=2048, help="zeroshard's 8-bit block")
    a = ap.parse_args()
    if a.rounds < 7:
        sys.exit("torch_adamw_bench: --rounds must be at least 7 (rule 9)")
    if not os.access(a.server, os.X_OK):
        sys.exit(f"torch_adamw_bench: {a.server} not found; build it (ninja -C build adamw_step_server) or pass --server")
    torch.set_num_threads(a.threads)

    diff, moved, bnb_diff = check_same_update(a.server, a.threads, a.state, a.block)
    print(f"torch {torch.__version__}, {a.threads} threads; same update check (3 steps, 4099 values): "
          f"max |zeroshard - torch AdamW| = {diff:.2e} (parameters moved {moved:.2e})")
    if bnb_diff is not None:
        print(f"  max |bitsandbytes AdamW8bit - torch AdamW| = {bnb_diff:.2e}")
    if not diff <= (0.1 * moved if a.state == "8bit" else 1e-5):
        sys.exit("torch_adamw_bench: zeroshard's update differs from torch's AdamW; the comparison would be meaningless")

    server = Server(a.server, a.n, a.threads, a.state, a.block)
    print(f"zeroshard: {server.banner}")
    sizes = [a.n // a.tensors + (1 if i < a.n % a.tensors else 0) for i in range(a.tensors)]
    params = [torch.empty(k).uniform_(-0.5, 0.5).requires_grad_(True) for k in sizes]
    for q in params:
        q.grad = torch.empty_like(q).uniform_(-0.5, 0.5)
    # Optimizers on the same parameters, each with its own moments (m, v).
    if a.state == "8bit":
        variants = {"bitsandbytes AdamW8bit": reference(params, "8bit")}
    else:
        variants = {"torch AdamW (default)": torch.optim.AdamW(params, **HYPER),
                    "torch AdamW (foreach=True)": torch.optim.AdamW(params, foreach=True, **HYPER)}

    def time_torch(opt):
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    # Warm-up: the first step allocates torch's moments and touches every page.
    for opt in variants.values():
        time_torch(opt)
    server.cmd("step")

    names = list(variants) + ["zeroshard"]
    times = {k: [] for k in names}
    ratios = {k: [] for k in variants}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {}
        for k in order:
            got[k] = float(server.cmd("step")) if k == "zeroshard" else time_torch(variants[k])
        for k in names:
            times[k].append(got[k])
        for k in variants:
            ratios[k].append(got[k] / got["zeroshard"])
    server.close()

    # AdamW's traffic: p, g, m, v read; p, m, v written (f32 moments 4 bytes, 8-bit 1)
    per = 28 if a.state == "f32" else 16
    gb = per * a.n / 1e9
    print(f"\nN = {a.n} parameters in {a.tensors} tensors, {a.state} moments, {a.rounds} rounds, median per round\n")
    print(f"| implementation | step s | Gparam/s | GB/s ({per} B/param) | zeroshard speed-up, median (min-max) |")
    print("|---|---|---|---|---|")
    for k in names:
        t = statistics.median(times[k])
        if k == "zeroshard":
            col = "1"
        else:
            col = f"{statistics.median(ratios[k]):.2f}x ({min(ratios[k]):.2f}-{max(ratios[k]):.2f})"
        print(f"| {k} | {t:.3f} | {a.n / t / 1e9:.3f} | {gb / t:.1f} | {col} |")


if __name__ == "__main__":
    main()
