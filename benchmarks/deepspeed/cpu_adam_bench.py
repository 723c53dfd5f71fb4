#!/usr/bin/env python3
"""zeroshard's CPU AdamW step against DeepSpeed's cpu_adam, built from DeepSpeed's own sdist.

Reproducible by anyone: the script downloads DeepSpeed's source distribution from PyPI (pinned
version and SHA-256) into a temporary directory, builds its cpu_adam op there with
torch.utils.cpp_extension.load() and the flags DeepSpeed's own op builder uses on this machine,
and removes the directory at exit (--keep-build DIR keeps the download and the build for the
next run). Nothing of DeepSpeed is copied into this repository.

DeepSpeed 0.14.4 on a machine without CUDA picks its "cpu" accelerator, whose builder
(op_builder/cpu/builder.py, CPUOpBuilder.cxx_args) compiles csrc/adam/cpu_adam.cpp and
cpu_adam_impl.cpp with
    -O3 -g -Wno-reorder -march=native -fopenmp -D__AVX512__   (-D__AVX256__ / -D__SCALAR__ on
                                                               CPUs without AVX-512F / AVX2)
and no -D__ENABLE_CUDA__ (the CUDA builder's extra flags, -std=c++17, -D__ENABLE_CUDA__ and the
CUDA libraries, change nothing in these two files). The SIMD define comes from the CPU's flags as
op_builder/builder.py's simd_width() reads them (py-cpuinfo, else lscpu). One addition:
-std=c++17, which torch >= 2.1's load() passes by itself and 0.14.4's sources need, while torch
1.13's load() passes -std=c++14.

Two precision configs, N parameters each (100 M by default), AdamW (lr 1e-3, betas 0.9/0.999,
eps 1e-8, weight decay 0.01), the same trainer gradient for all:
  f32:  f32 parameters, gradients, master and moments;
  bf16: a bf16 gradient in and a bf16 parameter copy out, f32 master and moments.
What each implementation does per training step, and the bytes per parameter it moves:
  same-bytes kernel   zeroshard::cpu::same_bytes (zeroshard._core.SameBytes), 64 Ki-element
                      chunks on a oneTBB arena: master, m, v read and written, the gradient read
                      (f32) / plus the bf16 gradient read and a bf16 copy written (bf16): 28 B,
                      the memory ceiling of the update.
  DeepSpeed           adam_update() (what DeepSpeedCPUAdam.step() calls): f32 params, f32 grad,
    cpu_adam          f32 m, v: 28 B. 0.14.4's cpu_adam takes params and gradient of one dtype,
                      so a bf16 gradient with an f32 master cannot go in: in the bf16 config it
                      runs on the f32 copy of the gradient that ZeRO-Offload makes (below).
    ZeRO-Offload      what deepspeed/runtime/zero/stage_1_and_2.py (stages 1-2, offload_optimizer
                      cpu, one rank) does on the CPU around it, with DeepSpeed's own torch calls:
      hand-over       copy_grads_in_partition(): the gradient's norm (grad.double().norm(2)),
                      the inf/NaN check (_has_inf_or_nan), and the copy into the f32 gradient
                      partition (dest.copy_(grad.float())); about 50 B (f32) / 60 B (bf16), most
                      of it temporaries;
      step            step(): unscale_and_clip_grads (grad.mul_(1/scale), run even when the
                      scale is 1: 8 B), adam_update (28 B), and for bf16 the copy of the f32
                      master into the bf16 parameters (bit16.copy_(fp32): 6 B): 36 B / 42 B.
                      On a GPU machine the hand-over and the bf16 copy run on the GPU instead, and
                      4 B per parameter cross PCIe each way (the f32 gradient down, the f32
                      master up), against zeroshard's 2 B each way in bf16.
  zeroshard           a one-rank Engine (self communicator), stage 1, optimizer state on the
                      device tier of a CPU engine (the fused CPU update; an f32 model's master is
                      its parameters), one unit of N parameters:
      hand-over       Engine.grads_ready(unit, [grad]): the copy into the engine's gradient
                      buffer (only its padding is zeroed), the one-rank reduce-scatter (a copy
                      into the shard) and the norm, summed over the shard as it arrives (the
                      CPU tiers take it there): 20 B (f32) / 10 B (bf16);
      step            Engine.step(): the norm and overflow all-reduce (nothing to do on one
                      rank) and the fused update, which reads the f32 or bf16 gradient and
                      writes the bf16 copy in the same pass: 28 B.
                      "update alone" is StepResult.optimizer_s, the update inside the step.
Each round runs the three once each, in an order that rotates per round, so the machine's
bandwidth drift (+-30 % between runs, docs/DESIGN.md rule 9) hits all alike; ratios are medians of
per-round ratios. Before timing, a small run checks that DeepSpeed and zeroshard compute the
same update (3 steps on the same data; fails beyond the stated bounds).

usage: .venv/bin/python benchmarks/deepspeed/cpu_adam_bench.py [--n 100000000] [--threads 2]
            [--rounds 21] [--configs f32,bf16] [--keep-build DIR] [--ds-version 0.14.4]
(/usr/bin/python3 works too where zeroshard is importable. Needs PyTorch with its C++ headers
and pybind11 -- on Debian: apt-get install python3-torch libtorch-dev pybind11-dev -- a C++
compiler and ninja; and the zeroshard Python package: bash scripts/python_test.sh.)
"""
import argparse
import atexit
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

