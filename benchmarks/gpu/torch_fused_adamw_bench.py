#!/usr/bin/env python3
"""PyTorch's fused AdamW on CUDA, the peer of fused_adamw_bench's zeroshard update.

Times torch.optim.AdamW(fused=True) steps on one flat parameter of --elements elements (the
same count fused_adamw_bench uses) with CUDA events: warm-up, then --rounds rounds; each round
times one optimizer step and one device-to-device copy of the same bytes (torch's copy_ of
contiguous bytes is a cudaMemcpyAsync, the reference fused_adamw_bench uses), in an order that
flips every round, and the medians are reported (docs/DESIGN.md rule 9).

Cases (the key names the zeroshard case of fused_adamw_bench it is compared with):

  f32_grad_no_out      f32 param, f32 grad, f32 exp_avg / exp_avg_sq: one fused kernel reads
                       param, grad, m, v and writes param, m, v = 28 B/element. The same math and
                       bytes as zeroshard's "f32 grad, no copy-out" (f32 master, m, v, f32 grad).
  bf16_grad_bf16_out   zeroshard's "bf16 grad, bf16 param copy-out" (f32 master, m, v, bf16 grad
                       in, bf16 param out, 28 B/element in one kernel) as closely as torch allows:
                       its fused AdamW takes grads of the param's dtype only, so a mixed-precision
                       torch trainer keeps an f32 master param and does (1) master.grad.copy_(bf16
                       grad) (6 B/element), (2) the fused step on f32 (28 B), (3) bf16_param.copy_(
                       master) (6 B): 40 B/element in three kernels; all three are timed.
  bf16_all             for reference only, not the same math: bf16 param, grad, m and v (torch's
                       state follows the param's dtype; the kernel computes in f32 and rounds
                       param and state to bf16 every step): 14 B/element. No zeroshard peer.

Timing: each timed piece of work is queued behind torch.cuda._sleep (a GPU busy-wait of a few
ms), so the start event fires only after Python has queued the step: the figure is the GPU time
of the step's kernels, comparable with fused_adamw_bench's C++ launch. Where _sleep is missing
the events time from an idle GPU and include Python's launch overhead (said in the output).
`launched_ms` is also reported: one step from an idle GPU, Python's overhead included, as an
eager-mode training loop that waits for its step sees it.

Output: one human-readable line per case, then one `data: {json}` line per case (run_all.sh
joins them with fused_adamw_bench's data lines of the same keys), on stdout and in --out.
Needs only PyTorch with CUDA (not zeroshard's Python module).

--self-test-cpu runs the script's logic on the CPU (time.perf_counter, torch's default AdamW,
no fused kernel) to check it on a machine without a GPU; its figures mean nothing.
"""

import argparse
import json
import math
import statistics
import sys
import time


def fail(msg, code=1):
    print(f"torch_fused_adamw_bench: {msg}", file=sys.stderr)
    sys.exit(code)


try:
    import torch
except Exception as e:  # noqa: BLE001 - any import failure means the same: no torch
    fail(f"cannot import torch: {e!r}", 2)


