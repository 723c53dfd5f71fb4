#!/usr/bin/env python3
"""zeroshard's CPU AdamW step against DeepSpeed's cpu_adam, built from DeepSpeed's own sdist.

Reproducible by anyone: the script downloads DeepSpeed's source distribution from PyPI (pinned
version and SHA-256) into a temporary directory, builds its cpu_adam op there with
torch.utils.cpp_extension.load() and the flags DeepSpeed's own op builder uses on this machine,
and removes the directory at exit (--keep-build DIR keeps the download and the build for the
next run). Nothing of DeepSpeed is copied into this repository. DeepSpeed 0.19.8 is the default;
--ds-version 0.14.4 runs the earlier comparison (f32 and bf16 configs only).

The build. DeepSpeed 0.19.8 takes its cpu_adam builder from op_builder/cpu/ on every machine
(the "cpu" accelerator where there is no GPU; the "cuda" one imports CPUAdamBuilder from
op_builder/cpu too, accelerator/cuda_accelerator.py). CPUOpBuilder.cxx_args
(op_builder/cpu/builder.py) and OpBuilder.jit_load (op_builder/builder.py, which appends
-UC10_USE_GLOG to every op) compile csrc/adam/cpu_adam.cpp and cpu_adam_impl.cpp with
    -O3 -g -Wno-reorder -march=native -fopenmp -D__AVX512__ -UC10_USE_GLOG
(-D__AVX256__ / -D__SCALAR__ on CPUs without AVX-512F / AVX2: the SIMD define comes from the
CPU's flags as op_builder/builder.py's simd_width() reads them, py-cpuinfo, else lscpu) and the
C++ standard torch's load() passes by itself (-std=c++20 in torch 2.15). DeepSpeed 0.14.4 on a
machine without CUDA: the same flags without -UC10_USE_GLOG (its CUDA builder's extra flags
change nothing in these two files). One addition, for both: -std=c++17 where torch's load()
passes an older standard (torch 1.13: -std=c++14), which both versions' sources need.

What DeepSpeed 0.19.8's cpu_adam accepts (csrc/adam/cpu_adam_impl.cpp, InvokerInitializer and
invoke()): adam_update(params, grads, exp_avg, exp_avg_sq) picks its kernel by the dtypes of
params and exp_avg, one of (f32, f32), (bf16, f32), (bf16, bf16), (f16, f32), (f16, f16); the
gradient is read as the params' dtype and exp_avg_sq as exp_avg's (neither is checked). The
params are updated in place in their own dtype, every bf16 store rounded to nearest even
(csrc/includes/simd.h, store_16_f32_as_bf16_nearest; c10::BFloat16 in the scalar loop): there is
no f32 master beside bf16 params and no separate bf16 copy. bf16 runs vectorized with AVX-512
only; with -D__AVX256__ it runs the scalar loop (csrc/includes/cpu_adam.h, Step_AVX). No kernel
takes f32 params with bf16 moments. DeepSpeedCPUAdam(fp32_optimizer_states=False) keeps the
moments in the params' dtype (deepspeed/ops/adam/cpu_adam.py; the default keeps them f32), and
ZeRO allows bf16 optimizer states only together with bf16 master weights and gradients
(bf16_optimizer_states requires bf16_master_weights_and_grads:
deepspeed/runtime/base_optimizer.py _configure_master_weights, deepspeed/runtime/config.py):
DeepSpeed's bf16 moments come with a bf16 master rounded to nearest.

Three precision configs, N parameters each (100 M by default), AdamW (lr 1e-3, betas 0.9/0.999,
eps 1e-8, weight decay 0.01), the same trainer gradient for all:
  f32:          f32 parameters, gradients, master and moments on both sides;
  bf16:         a bf16 gradient in and a bf16 parameter copy out, f32 master and moments on both
                sides (DeepSpeed's default for a bf16 model);
  bf16-states:  (0.19.8 only) bf16 parameters, gradients, master and moments on both sides:
                DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states (its only way
                to bf16 moments) against zeroshard's bf16_master + optimizer_state "bf16". The
                masters round differently: DeepSpeed to nearest, zeroshard stochastically.
                Also timed there, with no DeepSpeed counterpart: zeroshard's bf16 moments with
                an f32 master (optimizer_state "bf16" alone, "zeroshard f32 master" rows).
What each implementation does per training step, and the bytes per parameter it moves
(f32 / bf16 / bf16-states):
  same-bytes kernel   zeroshard::cpu::same_bytes (zeroshard._core.SameBytes), 64 Ki-element
                      chunks on a oneTBB arena, the streams of zeroshard's update: master, m, v
                      read and written, the gradient read, and the bf16 copy written (bf16,
                      bf16-states): 28 / 28 / 16 B, the memory ceiling of the update.
  DeepSpeed cpu_adam  adam_update() (what DeepSpeedCPUAdam.step() calls) on ZeRO's master, its
                      gradient partition and the moments: 28 / 28 / 14 B (f32, f32, bf16 all).
                      With an f32 master (f32, bf16) it runs on ZeRO's f32 copy of the gradient.
  DeepSpeed           what deepspeed/runtime/zero/stage_1_and_2.py (stages 1-2, offload_optimizer
    ZeRO-Offload      cpu, one rank, loss scale 1, no clipping) does around it, with DeepSpeed's
                      own torch calls, as on a machine without a GPU where all of it is CPU work:
      hand-over       copy_grads_in_partition() at the boundary: the gradient's norm
                      (set_norm_for_param_grad_in_gpu: grad.to(double).norm(2)), the inf/NaN
                      check (update_offload_overflow_tracker_for_param_grad: runtime/utils.py
                      has_inf_or_nan, isfinite of amax and amin) and the copy into the master's
                      gradient partition (async_inplace_copy_grad_to_fp32_buffer_from_gpu: cast
                      to the master's dtype where it differs, then copy_): about 36 / 36 / 26 B,
                      part of it temporaries;
      step            step(): unscale_and_clip_grads returns at once (scale 1, no clipping);
                      adam_update (28 / 28 / 14 B); the copy of the master into the CPU
                      bit16 buffer (param_buffer_of_bit16_for_cpu_offload_groups, pinned with
                      pin_memory: 8 / 6 / 4 B) and from it into the bit16 partition (8 / 4 / 4
                      B): 44 / 38 / 22 B. On a GPU machine the hand-over runs on the GPU (the
                      gradient comes down in the master's dtype: 4 / 4 / 2 B across PCIe) and the
                      second copy is the upload (4 / 2 / 2 B); the first copy stays CPU work.
  zeroshard           a one-rank Engine (self communicator), stage 1, optimizer state on the
                      device tier of a CPU engine (the fused CPU update; an f32 model's master is
                      its parameters), one unit of N parameters:
      hand-over       Engine.grads_ready(unit, [grad]): the copy into the engine's gradient
                      buffer (only its padding is zeroed), the one-rank reduce-scatter (a copy
                      into the shard) and the norm, summed over the shard as it arrives (the
                      CPU tiers take it there): 20 / 10 / 10 B;
      step            Engine.step(): the norm and overflow all-reduce (nothing to do on one
                      rank) and the fused update, which reads the f32 or bf16 gradient and
                      writes the bf16 copy in the same pass: 28 / 28 / 16 B (22 B with the f32
                      master and bf16 moments). "update alone" is StepResult.optimizer_s.
DeepSpeed 0.14.4 (--ds-version 0.14.4, f32 and bf16 configs): its cpu_adam already has the same
five dtype pairs, but its ZeRO has no bf16 master, so there are no bf16 states under ZeRO. Its
hand-over: grad.double().norm(2), the inf/NaN check on grad.float() (isnan | isinf, max), and
dest.copy_(grad.float()): about 50 / 60 B; its step: unscale_and_clip_grads (grad.mul_(1/scale),
run even when the scale is 1: 8 B), adam_update (28 B), and for bf16 the copy of the f32 master
into the bf16 parameters (bit16.copy_(fp32): 6 B): 36 / 42 B. (In f32 the same call copies the
master into the model's f32 partition, 8 B on a machine without a GPU; left out, as it always
was here: on a GPU machine it is the upload.)
Each round runs the implementations once each, in an order that rotates per round, so the
machine's bandwidth drift (+-30 % between runs, docs/DESIGN.md rule 9) hits all alike; ratios are
medians of per-round ratios. Before timing, a small run checks that DeepSpeed and zeroshard
compute the same update (3 steps on the same data; fails beyond the bounds check_same_update()
states).

usage: .venv-torch2/bin/python benchmarks/deepspeed/cpu_adam_bench.py [--n 100000000]
            [--threads 2] [--rounds 21] [--configs f32,bf16,bf16-states] [--keep-build DIR]
            [--ds-version 0.19.8]
(zeroshard must be importable by that Python: its package on PYTHONPATH, or installed there by
bash scripts/python_test.sh. Both DeepSpeed versions were checked with torch 2.15
(.venv-torch2). Any Python whose PyTorch has its C++ headers works: .venv/bin/python's Debian
torch 1.13 needs libtorch-dev for them (on Debian: apt-get install python3-torch libtorch-dev
pybind11-dev), and there the script adds -std=c++17. Also needs a C++ compiler and ninja.
DeepSpeed's own Python package, which needs torch >= 2, is not imported: only its C++ op is
built.)
"""
import argparse
import atexit
import hashlib
import inspect
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