# Versions whose sdist this script has built and checked, with the SHA-256 PyPI serves for it.
PINNED = {"0.14.4": "bb2f404b4a1d06aedd40c64d661f71307c22945d04a42d397ad39bbfeef9c8b8"}
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
CHECK_N = 100_003  # the correctness check: vector body and scalar tail on both sides
SAME_BYTES = 28  # bytes per parameter of the update, and of the same-bytes kernel, both configs


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000_000, help="parameters (default 100 M)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every implementation")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--configs", default="f32,bf16", help="comma list of f32, bf16")
    ap.add_argument("--ds-version", default="0.14.4")
    ap.add_argument("--keep-build", metavar="DIR",
                    help="download and build DeepSpeed here and keep them (reused by later runs)")
    ap.add_argument("--verbose-build", action="store_true", help="show the compiler's output")
    ap.add_argument("--per-round", action="store_true", help="also print every round's times")
    a = ap.parse_args()
    if a.rounds < 7:
        sys.exit("cpu_adam_bench: --rounds must be at least 7 (rule 9)")
    if a.n < 1 or a.threads < 1:
        sys.exit("cpu_adam_bench: --n and --threads must be positive")
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    if not a.configs or any(c not in ("f32", "bf16") for c in a.configs):
        sys.exit("cpu_adam_bench: --configs takes f32 and/or bf16")
    return a


ARGS = parse_args()
# Thread counts before torch and zeroshard start their pools: OpenMP (torch and DeepSpeed's op
# share one libgomp) reads OMP_NUM_THREADS at start-up, the engine's oneTBB arena reads
# ZEROSHARD_CPU_THREADS when it is built (the engine has no thread-count setting of its own).
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
os.environ["ZEROSHARD_CPU_THREADS"] = str(ARGS.threads)
os.environ.setdefault("MAX_JOBS", str(ARGS.threads))  # ninja's parallelism for the build

try:
    import torch
    from torch.utils.cpp_extension import include_paths, load
except ImportError:
    sys.exit("cpu_adam_bench: PyTorch is missing; on Debian: apt-get install python3-torch libtorch-dev")
try:
    import zeroshard as zs
    from zeroshard import _core
except ImportError as e:
    sys.exit(f"cpu_adam_bench: cannot import zeroshard ({e}); build it with `bash scripts/python_test.sh` "
             "and run this script with .venv/bin/python")


