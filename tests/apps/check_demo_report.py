#!/usr/bin/env python3
"""Checks a `zeroshard demo --report-json` summary against numbers computed here, independently
of the engine: every rank's ledger cell (tier x kind) from the GPT's parameter count, the
padding rule and the ZeRO formulas (as tests/multirank/test_memory.cpp does), the data-parallel
reference likewise with stage 0, and that the loss fell. Standard library only.

usage: check_demo_report.py REPORT.json --np N [the demo flags the run used]
"""
import argparse
import json
import math
import sys

TIERS = ("device", "host", "nvme")
KINDS = ("param", "grad", "master", "optim_state", "buffer")
TIER_OF = {"none": "device", "cpu": "host", "nvme": "nvme"}


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("report")
    p.add_argument("--np", type=int, required=True)
    # The demo's documented defaults (zeroshard demo --help); the run's flags override them.
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--offload-optimizer", default="none")
    p.add_argument("--offload-param", default="none")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    args, _ = p.parse_known_args(argv)  # the rest (--lr, --batch, ...) do not change bytes
    return args


def unit_sizes(v, t, c, layers):
    """Elements per unit of the demo GPT: embed, one per block, head."""
    block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    return [v * c + t * c] + [block] * layers + [2 * c + c * v]


def expected_cells(a, sizes, stage, world, topt, tpar_flag):
    """bytes[tier][kind] one rank's ledger must hold after finalize()."""
    align, grad_buffers, live_units = 128, 2, 3  # the library's defaults; the report echoes them
    grain = world * align
    padded = [max(-(-n // grain) * grain, grain) for n in sizes]
    psi, largest = sum(padded), max(padded)
    shard = psi // world
    p = 4 if a.dtype == "f32" else 2
    states = {"adam": 2, "adamw": 2, "lion": 1, "sgd": 1}[a.optimizer]  # demo's SGD has momentum
    tpar = tpar_flag if stage == 3 else "device"
    ext = psi if stage == 0 else shard  # f32 state: whole in stage 0, else this rank's shard
    cells = {t: {k: 0 for k in KINDS} for t in TIERS}
    cells[tpar]["param"] += (shard if stage == 3 else psi) * p
    if stage < 2:
        cells["device"]["grad"] += psi * p  # whole gradients, reduced in place
        cells[topt]["buffer"] += shard * p  # reduce-scatter output
    else:
        cells[topt]["grad"] += shard * p
        # gradient staging: one slot per unit out at once, sized by the largest units
        cells["device"]["buffer"] += sum(sorted(padded, reverse=True)[:grad_buffers]) * p
    if stage == 3:
        cells["device"]["buffer"] += live_units * largest * p  # gather buffers
    if a.accum > 1:
        cells[topt]["buffer"] += ext * 4
    # f32 master weights are the parameters themselves when both sit on one tier.
    if not (a.dtype == "f32" and topt == tpar):
        cells[topt]["master"] += ext * 4
    cells[topt]["optim_state"] += states * ext * 4
    # A GPU with the optimizer on the CPU: reduce-scatter outputs land in GPU slots first, and
    # each unit's updated shard waits in pinned memory for its upload, unless the parameters
    # are off the GPU too: then two GPU slots take each gather's shard on its way up.
    if a.device == "cuda" and topt != "device":
        cells["device"]["buffer"] += grad_buffers * (largest // world) * p
        if tpar == "device":
            cells["host"]["buffer"] += shard * p
        else:
            cells["device"]["buffer"] += 2 * (largest // world) * p
    # Cross-check against the ZeRO paper's closed forms for mixed-precision Adam on one tier.
    if a.dtype != "f32" and states == 2 and topt == tpar == "device" and a.accum == 1:
        model = sum(cells["device"][k] for k in ("param", "grad", "master", "optim_state"))
        closed = {0: 16 * psi, 1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]
        assert model == closed, (stage, model, closed)
    return cells, psi


def main():
    a = parse(sys.argv[1:])
    with open(a.report) as f:
        r = json.load(f)
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    world = a.np
    m, c = r["model"], r["config"]
    check(r["world_size"] == world, f"world_size {r['world_size']} != {world}")
    check((m["layers"], m["dim"], m["seq"]) == (a.layers, a.dim, a.seq), f"model shape {m}")
    check((c["stage"], c["dtype"], c["optimizer"], c["gradient_accumulation_steps"]) ==
          (a.stage, a.dtype, a.optimizer, a.accum), f"config {c}")
    check((c["shard_alignment"], c["grad_buffers"], c["max_live_units"]) == (128, 2, 3),
          "the check assumes the library's default alignment and buffer counts")
    sizes = unit_sizes(m["vocab"], a.seq, a.dim, a.layers)
    check(sum(sizes) == m["params"], f"parameter count {m['params']} != {sum(sizes)}")
    check([u["numel"] for u in r["units"]] == sizes, f"unit sizes {[u['numel'] for u in r['units']]} != {sizes}")

    topt, tpar = TIER_OF[a.offload_optimizer], TIER_OF[a.offload_param]
    want, psi = expected_cells(a, sizes, a.stage, world, topt, tpar)
    mem = r["memory"]
    check(len(mem["ranks"]) == world, "one ledger per rank")
    for rank, got in enumerate(mem["ranks"]):
        for t in TIERS:
            for k in KINDS:
                check(got[t][k] == want[t][k], f"rank {rank} {t}/{k}: report {got[t][k]}, expected {want[t][k]}")
        # Training allocates nothing beyond finalize(): every peak equals the current bytes.
        peak = mem["peak_ranks"][rank]
        for t in TIERS:
            for k in KINDS:
                check(peak[t][k] == got[t][k], f"rank {rank} {t}/{k}: peak {peak[t][k]} != bytes {got[t][k]}")
    dp_want, _ = expected_cells(a, sizes, 0, world, "device", "device")
    for t in TIERS:
        for k in KINDS:
            got = mem["data_parallel"][t][k]
            check(got == dp_want[t][k], f"data parallel {t}/{k}: report {got}, expected {dp_want[t][k]}")

    losses = r["losses"]
    check(len(losses) == a.steps, f"{len(losses)} losses for {a.steps} steps")
    check(all(math.isfinite(x) for x in losses), "finite losses")
    first, last = losses[0], sum(losses[-3:]) / len(losses[-3:])
    check(last < 0.9 * first, f"training loss did not fall: {first:.4f} -> {last:.4f}")
    v = r["validation_loss"]
    check(v["after"] < v["before"] - 0.1, f"validation loss did not fall: {v['before']:.4f} -> {v['after']:.4f}")

    for rank, t in enumerate(r["time"]):
        check(t["steps"] == a.steps - 1, f"rank {rank}: timed steps {t['steps']}")
        check(t["interval_s"] > 0 and t["compute_s"] > 0, f"rank {rank}: timings {t}")
        check(min(t["optimizer_s"], t["comm_exposed_s"], t["comm_busy_s"]) >= 0, f"rank {rank}: timings {t}")
        check(t["compute_s"] + t["optimizer_s"] <= t["interval_s"] * 1.001, f"rank {rank}: parts exceed the interval {t}")
        check(0 <= t["comm_hidden_fraction"] <= 1, f"rank {rank}: hidden fraction {t['comm_hidden_fraction']}")
        check(t["comm_busy_s"] > 0 or world == 1, f"rank {rank}: no communication measured")

    if failures:
        for f in failures:
            print("FAIL:", f)
        print(f"0 passed, {len(failures)} failed")
        return 1
    print(f"demo report OK: {world} ranks, stage {a.stage}, {a.dtype}, Psi(padded) = {psi}, "
          f"loss {first:.3f} -> {last:.3f}, validation {v['before']:.3f} -> {v['after']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