# Versions whose sdist this script has built and checked, with the SHA-256 PyPI serves for it.
PINNED = {"0.14.4": "bb2f404b4a1d06aedd40c64d661f71307c22945d04a42d397ad39bbfeef9c8b8",
          "0.19.8": "9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af"}
DEFAULT_VERSION = "0.19.8"
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
CHECK_N = 100_003  # the correctness check: vector body and scalar tail on both sides
CHECK_STEPS = 3
ALL_CONFIGS = ("f32", "bf16", "bf16-states")


def ds_era(version):
    """Which ZeRO-Offload this script models for a DeepSpeed version: "0.14" (checked with
    0.14.4) or "0.19" (checked with 0.19.8); other versions get the nearer one, unchecked."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        sys.exit(f"cpu_adam_bench: --ds-version {version!r} is not a version number")
    return "0.19" if (major, minor) >= (0, 19) else "0.14"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000_000, help="parameters (default 100 M)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every implementation")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--configs", help="comma list of f32, bf16, bf16-states (default: all that "
                    "the DeepSpeed version has; bf16-states needs 0.19)")
    ap.add_argument("--ds-version", default=DEFAULT_VERSION)
    ap.add_argument("--keep-build", metavar="DIR",
                    help="download and build DeepSpeed here and keep them (reused by later runs)")
    ap.add_argument("--verbose-build", action="store_true", help="show the compiler's output")
    ap.add_argument("--per-round", action="store_true", help="also print every round's times")
    a = ap.parse_args()
    if a.rounds < 7:
        sys.exit("cpu_adam_bench: --rounds must be at least 7 (rule 9)")
    if a.n < 1 or a.threads < 1:
        sys.exit("cpu_adam_bench: --n and --threads must be positive")
    a.era = ds_era(a.ds_version)
    have = ALL_CONFIGS if a.era == "0.19" else ("f32", "bf16")
    if a.configs is None:
        a.configs = list(have)
    else:
        a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
        if not a.configs or any(c not in ALL_CONFIGS for c in a.configs):
            sys.exit("cpu_adam_bench: --configs takes f32, bf16 and/or bf16-states")
        if any(c not in have for c in a.configs):
            sys.exit(f"cpu_adam_bench: DeepSpeed {a.ds_version}'s ZeRO has no bf16 master weights, so no "
                     "bf16 optimizer states (bf16-states needs 0.19)")
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
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import include_paths, load
except ImportError:
    sys.exit("cpu_adam_bench: PyTorch is missing; on Debian: apt-get install python3-torch libtorch-dev")
try:
    import zeroshard as zs
    from zeroshard import _core
except ImportError as e:
    sys.exit(f"cpu_adam_bench: cannot import zeroshard ({e}); build it with `bash scripts/python_test.sh` "
             "and run this script with .venv/bin/python")

F32, BF16 = torch.float32, torch.bfloat16
# Per config: the trainer's parameter and gradient dtype, the master's, the moments'.
SPECS = {"f32": dict(model=F32, master=F32, state=F32),
         "bf16": dict(model=BF16, master=F32, state=F32),
         "bf16-states": dict(model=BF16, master=BF16, state=BF16)}


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
            sys.exit(f"cpu_adam_bench: {name} has no {rel}; this script knows the 0.14-0.19 layout")
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


def torch_load_std():
    """The C++ standard torch's load() passes to the compiler by itself (14 in torch 1.13, 20 in
    torch 2.15), read from its ninja-file writer; 17 if it cannot be read."""
    try:
        text = inspect.getsource(cpp_extension._write_ninja_file_to_build_library)
    except (AttributeError, OSError, TypeError):
        return 17
    stds = [int(s) for s in re.findall(r"-std=c\+\+(\d+)", text)]
    return max(stds) if stds else 17


def build_cpu_adam(src, build_dir, era, verbose):
    """DeepSpeed's cpu_adam op from the extracted sdist, as its CPU builder compiles it."""
    flags = ["-O3", "-g", "-Wno-reorder", "-march=native", "-fopenmp", simd_define()]
    if era == "0.19":
        flags.append("-UC10_USE_GLOG")  # OpBuilder.jit_load() adds it to every op's flags
    if torch_load_std() < 17:
        flags.append("-std=c++17")  # std::is_same_v, class template argument deduction
    if not any(os.path.exists(os.path.join(d, "torch", "extension.h")) for d in include_paths()):
        sys.exit("cpu_adam_bench: PyTorch's C++ headers are missing (torch/extension.h); on Debian: "
                 "apt-get install libtorch-dev pybind11-dev")
    os.makedirs(build_dir, exist_ok=True)
    t0 = time.perf_counter()
    op = load(name="deepspeed_cpu_adam_op", build_directory=build_dir,
              sources=[os.path.join(src, "csrc/adam/cpu_adam.cpp"), os.path.join(src, "csrc/adam/cpu_adam_impl.cpp")],
              extra_include_paths=[os.path.join(src, "csrc/includes")], extra_cflags=flags, verbose=verbose)
    return op, flags, time.perf_counter() - t0


