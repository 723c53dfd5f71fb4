"""The largest model that trains under given budgets, found by really training it.

    python -m zeroshard.capacity --memory-gib 4 --nvme-path /mnt/nvme --nvme-gib 50 --out cap/
    zeroshard capacity ...           (the same, from the command-line tool)

For every ZeRO stage and offload choice asked for, the planner (zeroshard.plan_memory(), the
engine's own setup with nothing allocated) first finds the largest model whose ledger fits the
budgets; then engines are really built, finalized and stepped at sizes around that answer until
the largest size that trains within the budgets is bracketed to --resolution: an engine fits when
it finalizes and takes --steps steps without an error (a disk too small fails when its swap files
are reserved) and the peaks of its ledger stay within --memory-gib (device and host columns; on a
CPU machine both are this machine's memory) and --nvme-gib. The model is --units equal units of
one parameter each, so the size is continuous. A progress bar on stderr shows each trial.

It writes to --out: report.json (every trial: size, fits and why not, ledger per tier, planned
bytes, measured and predicted step time), report.md (one row per configuration), and three plots
drawn with matplotlib: bytes per tier against model size per configuration
(bytes_per_tier.svg), predicted against measured step time (step_time.svg, with --calibration,
a file `zeroshard calibrate` wrote), and the largest model per configuration
(largest_model.svg).
"""
import argparse
import json
import math
import os
import sys
import time

from . import _core

_GIB = float(1 << 30)
_TIERS = {"device": _core.Tier.device, "host": _core.Tier.host, "nvme": _core.Tier.nvme}
_DS = {"device": "none", "host": "cpu", "nvme": "nvme"}  # DeepSpeed's device names


def _parse(argv):
    p = argparse.ArgumentParser(prog="zeroshard capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-gib", type=float, required=True,
                   help="engine memory allowed (ledger peaks, device + host), GiB")
    p.add_argument("--nvme-gib", type=float, default=0.0,
                   help="nvme tier allowed (ledger), GiB; 0: no nvme configurations")
    p.add_argument("--nvme-path", default="", help="directory of the nvme tier's swap files")
    p.add_argument("--configs", default="",
                   help="stage:optimizer:params,... (tiers device|host|nvme), default: every "
                        "stage on the device tier, and stage 3 with host and nvme offload")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--optimizer-state", default="f32", choices=["f32", "bf16", "8bit"])
    p.add_argument("--master", default="f32", choices=["f32", "bf16"])
    p.add_argument("--units", type=int, default=16, help="equal units the model is cut into")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps a trial must take")
    p.add_argument("--resolution", type=float, default=0.02,
                   help="relative bracket of the answer (largest fitting / smallest failing)")
    p.add_argument("--calibration", default="", help="a calibration file, for predicted steps")
    p.add_argument("--out", default="capacity", help="directory for the report and plots")
    a = p.parse_args(argv)
    if a.memory_gib <= 0 or a.units < 1 or a.steps < 1 or not 0 < a.resolution < 1:
        p.error("--memory-gib, --units, --steps must be positive and --resolution in (0, 1)")
    if a.nvme_gib > 0 and not a.nvme_path:
        p.error("--nvme-gib needs --nvme-path")
    avail = _available_memory()
    if avail is not None and a.memory_gib * _GIB > 0.9 * avail:
        p.error(f"--memory-gib {a.memory_gib} is more than 90 % of the {avail / _GIB:.1f} GiB "
                f"this machine has available: the trials would swap or be killed")
    return a


def _available_memory():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _configs(a):
    if a.configs:
        out = []
        for c in a.configs.split(","):
            stage, opt, par = c.split(":")
            if opt not in _TIERS or par not in _TIERS:
                raise SystemExit(f"zeroshard capacity: bad configuration {c!r}")
            out.append((int(stage), opt, par))
    else:
        out = [(s, "device", "device") for s in range(4)] + [(3, "host", "host")]
        if a.nvme_gib > 0:
            out += [(3, "nvme", "device"), (3, "nvme", "nvme")]
    if any(t == "nvme" for _, o, p in out for t in (o, p)) and not a.nvme_gib > 0:
        raise SystemExit("zeroshard capacity: an nvme configuration needs --nvme-path and --nvme-gib")
    return out


def _config(a, stage, opt, par):
    off = lambda t: {"device": _DS[t], "nvme_path": a.nvme_path} if t == "nvme" else {"device": _DS[t]}
    return _core.Config(stage=stage, dtype=a.dtype, optimizer_state=a.optimizer_state,
                        bf16_master=a.master == "bf16", offload_optimizer=off(opt),
                        offload_param=off(par), gradient_clipping=1.0)