# ---- DeepSpeed: download, verify, build ---------------------------------------------------------

def fetch_deepspeed(version, root):
    """The sdist, downloaded into root (or found there from an earlier --keep-build run), checked
    against the pinned SHA-256, extracted; returns the source tree."""
    name = f"deepspeed-{version}"
    tarball = os.path.join(root, f"{name}.tar.gz")
    if not os.path.exists(tarball):
        cmd = [sys.executable, "-m", "pip", "download", f"deepspeed=={version}", "--no-deps",
               "--no-binary", ":all:", "--disable-pip-version-check", "-q", "-d", root]
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    digest = hashlib.sha256(open(tarball, "rb").read()).hexdigest()
    if version in PINNED and digest != PINNED[version]:
        sys.exit(f"cpu_adam_bench: {tarball} has SHA-256 {digest}, expected {PINNED[version]}")
    pin = "pinned" if version in PINNED else "NOT pinned: not a version this script was checked with"
    src = os.path.join(root, name)
    if not os.path.isdir(src):
        with tarfile.open(tarball) as t:
            # The "data" filter (no absolute paths, links out of the tree or device files) where
            # this Python has it.
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            t.extractall(root, **kw)
    for rel in ("csrc/adam/cpu_adam.cpp", "csrc/adam/cpu_adam_impl.cpp", "csrc/includes/cpu_adam.h"):
        if not os.path.exists(os.path.join(src, rel)):
            sys.exit(f"cpu_adam_bench: {name} has no {rel}; this script knows the 0.14 layout")
    return src, f"{name}.tar.gz sha256 {digest} ({pin})"


def simd_define():
    """op_builder/builder.py's simd_width() on x86-64: AVX-512F, else AVX2, else scalar (its
    lscpu fallback, which reads the same flags py-cpuinfo does)."""
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx512f" in flags:
        return "-D__AVX512__"
    return "-D__AVX256__" if "avx2" in flags else "-D__SCALAR__"


def build_cpu_adam(src, build_dir, verbose):
    """DeepSpeed's cpu_adam op from the extracted sdist, as its CPU builder compiles it."""
    flags = ["-O3", "-g", "-Wno-reorder", "-march=native", "-fopenmp", simd_define(), "-std=c++17"]
    if not any(os.path.exists(os.path.join(d, "torch", "extension.h")) for d in include_paths()):
        sys.exit("cpu_adam_bench: PyTorch's C++ headers are missing (torch/extension.h); on Debian: "
                 "apt-get install libtorch-dev pybind11-dev")
    os.makedirs(build_dir, exist_ok=True)
    t0 = time.perf_counter()
    op = load(name="deepspeed_cpu_adam_op", build_directory=build_dir,
              sources=[os.path.join(src, "csrc/adam/cpu_adam.cpp"), os.path.join(src, "csrc/adam/cpu_adam_impl.cpp")],
              extra_include_paths=[os.path.join(src, "csrc/includes")], extra_cflags=flags, verbose=verbose)
    return op, flags, time.perf_counter() - t0


# ---- the three implementations ------------------------------------------------------------------

def timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