# ---- the implementations ------------------------------------------------------------------------

def timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


class DeepSpeed:
    """DeepSpeed's cpu_adam with ZeRO-Offload's CPU work around it (see the module doc)."""
    next_id = 0

    def __init__(self, op, p0, config, era):
        spec = SPECS[config]
        self.op, self.era, self.low = op, era, spec["model"] != F32
        self.id = DeepSpeed.next_id
        DeepSpeed.next_id += 1
        n = p0.numel()
        # ZeRO's single_partition_of_fp32_groups (f32, or bf16 with bf16_master_weights_and_grads)
        # and its .grad; DeepSpeedCPUAdam's moments (bf16 with fp32_optimizer_states=False).
        self.master = p0.to(spec["master"], copy=True)
        self.grad = torch.zeros(n, dtype=spec["master"])
        self.m = torch.zeros(n, dtype=spec["state"])
        self.v = torch.zeros(n, dtype=spec["state"])
        if era == "0.14":
            self.part = self.master.to(BF16) if self.low else None  # the bit16 partition
        else:
            self.buf = torch.zeros(n, dtype=spec["model"])  # param_buffer_of_bit16_for_cpu_offload_groups
            self.part = p0.to(spec["model"], copy=True)      # the bit16 partition
        self.steps = 0
        h = HYPER
        op.create_adam(self.id, h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], True, self.id == 0)

    def close(self):
        self.op.destroy_adam(self.id)

    def params(self):
        """The model's parameters after the step (the master itself in 0.14.4's f32 config)."""
        return self.master if self.part is None else self.part

    def hand_over(self, g):
        """stage_1_and_2.copy_grads_in_partition() at the accumulation boundary."""
        t = {}
        if self.era == "0.14":
            t["norm"] = timed(lambda: g.double().norm(2))  # set_norm_for_param_grad_in_gpu
            def has_inf_or_nan():                        # update_overflow_tracker_for_param_grad
                x = g.float()
                return x.isnan().logical_or(x.isinf()).float().max()
            t["inf/nan"] = timed(has_inf_or_nan)
            t["copy"] = timed(lambda: self.grad.copy_(g.float()))  # async_inplace_copy_grad_to_fp32_buffer
            return t
        # set_norm_for_param_grad_in_gpu: .to(get_norm_dtype()), double where the device has it.
        t["norm"] = timed(lambda: g.to(torch.double).norm(2))
        # update_offload_overflow_tracker_for_param_grad -> runtime/utils.has_inf_or_nan, used as
        # a bool.
        t["inf/nan"] = timed(lambda: bool(torch.isfinite(g.amax()).logical_and(torch.isfinite(g.amin()))
                                          .logical_not()))
        def copy():  # async_inplace_copy_grad_to_fp32_buffer_from_gpu
            src = g if g.dtype == self.grad.dtype else g.to(self.grad.dtype)
            self.grad.copy_(src)
        t["copy"] = timed(copy)
        return t

    def adam(self):
        h = HYPER
        self.steps += 1
        self.op.adam_update(self.id, self.steps, h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"],
                            True, self.master, self.grad, self.m, self.v)

    def step(self):
        """stage_1_and_2.step() with offload: unscale (scale 1, no clipping), the optimizer, and
        the copy into the bit16 parameters."""
        if self.era == "0.14":
            t = {"unscale": timed(lambda: self.grad.mul_(1.0 / 1.0)), "adam_update": timed(self.adam)}
            if self.low:
                t["copy-out"] = timed(lambda: self.part.copy_(self.master))
            return t
        # 0.19's unscale_and_clip_grads returns before touching the gradient at scale 1 without
        # clipping: nothing to time.
        return {"adam_update": timed(self.adam),
                "copy-out": timed(lambda: self.buf.copy_(self.master)),
                "to-partition": timed(lambda: self.part.copy_(self.buf))}