class Timer:
    """Times a callable on the GPU (CUDA events) or, in the CPU self-test, with perf_counter."""

    def __init__(self, cuda, sleep_cycles):
        self.cuda = cuda
        self.sleep_cycles = sleep_cycles
        self.hidden = cuda and sleep_cycles > 0 and hasattr(torch.cuda, "_sleep")
        if cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def device_ms(self, fn):
        """Milliseconds of fn's GPU work, its launch hidden behind a busy-wait where possible."""
        if not self.cuda:
            return self.launched_ms(fn)
        torch.cuda.synchronize()
        if self.hidden:
            torch.cuda._sleep(self.sleep_cycles)
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)

    def launched_ms(self, fn):
        """Milliseconds from an idle GPU (or CPU) until fn's work is done, launch included."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


def make_case(key, n, dev, fused):
    """Returns (description, bytes per element, step callable, tensors to free)."""
    opt_args = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if fused:
        opt_args["fused"] = True
    gen = torch.Generator(device=dev).manual_seed(4)

    def rand(dtype, lo, hi):
        t = torch.empty(n, dtype=torch.float32, device=dev)
        t.uniform_(lo, hi, generator=gen)
        return t.to(dtype)

    if key == "f32_grad_no_out":
        p = torch.nn.Parameter(rand(torch.float32, -1, 1))
        p.grad = rand(torch.float32, -1, 1)
        opt = torch.optim.AdamW([p], **opt_args)
        desc = ("f32 param + f32 grad + f32 m, v; one fused AdamW kernel: reads param, grad, m, v,"
                " writes param, m, v")
        return desc, 28.0, opt.step, [p, opt]
    if key == "bf16_grad_bf16_out":
        master = torch.nn.Parameter(rand(torch.float32, -1, 1))
        master.grad = torch.zeros(n, dtype=torch.float32, device=dev)
        g16 = rand(torch.bfloat16, -1, 1)
        p16 = master.detach().to(torch.bfloat16)
        opt = torch.optim.AdamW([master], **opt_args)

        def step():
            master.grad.copy_(g16)  # bf16 grad -> f32 .grad: read 2, write 4 B
            opt.step()  # fused AdamW on f32: 28 B
            p16.copy_(master.detach())  # f32 master -> bf16 model param: read 4, write 2 B

        desc = ("f32 master + m, v; bf16 grad upcast into master.grad, fused AdamW on f32, f32 "
                "master copied out to a bf16 param: three kernels")
        return desc, 40.0, step, [master, g16, p16, opt]
    if key == "bf16_all":
        p = torch.nn.Parameter(rand(torch.bfloat16, -1, 1))
        p.grad = rand(torch.bfloat16, -1, 1)
        opt = torch.optim.AdamW([p], **opt_args)
        desc = ("bf16 param + bf16 grad + bf16 m, v (NOT zeroshard's math: no f32 master); one "
                "fused kernel")
        return desc, 14.0, opt.step, [p, opt]
    raise ValueError(key)


PEERS = {
    "f32_grad_no_out": "zeroshard f32_grad_no_out (same math, same 28 B/element)",
    "bf16_grad_bf16_out": "zeroshard bf16_grad_bf16_out (same math; zeroshard moves 28 B/element "
    "in one kernel)",
    "bf16_all": "none (reference only: bf16 master and state)",
}


def run_case(key, n, dev, fused, rounds, timer):
    desc, bpe, step, keep = make_case(key, n, dev, fused)
    # The same-bytes copy: reads and writes half the step's bytes each, as fused_adamw_bench's.
    half = int(n * bpe) // 2
    src = torch.ones(half, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    before = keep[0].detach()[:4096].float().clone()
    for _ in range(3):  # also creates the optimizer state (first step)
        timer.device_ms(step)
        timer.device_ms(copy)
    step_ms, copy_ms, ratio, launched = [], [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            ts = timer.device_ms(step)
            tc = timer.device_ms(copy)
        else:
            tc = timer.device_ms(copy)
            ts = timer.device_ms(step)
        step_ms.append(ts)
        copy_ms.append(tc)
        ratio.append(tc / ts)
        launched.append(timer.launched_ms(step))
    # A step that did nothing would make every ratio meaningless: the params must have moved.
    after = keep[0].detach()[:4096].float()
    moved = (after - before).abs().sum().item()
    if not (math.isfinite(moved) and moved > 0):
        raise RuntimeError(f"the parameters did not change (or are not finite) after "
                           f"{2 * rounds + 3} steps: sum |change| of the first 4096 = {moved}")
    del keep
    src = dst = None  # frees both (the copy closure holds the names, not the tensors)
    med = statistics.median
    gbs = n * bpe / (med(step_ms) * 1e6)
    line = (f"torch {key}: step {med(step_ms):.3f} ms ({gbs:.0f} GB/s at {bpe:.0f} B/element), "
            f"{med(ratio):.3f} of same-bytes D2D copy (median per-round ratio; min {min(ratio):.3f},"
            f" max {max(ratio):.3f}), copy {med(copy_ms):.3f} ms; launched from idle GPU "
            f"{med(launched):.3f} ms. Does: {desc}. Peer: {PEERS[key]}")
    data = {
        "bench": "torch",
        "case": key,
        "elements": n,
        "bytes_per_element": bpe,
        "update_ms": med(step_ms),
        "copy_ms": med(copy_ms),
        "copy_over_update": med(ratio),
        "launched_ms": med(launched),
        "rounds": rounds,
        "launch_hidden": timer.hidden,
    }
    return line, data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 26,
                    help="parameters per case (default 64 Mi, fused_adamw_bench's default)")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--cases", default="f32_grad_no_out,bf16_grad_bf16_out,bf16_all")
    ap.add_argument("--sleep-cycles", type=int, default=5_000_000,
                    help="GPU busy-wait before each timed piece (hides Python's launch; 0: off)")
    ap.add_argument("--out", help="also write the lines to this file")
    ap.add_argument("--self-test-cpu", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.elements <= 0 or a.rounds <= 0:
        fail("--elements and --rounds must be positive", 2)
    cases = [c for c in a.cases.split(",") if c]
    for c in cases:
        if c not in PEERS:
            fail(f"unknown case {c!r} (known: {', '.join(PEERS)})", 2)

    cuda = not a.self_test_cpu
    if cuda:
        if not torch.cuda.is_available():
            fail(f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda = "
                 f"{torch.version.cuda})", 2)
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        name = torch.cuda.get_device_name(dev)
    else:
        dev = torch.device("cpu")
        name = "CPU self-test (figures meaningless)"
    timer = Timer(cuda, a.sleep_cycles)
    header = [
        "# torch_fused_adamw_bench",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), device: {name}",
        f"elements: {a.elements}, rounds: {a.rounds} (step and same-bytes copy alternate, order "
        "flipped every round; medians)",
        "hyperparameters: lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01; no grad "
        "scaling (zeroshard's side folds a 1/1024 unscale into its kernel, free in a fused pass)",
        "timing: " + ("GPU time, launch hidden behind torch.cuda._sleep(%d)" % a.sleep_cycles
                      if timer.hidden else
                      "from an idle GPU, Python's launch overhead included (no _sleep)"
                      if cuda else "perf_counter on the CPU"),
        "",
    ]
    for h in header:
        print(h, flush=True)
    lines, datas = [], []
    for key in cases:
        try:
            line, data = run_case(key, a.elements, dev, cuda, a.rounds, timer)
        except Exception as e:  # noqa: BLE001 - reported per case, the other cases still run
            # E.g. an old torch without fused AdamW (TypeError), a dtype it does not fuse, memory.
            line, data = f"torch {key}: FAILED: {type(e).__name__}: {e}", None
        if cuda:
            torch.cuda.empty_cache()
        print(line, flush=True)
        lines.append(line)
        if data:
            datas.append(data)
    data_lines = ["data: " + json.dumps(d, sort_keys=True) for d in datas]
    for d in data_lines:
        print(d)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(header + lines + [""] + data_lines) + "\n")
    return 0 if datas else 1


if __name__ == "__main__":
    sys.exit(main())