class DeepSpeed:
    """DeepSpeed's cpu_adam with ZeRO-Offload's CPU work around it (see the module doc)."""
    next_id = 0

    def __init__(self, op, p0, low):
        self.op, self.low = op, low
        self.id = DeepSpeed.next_id
        DeepSpeed.next_id += 1
        self.p32 = p0.clone()                          # ZeRO's single_partition_of_fp32_groups
        self.g32 = torch.zeros_like(self.p32)          # ... and its .grad
        self.m = torch.zeros_like(self.p32)
        self.v = torch.zeros_like(self.p32)
        self.p16 = self.p32.to(torch.bfloat16) if low else None  # the bit16 partition
        self.steps = 0
        h = HYPER
        op.create_adam(self.id, h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], True, self.id == 0)

    def close(self):
        self.op.destroy_adam(self.id)

    def hand_over(self, g):
        """stage_1_and_2.copy_grads_in_partition() at the accumulation boundary."""
        t = {}
        t["norm"] = timed(lambda: g.double().norm(2))  # set_norm_for_param_grad_in_gpu
        def has_inf_or_nan():                        # update_overflow_tracker_for_param_grad
            x = g.float()
            return x.isnan().logical_or(x.isinf()).float().max()
        t["inf/nan"] = timed(has_inf_or_nan)
        t["copy"] = timed(lambda: self.g32.copy_(g.float()))  # async_inplace_copy_grad_to_fp32_buffer
        return t

    def adam(self):
        h = HYPER
        self.steps += 1
        self.op.adam_update(self.id, self.steps, h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"],
                            True, self.p32, self.g32, self.m, self.v)

    def step(self):
        """stage_1_and_2.step() with offload: unscale (scale 1, no clipping), the optimizer, and
        the copy into the bit16 parameters."""
        t = {"unscale": timed(lambda: self.g32.mul_(1.0 / 1.0)), "adam_update": timed(self.adam)}
        if self.low:
            t["copy-out"] = timed(lambda: self.p16.copy_(self.p32))
        return t


class Zeroshard:
    """A one-rank engine, stage 1, state on the CPU engine's device tier, one unit."""

    def __init__(self, p0, low):
        cfg = zs.Config(stage=1, dtype="bf16" if low else "f32", optimizer=dict(kind="adamw", **HYPER))
        self.e = zs.Engine(cfg, zs.make_self_communicator())
        self.u = self.e.add_unit("model", [zs.Param("w", init=p0)])  # f32 init: the master exactly
        self.e.finalize()
        self.last = None

    def hand_over(self, g):
        return {"grads_ready": timed(lambda: self.e.grads_ready(self.u, [g]))}

    def step(self):
        t0 = time.perf_counter()
        self.last = self.e.step()
        return {"step": time.perf_counter() - t0}

    def params(self):
        return torch.from_dlpack(self.e.params(self.u)[0])

    def state(self, kind):
        return torch.from_dlpack(self.e.read_shard(self.u, kind))[: self.params().numel()]


class SameBytesPass:
    """The update's streams through zeroshard::cpu::same_bytes, on buffers of its own."""

    def __init__(self, g, low, threads):
        self.k = _core.SameBytes(threads)
        n = g.numel()
        self.p, self.m, self.v = (torch.zeros(n) for _ in range(3))
        self.reads = [self.p, self.m, self.v, g]
        self.writes = [self.p, self.m, self.v]
        if low:
            self.writes.append(torch.zeros(n, dtype=torch.bfloat16))  # the bf16 copy-out

    def run(self):
        return {"pass": timed(lambda: self.k.run(self.reads, self.writes))}


# ---- correctness --------------------------------------------------------------------------------