class Zeroshard:
    """A one-rank engine, stage 1, state on the CPU engine's device tier, one unit. f32_master
    keeps an f32 master in the bf16-states config (bf16 moments only)."""

    def __init__(self, p0, config, f32_master=False):
        spec = SPECS[config]
        kw = dict(stage=1, dtype="bf16" if spec["model"] == BF16 else "f32",
                  optimizer=dict(kind="adamw", **HYPER))
        if spec["state"] == BF16:
            kw["optimizer_state"] = "bf16"
        if spec["master"] == BF16 and not f32_master:
            kw["bf16_master"] = True
        self.e = zs.Engine(zs.Config(**kw), zs.make_self_communicator())
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
        """One state of the shard, widened to f32 (read_shard())."""
        return torch.from_dlpack(self.e.read_shard(self.u, kind))[: self.params().numel()]


class SameBytesPass:
    """The update's streams through zeroshard::cpu::same_bytes, on buffers of its own."""

    def __init__(self, g, config, threads):
        spec = SPECS[config]
        self.k = _core.SameBytes(threads)
        n = g.numel()
        self.p = torch.zeros(n, dtype=spec["master"])
        self.m, self.v = (torch.zeros(n, dtype=spec["state"]) for _ in range(2))
        self.reads = [self.p, self.m, self.v, g]
        self.writes = [self.p, self.m, self.v]
        if spec["model"] != F32:
            self.writes.append(torch.zeros(n, dtype=BF16))  # the bf16 copy-out

    def run(self):
        return {"pass": timed(lambda: self.k.run(self.reads, self.writes))}