def _units(a, params):
    per = max(1, params // a.units)
    return [(f"layer{i}", [_core.Param("w", shape=[per])]) for i in range(a.units)]


def _tiers(report, peak):
    d = report.as_dict()
    return {t: sum(c["peak" if peak else "bytes"] for c in d[t].values()) for t in _TIERS}


def _within(a, tiers):
    if tiers["device"] + tiers["host"] > a.memory_gib * _GIB:
        return "memory"
    if tiers["nvme"] > a.nvme_gib * _GIB:
        return "nvme"
    return None


def _planned_largest(a, cfg):
    """The largest size (a multiple of --units) whose planned ledger fits, by bisection."""
    fits = lambda n: _within(a, _tiers(_core.plan_memory(cfg, _units(a, n), world=1), False)) is None
    lo, hi = 0, a.units
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 50:
            raise SystemExit("zeroshard capacity: the budgets fit more than 2^50 parameters")
    while hi - lo > max(a.units, int(lo * a.resolution / 4)):
        mid = (lo + hi) // 2 // a.units * a.units
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _trial(a, cfg, params, comm):
    """Builds, finalizes and steps an engine of `params` parameters: a dict of what happened."""
    units = _units(a, params)
    t = {"params": sum(p.shape[0] for _, ps in units for p in ps),
         "planned": _tiers(_core.plan_memory(cfg, units, world=1), False)}
    e = None
    try:
        import torch
        e = _core.Engine(cfg, comm)
        ids = [e.add_unit(n, ps) for n, ps in units]
        e.finalize()
        t["ledger"] = _tiers(e.memory(), False)
        times = []
        for s in range(a.steps):
            t0 = time.perf_counter()
            for u in reversed(ids):
                if cfg.stage == 3:
                    e.gather(u)
                    e.release(u)
                for g in e.grads(u):
                    torch.from_dlpack(g).fill_(1e-3)
                e.grads_ready(u)
            e.step()
            times.append(time.perf_counter() - t0)
        t["step_s"] = sorted(times)[len(times) // 2]
        t["peak"] = _tiers(e.memory(), True)
        t["why_not"] = _within(a, t["peak"])
    except _core.Error as err:  # a full disk, an allocation refused, ...
        t["why_not"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        del e  # its memory and swap files go before the next trial
    t["fits"] = t["why_not"] is None
    if a.calibration and t["fits"]:
        rows = _core.plan_choices(cfg, units, 1, calibration=a.calibration)
        key = (cfg.stage, cfg.offload_optimizer.tier.name, cfg.offload_param.tier.name)
        row = next((r for r in rows if (r["stage"], r["optimizer"], r["params"]) == key), None)
        t["predicted_s"] = row["step"]["total_s"] if row and row["step"] else None
    return t


class _Progress:
    """One line per configuration on stderr, redrawn after every trial."""

    def __init__(self, name, total):
        self.name, self.total, self.done = name, total, 0

    def show(self, text, final=False):
        width = 20
        filled = min(width, int(width * self.done / max(1, self.total)))
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r{self.name:<24} [{bar}] {text:<60}" + ("\n" if final else ""))
        sys.stderr.flush()


def _search(a, stage, opt, par, comm):
    cfg = _config(a, stage, opt, par)
    name = f"stage {stage} opt {opt} par {par}"
    planned = _planned_largest(a, cfg)
    # Expected trials: the planned size and its neighbour, then a bisection if they disagree.
    prog = _Progress(name, 2 + math.ceil(math.log2(1 / a.resolution)))
    trials = []

    def run(n):
        prog.show(f"trial {len(trials) + 1}: {n / 1e6:.1f} M parameters ...")
        t = _trial(a, cfg, n, comm)
        trials.append(t)
        prog.done += 1
        prog.show(f"trial {len(trials)}: {t['params'] / 1e6:.1f} M "
                  + ("fits" if t["fits"] else f"does not fit ({t['why_not'][:40]})"))
        return t["fits"]

    # Bracket the answer (lo trains, hi does not; lo 0 while nothing has), stepping out from the
    # planner's size by the resolution, then bisect the bracket down to it.
    step = 1 + a.resolution
    lo, hi, n = 0, None, max(a.units, planned)
    while hi is None or (lo == 0 and hi > a.units):
        if run(n):
            lo = n
        else:
            hi = n
        n = int(lo * step) + a.units if hi is None else max(a.units, int(hi / step))
    while lo and hi / lo > step:
        mid = int(math.sqrt(lo * hi))
        if run(mid):
            lo = mid
        else:
            hi = mid
    largest = max((t for t in trials if t["fits"]), key=lambda t: t["params"], default=None)
    prog.done = prog.total
    prog.show(f"largest {largest['params'] / 1e6:.1f} M parameters (planned {planned / 1e6:.1f} M)"
              if largest else "nothing fits", final=True)
    # Bytes per tier against size, from the planner (the ledger is checked equal at every trial).
    sizes = sorted({max(a.units, int(planned * f)) for f in (0.1, 0.25, 0.5, 0.75, 1.0, 1.25)})
    curve = [{"params": n, **_tiers(_core.plan_memory(cfg, _units(a, n), world=1), False)}
             for n in sizes]
    return {"stage": stage, "optimizer": opt, "params_tier": par, "planned_largest": planned,
            "largest": largest["params"] if largest else 0, "trials": trials, "curve": curve}


def _plots(out, results, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("zeroshard capacity: the plots need matplotlib (scripts/setup.sh "
                         "installs python3-matplotlib; or pip install matplotlib)")
    label = lambda r: f"s{r['stage']} {r['optimizer']}/{r['params_tier']}"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharex=False)
    for ax, tier in zip(axes, _TIERS):
        for r in results:
            xs = [c["params"] / 1e6 for c in r["curve"]]
            ax.plot(xs, [c[tier] / _GIB for c in r["curve"]], marker="o", label=label(r))
        ax.set_title(f"{tier} tier")
        ax.set_xlabel("model (M parameters)")
        ax.set_ylabel("GiB per rank (ledger)")
    axes[0].axhline(a.memory_gib, color="k", linestyle="--", label="memory budget")
    if a.nvme_gib > 0:
        axes[2].axhline(a.nvme_gib, color="k", linestyle="--", label="nvme budget")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bytes_per_tier.svg"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 5))
    pts = [(t["step_s"], t["predicted_s"], label(r)) for r in results for t in r["trials"]
           if t["fits"] and t.get("predicted_s")]
    for r in results:
        mine = [(m, p) for m, p, lab in pts if lab == label(r)]
        if mine:
            ax.scatter([m for m, _ in mine], [p for _, p in mine], label=label(r))
    top = max([max(m, p) for m, p, _ in pts], default=1.0) * 1.1
    ax.plot([0, top], [0, top], "k--", linewidth=0.8, label="predicted = measured")
    ax.set_xlabel("measured step (s)")
    ax.set_ylabel("predicted step (s)")
    ax.set_title("step time" + ("" if pts else " (no --calibration: nothing predicted)"))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "step_time.svg"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh([label(r) for r in results], [r["largest"] / 1e6 for r in results])
    ax.set_xlabel("largest model trained (M parameters)")
    ax.set_title(f"{a.memory_gib:g} GiB memory" + (f", {a.nvme_gib:g} GiB nvme" if a.nvme_gib else ""))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "largest_model.svg"))
    plt.close(fig)


def _markdown(results, a):
    lines = [f"Budgets: {a.memory_gib:g} GiB memory, {a.nvme_gib:g} GiB nvme; {a.dtype}, "
             f"{a.optimizer_state} moments, {a.master} master, {a.units} units, {a.steps} steps.",
             "", "| stage | optimizer | params | largest model | planned | trials | step s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        best = next((t for t in r["trials"] if t["fits"] and t["params"] == r["largest"]), None)
        lines.append(f"| {r['stage']} | {r['optimizer']} | {r['params_tier']} | "
                     f"{r['largest'] / 1e6:.1f} M | {r['planned_largest'] / 1e6:.1f} M | "
                     f"{len(r['trials'])} | {best['step_s']:.3f} |" if best else
                     f"| {r['stage']} | {r['optimizer']} | {r['params_tier']} | none | "
                     f"{r['planned_largest'] / 1e6:.1f} M | {len(r['trials'])} | - |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    a = _parse(sys.argv[1:] if argv is None else argv)
    comm = _core.make_self_communicator()
    results = [_search(a, *c, comm) for c in _configs(a)]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump({"budgets": {"memory_gib": a.memory_gib, "nvme_gib": a.nvme_gib},
                   "dtype": a.dtype, "optimizer_state": a.optimizer_state, "master": a.master,
                   "units": a.units, "steps": a.steps, "results": results}, f, indent=1)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(_markdown(results, a))
    _plots(a.out, results, a)
    sys.stdout.write(_markdown(results, a))
    print(f"report, plots: {a.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
