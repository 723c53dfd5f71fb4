#!/usr/bin/env python3
"""Draws docs/images/memory_by_stage.png, the README's picture: the bytes one rank holds for a
6.7 B-parameter GPT (32 blocks of width 4096, a 32000-token vocabulary, an untied head; bf16,
AdamW) on 8 GPU ranks, for every ZeRO stage and optimizer tier, split by where they live.

The figures are zeroshard.estimate()'s, that is the engine's own ledger with nothing allocated
(the same numbers `zeroshard plan` prints). Activations and the trainer's own memory come on top.

Usage: .venv/bin/python scripts/plot_memory_by_stage.py [OUT.png]
(an interpreter that imports zeroshard and matplotlib: bash scripts/python_test.sh makes .venv)
"""

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import zeroshard  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GIB = float(1 << 30)


def gpt_units(layers=32, dim=4096, vocab=32000, seq=4096):
    """The units a trainer would register: embeddings, one per block, the final norm and head."""
    P = zeroshard.Param
    units = [("embed", [P("tok", shape=[vocab, dim]), P("pos", shape=[seq, dim])])]
    for i in range(layers):
        units.append((f"block{i}", [
            P("ln1.w", shape=[dim]), P("ln1.b", shape=[dim]),
            P("qkv.w", shape=[dim, 3 * dim]), P("qkv.b", shape=[3 * dim]),
            P("proj.w", shape=[dim, dim]), P("proj.b", shape=[dim]),
            P("ln2.w", shape=[dim]), P("ln2.b", shape=[dim]),
            P("fc1.w", shape=[dim, 4 * dim]), P("fc1.b", shape=[4 * dim]),
            P("fc2.w", shape=[4 * dim, dim]), P("fc2.b", shape=[dim])]))
    units.append(("head", [P("ln.w", shape=[dim]), P("ln.b", shape=[dim]),
                           P("out.w", shape=[dim, vocab])]))
    return units


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "images",
                                                             "memory_by_stage.png")
    est = zeroshard.estimate(gpt_units(), world=8, ranks_per_node=8, dtype="bf16", device="cuda")
    # One bar per (stage, optimizer tier) with the parameters on the device.
    rows = [r for r in est.rows if r["params"] == "device"]
    labels = [f"stage {r['stage']}\n{ {'device': 'on device', 'host': 'host', 'nvme': 'nvme'}[r['optimizer']] }"
              for r in rows]
    tiers = [("device", "#3b6ea8", "device (GPU) memory"), ("host", "#e0a030", "host memory"),
             ("nvme", "#7a9a50", "NVMe swap files")]
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    bottom = [0.0] * len(rows)
    for key, color, name in tiers:
        vals = [r[key] / GIB for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, color=color, label=name, width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        ax.text(i, total + 1, f"{rows[i]['device'] / GIB:.0f}", ha="center", fontsize=8,
                color="#3b6ea8")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("GiB per rank")
    ax.set_title(f"{est.parameters / 1e9:.1f} G-parameter GPT, bf16, AdamW, 8 ranks: bytes per rank "
                 "(device GiB above each bar)", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out)
    print(f"plot_memory_by_stage: wrote {out}")
    for r, label in zip(rows, labels):
        print(f"  {label.replace(chr(10), ' '):<18} device {r['device'] / GIB:7.2f}  host "
              f"{r['host'] / GIB:7.2f}  nvme {r['nvme'] / GIB:7.2f} GiB")


if __name__ == "__main__":
    main()