# Bytes per parameter (module doc). "~": torch's passes with temporaries, approximate.
def bytes_of(era, config):
    if era == "0.14":
        low = config == "bf16"
        return dict(same=28, ds_adam=28, ds_step=42 if low else 36, ds_hand="~60" if low else "~50",
                    ds_total="~102" if low else "~86", zs_step=28, zs_hand=10 if low else 20,
                    zs_total=38 if low else 48)
    return {"f32": dict(same=28, ds_adam=28, ds_step=44, ds_hand="~36", ds_total="~80",
                        zs_step=28, zs_hand=20, zs_total=48),
            "bf16": dict(same=28, ds_adam=28, ds_step=38, ds_hand="~36", ds_total="~74",
                         zs_step=28, zs_hand=10, zs_total=38),
            "bf16-states": dict(same=16, ds_adam=14, ds_step=22, ds_hand="~26", ds_total="~48",
                                zs_step=16, zs_hand=10, zs_total=26,
                                zsf_step=22, zsf_hand=10, zsf_total=32)}[config]


# ---- correctness --------------------------------------------------------------------------------

def bf16_ulps(a, b):
    """Distance in bf16 units in the last place (same-sign values: the bit patterns' difference)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


def bf16_ulp(x):
    """The bf16 unit in the last place at magnitude x (f32 tensor, x > 0): 2^(exponent - 7)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8)


def ulps_apart(a, b, scale):
    """|a - b| in bf16 ulps of `scale` (per element, float64)."""
    return (a.double() - b.double()).abs() / bf16_ulp(scale.float().clamp_min(2.0 ** -126)).double()


def adam_direction(m, v, step):
    """m_hat / (sqrt(v_hat) + eps), in float64, from stored moments."""
    h = HYPER
    m_hat = m.double() / (1 - h["beta1"] ** step)
    v_hat = v.double() / (1 - h["beta2"] ** step)
    return m_hat / (v_hat.sqrt() + h["eps"])


