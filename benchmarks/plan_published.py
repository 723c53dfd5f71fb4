#!/usr/bin/env python3
"""zeroshard's memory planner (zeroshard.estimate, i.e. the engine's own setup run with nothing
allocated) against published large-scale configurations, side by side with the published figures.

  .venv/bin/python benchmarks/plan_published.py

Models are given as units the way the published systems cut them: one unit per layer, or, where
a layer exceeds a GPU (ZeRO-Infinity's memory-centric tiling), per tile of a layer. Every plan is
of one rank of a GPU engine (device="cuda": its staging on the GPU and in pinned host memory
counted, planned on a stand-in GPU, so no GPU is needed); nvme swap files are laid out sparse in
a temporary directory and removed.
"""
import time
from functools import partial

import zeroshard as zs

estimate = partial(zs.estimate, device="cuda")  # the published systems train on GPUs

GB = 1e9


def layers(count, rows, cols, tiles=1):
    """count layers of rows x cols parameters, each cut into `tiles` units."""
    return [(f"layer{i}.tile{t}", [zs.Param("w", shape=[rows, cols // tiles])])
            for i in range(count) for t in range(tiles)]


def row(est, stage, opt, par="device"):
    return next(r for r in est.rows
                if r["stage"] == stage and r["optimizer"] == opt and r["params"] == par)


def show(title, est, picks, published):
    print(f"\n### {title}\n")
    print(f"{est.parameters / 1e9:.1f} G parameters, {est.world} ranks\n")
    print("| stage | optimizer | parameters | model states GB | device GB | host GB | nvme GB | "
          "fits | published |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (stage, opt, par), pub in zip(picks, published):
        r = row(est, stage, opt, par)
        fits = {None: "-", True: "yes"}.get(r["fits"], f"no ({r['fits']})")
        print(f"| {stage} | {opt} | {par} | {r['model_states'] / GB:.2f} | {r['device'] / GB:.2f} "
              f"| {r['host'] / GB:.2f} | {r['nvme'] / GB:.1f} | {fits} | {pub} |")


def main():
    t0 = time.time()
    # ZeRO (Rajbhandari et al. 2020), Table 1: 7.5 B parameters, mixed-precision Adam, 64 GPUs.
    zero = estimate(layers(75, 10000, 10000), world=64, ranks_per_node=16, dtype="f16",
                       optimizer="adam")
    show("ZeRO, 7.5 B parameters on 64 GPUs (model states per GPU)", zero,
         [(0, "device", "device"), (1, "device", "device"), (2, "device", "device"),
          (3, "device", "device")],
         ["120 GB (baseline)", "31.4 GB (P_os)", "16.6 GB (P_os+g)", "1.9 GB (P_os+g+p)"])
    # ZeRO-Offload (Ren et al. 2021): 13 B parameters on one 32 GB V100, optimizer on the CPU.
    off = estimate(layers(100, 10000, 13000), world=1, dtype="f16", optimizer="adam",
                      device_gib=32 / 1.073741824)
    show("ZeRO-Offload, 13 B parameters on one 32 GB V100", off,
         [(2, "device", "device"), (2, "host", "device")],
         ["does not fit", "fits (13 B is the largest it trains)"])
    # ZeRO-Infinity (Rajbhandari et al. 2021): 1 T parameters (128 layers, hidden 25600, 12 h^2
    # each, tiled) on one DGX-2 node: 16 x 32 GB V100, 1.5 TB host memory, 30.72 TB of NVMe
    # (8 x 3.84 TB), all shared by 16 ranks.
    dgx2 = dict(ranks_per_node=16, dtype="f16", optimizer="adam", device_gib=32 / 1.073741824,
                host_gib=1500 / 16 / 1.073741824, nvme_gib=30720 / 16 / 1.073741824)
    h = 25600
    inf = estimate(layers(128, h, 12 * h, tiles=8), world=16, **dgx2)
    show("ZeRO-Infinity, 1 T parameters on one DGX-2 (16 x 32 GB, 1.5 TB host)", inf,
         [(3, "host", "host"), (3, "nvme", "nvme")],
         ["does not fit in host memory", "fits (offload to NVMe)"])
    # ZeRO-Infinity: 32 T parameters on 512 V100s (32 DGX-2 nodes): 128 layers of hidden 144 K.
    h = 147456
    big = estimate(layers(128, h, 12 * h, tiles=256), world=512, **dgx2)
    show("ZeRO-Infinity, 32 T parameters on 512 V100s", big, [(3, "nvme", "nvme")],
         ["fits (offload to NVMe)"])
    # A current model: Llama-2-70B's shapes (80 layers of width 8192: q and o 8192 x 8192, k
    # and v 8192 x 1024 (grouped-query attention), an MLP of 3 x 8192 x 28672; embedding and
    # head 32000 x 8192), bf16, AdamW, on 8 x 80 GB: FSDP's full sharding and its CPU offload.
    llama = layers(80, 8192, 2 * 8192 + 2 * 1024 + 3 * 28672)
    llama += [("embed", [zs.Param("w", shape=[32000, 8192])]),
              ("head", [zs.Param("w", shape=[32000, 8192])])]
    llama = estimate(llama, world=8, ranks_per_node=8, dtype="bf16", optimizer="adamw",
                        device_gib=80 / 1.073741824)
    show("Llama-2-70B on 8 x 80 GB (FSDP full shard = stage 3)", llama,
         [(3, "device", "device"), (3, "host", "device")],
         ["(no published figure) 16 B/param / 8 = 138 GB per GPU", "(no published figure)"])
    print(f"\nplanned in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