def bf16_ulps(a, b):
    """Distance in bf16 units in the last place (same-sign values: the bit patterns' difference)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


def check_same_update(op, low):
    """3 steps on the same CHECK_N values, a different gradient each step. Bounds: master, m and
    v within 1e-6 (|p| <= 0.5: a few f32 ulps; DeepSpeed contracts with FMA and applies the bias
    corrections in another order); the parameters must have moved (by about 3 lr); bf16 copies
    within 1 ulp of each other, on at most 0.1 % of the elements (a master a few ulps apart can
    round the other way)."""
    gen = torch.Generator().manual_seed(17)
    p0 = torch.rand(CHECK_N, generator=gen) - 0.5
    grads = [(torch.rand(CHECK_N, generator=gen) * 2 - 1) for _ in range(3)]
    if low:
        grads = [g.to(torch.bfloat16) for g in grads]
    ds, ours = DeepSpeed(op, p0, low), Zeroshard(p0, low)
    for g in grads:
        ds.hand_over(g)
        ds.step()
        ours.hand_over(g)
        ours.step()
    master = ours.state(zs.StateKind.master)
    moved = (ds.p32 - p0).abs().max().item()  # a check that fails if neither side did anything
    out = {"moved": moved,
           "master": (master - ds.p32).abs().max().item(),
           "m": (ours.state(zs.StateKind.state0) - ds.m).abs().max().item(),
           "v": (ours.state(zs.StateKind.state1) - ds.v).abs().max().item()}
    ok = moved > 1e-3 and out["master"] <= 1e-6 and out["m"] <= 1e-6 and out["v"] <= 1e-6
    if low:
        # zeroshard's bf16 parameters against DeepSpeed's bit16 copy of its master.
        d = bf16_ulps(ours.params(), ds.p16)
        out["bf16 differing"] = int((d > 0).sum())
        out["bf16 max ulps"] = int(d.max())
        ok = ok and out["bf16 max ulps"] <= 1 and out["bf16 differing"] <= CHECK_N // 1000
    else:
        ok = ok and torch.equal(ours.params(), master)  # the f32 model's master is its parameters
    ds.close()
    return ok, out


# ---- the timed rounds ---------------------------------------------------------------------------

def run_config(op, low, a):
    n = a.n
    gen = torch.Generator().manual_seed(1)
    p0 = torch.rand(n, generator=gen) - 0.5
    g = torch.rand(n, generator=gen) * 2 - 1
    if low:
        g = g.to(torch.bfloat16)
    ds, ours, same = DeepSpeed(op, p0, low), Zeroshard(p0, low), SameBytesPass(g, low, a.threads)
    del p0

    def prefixed(prefix, *parts):
        return {f"{prefix} {k}": v for part in parts for k, v in part.items()}

    # One implementation's turn in a round: its hand-over, then its step (each part timed).
    def slot(name):
        if name == "deepspeed":
            return prefixed("ds", ds.hand_over(g), ds.step())
        if name == "zeroshard":
            t = prefixed("zs", ours.hand_over(g), ours.step())
            t["zs update alone"] = ours.last.optimizer_s
            return t
        return prefixed("same", same.run())

    names = ["deepspeed", "zeroshard", "same-bytes"]
    for _ in range(2):  # warm-up, untimed: page faults, thread pools, DeepSpeed's first steps
        for k in names:
            slot(k)
    rounds = []
    for r in range(a.rounds):
        order = names[r % 3:] + names[:r % 3]
        t = {}
        for k in order:
            t.update(slot(k))
        rounds.append(t)
    ds.close()
    return rounds


def report(config, rounds, n):
    low = config == "bf16"
    col = lambda k: [t[k] for t in rounds]
    def total(keys):
        return [sum(t[k] for k in keys) for t in rounds]
    ds_hand = ["ds norm", "ds inf/nan", "ds copy"]
    ds_step = ["ds unscale", "ds adam_update"] + (["ds copy-out"] if low else [])
    series = {
        "same": col("same pass"),
        "ds adam": col("ds adam_update"),
        "ds step": total(ds_step),
        "ds hand": total(ds_hand),
        "ds total": total(ds_hand + ds_step),
        "zs step": col("zs step"),
        "zs hand": col("zs grads_ready"),
        "zs total": total(["zs grads_ready", "zs step"]),
        "zs update": col("zs update alone"),
    }
    # (label, part, bytes/param (a string where approximate: torch's temporaries), series, the
    # zeroshard series it is compared with)
    hand_b = "~60" if low else "~50"
    rows = [
        ("same-bytes kernel", "one pass", SAME_BYTES, "same", None),
        ("DeepSpeed cpu_adam", "adam_update (f32 grad)", 28, "ds adam", "zs step"),
        ("DeepSpeed ZeRO-Offload", "step: unscale + adam_update" + (" + bf16 copy" if low else ""),
         42 if low else 36, "ds step", "zs step"),
        ("DeepSpeed ZeRO-Offload", "hand-over: norm, inf/NaN, copy in", hand_b, "ds hand", "zs hand"),
        ("DeepSpeed ZeRO-Offload", "hand-over + step", "~102" if low else "~86", "ds total", "zs total"),
        ("zeroshard Engine", "step()", SAME_BYTES, "zs step", None),
        ("zeroshard Engine", "update alone (optimizer_s)", SAME_BYTES, "zs update", None),
        ("zeroshard Engine", "hand-over: grads_ready()", 10 if low else 20, "zs hand", None),
        ("zeroshard Engine", "grads_ready() + step()", 38 if low else 48, "zs total", None),
    ]
    def ratio(num, den):
        r = [x / y for x, y in zip(series[num], series[den])]
        return f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"
    print(f"\n### config {config}: {n} parameters, {len(rounds)} rounds, medians\n")
    parts = [k for k in rounds[0] if k.startswith("ds ")]
    print("DeepSpeed's parts, median s: " + ", ".join(f"{k[3:]} {statistics.median(col(k)):.4f}" for k in parts))
    if ARGS.per_round:
        keys = ["same", "ds adam", "ds step", "ds hand", "zs step", "zs hand"]
        print("per round, s: " + " | ".join(keys))
        for r in range(len(rounds)):
            print(f"  round {r}: " + " | ".join(f"{series[k][r]:.4f}" for k in keys))
    print()
    print("| implementation | part | bytes/param | s | Gparam/s | GB/s | same-bytes time / this | "
          "zeroshard speed-up (this / zeroshard) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, part, bpp, key, vs in rows:
        t = statistics.median(series[key])
        gbs = f"{bpp * n / t / 1e9:.1f}" if isinstance(bpp, int) else "-"
        # Against the ceiling: the passes that move the update's streams, not the hand-overs.
        ceiling = ratio("same", key) if key in ("same", "ds adam", "ds step", "zs step", "zs update") else "-"
        speed = ratio(key, vs) if vs else "-"
        print(f"| {label} | {part} | {bpp if bpp is not None else '-'} | {t:.4f} | {n / t / 1e9:.3f} | {gbs} | "
              f"{ceiling} | {speed} |")


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda k: info.get(k, "?").strip()
    return f"{get('Model name')}, {get('CPU(s)')} CPUs, L3 {get('L3 cache')}"


def main():
    a = ARGS
    torch.set_num_threads(a.threads)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"CPU: {cpu_model()}")
    if a.keep_build:
        root = os.path.abspath(a.keep_build)
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix="zeroshard-ds-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    src, sdist = fetch_deepspeed(a.ds_version, root)
    op, flags, build_s = build_cpu_adam(src, os.path.join(root, f"build-{a.ds_version}"), a.verbose_build)
    print(f"DeepSpeed {a.ds_version}: {sdist}")
    print(f"  cpu_adam built in {build_s:.0f} s with: {' '.join(flags)} (in {root}"
          f"{', kept' if a.keep_build else ', removed at exit'})")
    print(f"torch {torch.__version__}; zeroshard {zs.__version__}, kernel ISA "
          f"{_core.SameBytes(1).isa}; {a.threads} threads everywhere")
    if a.n * SAME_BYTES < 2_000_000_000:
        print(f"note: {a.n} parameters move {a.n * SAME_BYTES / 1e9:.2f} GB per pass; at this size the "
              "caches hold part of the streams and the figures are not the machine's memory ceiling "
              "(use the default 100 M for figures to quote)")

    for config in a.configs:
        low = config == "bf16"
        ok, d = check_same_update(op, low)
        text = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())
        print(f"same update check, {config} (3 steps, {CHECK_N} values): max |zeroshard - DeepSpeed|: {text}")
        if not ok:
            sys.exit("cpu_adam_bench: the two updates differ beyond the bounds; the comparison would be "
                     "meaningless")
    for config in a.configs:
        report(config, run_config(op, config == "bf16", a), a.n)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