def check_same_update(op, config, era):
    """CHECK_STEPS (3) steps on the same CHECK_N values, a different gradient each step.

    f32 and bf16 (f32 master and moments): master, m and v within 1e-6 (|p| <= 0.5: a few f32
    ulps; DeepSpeed contracts with FMA and applies the bias corrections in another order); the
    parameters must have moved (by about 3 lr); bf16 copies within 1 ulp of each other, on at
    most 0.1 % of the elements (a master a few ulps apart can round the other way).

    bf16-states (everything bf16; both masters start from the same bf16 values). Distances are
    counted per element in bf16 ulps of M, the largest magnitude the element took in either run
    (no rounding error of either side exceeded one such ulp).
    Moments: both sides compute them from the same bf16 gradient in f32 and round to nearest;
    they part where DeepSpeed's FMA and zeroshard's mul+add (a 1-ulp f32 difference) straddle a
    bf16 rounding midpoint, and a difference then decays by beta: at most 1 ulp more per step,
    3 ulps(M) after 3 steps, on at most 1 % of the elements. (More often than for random values:
    sums of bf16 inputs land on or next to a midpoint, about 2.4 % of them within one f32 ulp of
    it at step 2; about 0.15 % of m parts per step, v much less.)
    Master: DeepSpeed rounds to nearest (error <= 1/2 ulp), zeroshard stochastically (< 1 ulp),
    each step from its own previous value, so the two part by at most 1.5 ulps(M) per step plus
    what their moments' difference moves the update, lr |d(m_hat / (sqrt(v_hat) + eps))|, which
    the check computes from both sides' stored moments after each step (summed over the steps:
    D): |diff| <= 3 x 1.5 + 1/2 (f32 arithmetic, a few f32 ulps) = 5 ulps(M) + D. Many elements
    differ: stochastic rounding goes up about as often as down. zeroshard with an f32 master (its
    bf16 parameters rounded once from it; its moments are the bf16-master engine's, bitwise)
    against DeepSpeed's bf16 master: 3 x 1/2 + 1/2 + 1/2 = 2.5 ulps(M) + D."""
    gen = torch.Generator().manual_seed(17)
    spec = SPECS[config]
    p0 = torch.rand(CHECK_N, generator=gen) - 0.5
    if spec["master"] == BF16:
        p0 = p0.to(BF16).float()  # the bf16 model's parameters: both masters start from them exactly
    grads = [(torch.rand(CHECK_N, generator=gen) * 2 - 1).to(spec["model"]) for _ in range(CHECK_STEPS)]
    ds, ours = DeepSpeed(op, p0, config, era), Zeroshard(p0, config)
    f32m = Zeroshard(p0, config, f32_master=True) if config == "bf16-states" else None
    sides = [ours] + ([f32m] if f32m else [])
    big = {"p": p0.abs(), "m": torch.zeros(CHECK_N), "v": torch.zeros(CHECK_N)}
    drift = torch.zeros(CHECK_N, dtype=torch.float64)  # D: the moments' effect on the updates
    for k, g in enumerate(grads, 1):
        ds.hand_over(g)
        ds.step()
        for z in sides:
            z.hand_over(g)
            z.step()
        zm, zv = ours.state(zs.StateKind.state0), ours.state(zs.StateKind.state1)
        for z in sides:
            big["p"] = torch.maximum(big["p"], z.state(zs.StateKind.master).abs())
        for key, x in (("p", ds.master), ("m", ds.m), ("v", ds.v), ("m", zm), ("v", zv)):
            big[key] = torch.maximum(big[key], x.float().abs())
        drift += HYPER["lr"] * (adam_direction(ds.m, ds.v, k) - adam_direction(zm, zv, k)).abs()
    master = ours.state(zs.StateKind.master)
    moved = (ds.master.float() - p0).abs().max().item()  # fails if neither side did anything
    out = {"moved": moved}
    if spec["master"] == F32:
        out.update({"master": (master - ds.master).abs().max().item(),
                    "m": (ours.state(zs.StateKind.state0) - ds.m).abs().max().item(),
                    "v": (ours.state(zs.StateKind.state1) - ds.v).abs().max().item()})
        ok = moved > 1e-3 and out["master"] <= 1e-6 and out["m"] <= 1e-6 and out["v"] <= 1e-6
        if spec["model"] == BF16:
            # zeroshard's bf16 parameters against DeepSpeed's bit16 copy of its master.
            d = bf16_ulps(ours.params(), ds.params())
            out["bf16 differing"] = int((d > 0).sum())
            out["bf16 max ulps"] = int(d.max())
            ok = ok and out["bf16 max ulps"] <= 1 and out["bf16 differing"] <= CHECK_N // 1000
        else:
            ok = ok and torch.equal(ours.params(), master)  # the f32 model's master is its parameters
            ok = ok and torch.equal(ds.params(), ds.master)
        ds.close()
        return ok, out
    # bf16-states: per-element distances in bf16 ulps(M); the master's bound adds D in ulps(M).
    ok = moved > 1e-3 and (master - p0).abs().max().item() > 1e-3
    for key, kind in (("m", zs.StateKind.state0), ("v", zs.StateKind.state1)):
        d = ulps_apart(ours.state(kind), getattr(ds, key), big[key])
        out[f"{key} max ulps"], out[f"{key} differing"] = d.max().item(), int((d > 0).sum())
        ok = ok and d.max().item() <= CHECK_STEPS and int((d > 0).sum()) <= CHECK_N // 100
    d_ulps = drift / bf16_ulp(big["p"]).double()
    out["D max ulps"] = d_ulps.max().item()
    for name, z, k in (("master", ours, CHECK_STEPS * 1.5 + 0.5),
                       ("f32-master params", f32m, CHECK_STEPS * 0.5 + 0.5 + 0.5)):
        x = z.state(zs.StateKind.master) if z is ours else z.params()
        d = ulps_apart(x, ds.master, big["p"])
        out[f"{name} max ulps"], out[f"{name} differing"] = d.max().item(), int((d > 0).sum())
        out[f"{name} max (ulps - bound)"] = (d - d_ulps - k).max().item()
        ok = ok and bool((d <= k + d_ulps).all())
    ok = ok and torch.equal(ours.params(), master.to(BF16))  # the parameters are the master's bits
    ok = ok and torch.equal(ds.params(), ds.master)        # DeepSpeed's bit16 partition too
    for key, kind in (("m", zs.StateKind.state0), ("v", zs.StateKind.state1)):
        same = torch.equal(f32m.state(kind), ours.state(kind))  # moments do not depend on the master
        out[f"f32-master {key} = bf16-master {key}"] = same
        ok = ok and same
    ds.close()
    return ok, out


# ---- the timed rounds ---------------------------------------------------------------------------

def run_config(op, config, a):
    n = a.n
    spec = SPECS[config]
    gen = torch.Generator().manual_seed(1)
    p0 = torch.rand(n, generator=gen) - 0.5
    if spec["master"] == BF16:
        p0 = p0.to(BF16).float()
    g = (torch.rand(n, generator=gen) * 2 - 1).to(spec["model"])
    ds, ours = DeepSpeed(op, p0, config, a.era), Zeroshard(p0, config)
    ours_f32m = Zeroshard(p0, config, f32_master=True) if config == "bf16-states" else None
    same = SameBytesPass(g, config, a.threads)
    del p0

    def prefixed(prefix, *parts):
        return {f"{prefix} {k}": v for part in parts for k, v in part.items()}

    # One implementation's turn in a round: its hand-over, then its step (each part timed).
    def slot(name):
        if name == "deepspeed":
            return prefixed("ds", ds.hand_over(g), ds.step())
        if name in ("zeroshard", "zeroshard f32 master"):
            z, key = (ours, "zs") if name == "zeroshard" else (ours_f32m, "zsf")
            t = prefixed(key, z.hand_over(g), z.step())
            t[f"{key} update alone"] = z.last.optimizer_s
            return t
        return prefixed("same", same.run())

    names = ["deepspeed", "zeroshard", "same-bytes"] + (["zeroshard f32 master"] if ours_f32m else [])
    for _ in range(2):  # warm-up, untimed: page faults, thread pools, DeepSpeed's first steps
        for k in names:
            slot(k)
    rounds = []
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        t = {}
        for k in order:
            t.update(slot(k))
        rounds.append(t)
    ds.close()
    return rounds


def report(config, rounds, n, era):
    low = config != "f32"
    b = bytes_of(era, config)
    col = lambda k: [t[k] for t in rounds]
    def total(keys):
        return [sum(t[k] for k in keys) for t in rounds]
    ds_hand = ["ds norm", "ds inf/nan", "ds copy"]
    ds_step = [k for k in rounds[0] if k.startswith("ds ") and k not in ds_hand]
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
    f32m = "zsf step" in rounds[0]
    if f32m:
        series.update({"zsf step": col("zsf step"), "zsf hand": col("zsf grads_ready"),
                       "zsf total": total(["zsf grads_ready", "zsf step"]), "zsf update": col("zsf update alone")})
    if era == "0.14":
        step_part = "step: unscale + adam_update" + (" + bf16 copy" if low else "")
        adam_part = "adam_update (f32 grad)"
    else:
        step_part = "step: adam_update + copy-out + to-partition"
        adam_part = "adam_update (" + ("all bf16" if config == "bf16-states" else "f32 master, grad, m, v") + ")"
    zs_label = "zeroshard Engine" + (" (bf16 master)" if config == "bf16-states" else "")
    # (label, part, bytes/param (a string where approximate: torch's temporaries), series, the
    # zeroshard series it is compared with)
    rows = [
        ("same-bytes kernel", "one pass", b["same"], "same", None),
        ("DeepSpeed cpu_adam", adam_part, b["ds_adam"], "ds adam", "zs step"),
        ("DeepSpeed ZeRO-Offload", step_part, b["ds_step"], "ds step", "zs step"),
        ("DeepSpeed ZeRO-Offload", "hand-over: norm, inf/NaN, copy in", b["ds_hand"], "ds hand", "zs hand"),
        ("DeepSpeed ZeRO-Offload", "hand-over + step", b["ds_total"], "ds total", "zs total"),
        (zs_label, "step()", b["zs_step"], "zs step", None),
        (zs_label, "update alone (optimizer_s)", b["zs_step"], "zs update", None),
        (zs_label, "hand-over: grads_ready()", b["zs_hand"], "zs hand", None),
        (zs_label, "grads_ready() + step()", b["zs_total"], "zs total", None),
    ]
    if f32m:
        zf = "zeroshard Engine (f32 master, bf16 moments; no DeepSpeed counterpart)"
        rows += [(zf, "step()", b["zsf_step"], "zsf step", None),
                 (zf, "update alone (optimizer_s)", b["zsf_step"], "zsf update", None),
                 (zf, "grads_ready() + step()", b["zsf_total"], "zsf total", None)]
    def ratio(num, den):
        r = [x / y for x, y in zip(series[num], series[den])]
        return f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"
    print(f"\n### config {config}: {n} parameters, {len(rounds)} rounds, medians\n")
    parts = [k for k in rounds[0] if k.startswith("ds ")]
    print("DeepSpeed's parts, median s: " + ", ".join(f"{k[3:]} {statistics.median(col(k)):.4f}" for k in parts))
    if ARGS.per_round:
        keys = ["same", "ds adam", "ds step", "ds hand", "zs step", "zs hand"] + (["zsf step"] if f32m else [])
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
        # Against the ceiling: the passes that move the update's streams, not the hand-overs (and
        # not the f32-master engine's update, whose streams are not the same-bytes pass's).
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
    # One build directory per DeepSpeed and torch version: another torch rebuilds, not reuses.
    build_dir = os.path.join(root, f"build-{a.ds_version}-torch-{torch.__version__}")
    op, flags, build_s = build_cpu_adam(src, build_dir, a.era, a.verbose_build)
    print(f"DeepSpeed {a.ds_version}: {sdist}")
    print(f"  cpu_adam built in {build_s:.0f} s with: {' '.join(flags)} (plus torch's -std=c++{torch_load_std()}; "
          f"in {root}{', kept' if a.keep_build else ', removed at exit'}); ZeRO-Offload modelled as in {a.era}")
    print(f"torch {torch.__version__}; zeroshard {zs.__version__}, kernel ISA "
          f"{_core.SameBytes(1).isa}; {a.threads} threads everywhere")
    most = max(bytes_of(a.era, c)["same"] for c in a.configs)
    if a.n * most < 2_000_000_000:
        print(f"note: {a.n} parameters move {a.n * most / 1e9:.2f} GB per pass; at this size the "
              "caches hold part of the streams and the figures are not the machine's memory ceiling "
              "(use the default 100 M for figures to quote)")

    for config in a.configs:
        ok, d = check_same_update(op, config, a.era)
        text = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())
        print(f"same update check, {config} ({CHECK_STEPS} steps, {CHECK_N} values): "
              f"max |zeroshard - DeepSpeed|: {text}")
        if not ok:
            sys.exit("cpu_adam_bench: the two updates differ beyond the bounds; the comparison would be "
                     "meaningless")
    for config in a.configs:
        report(config, run_config(op, config, a), a.n, a.era)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
