#!/usr/bin/env bash
# The demo trainer on one GPU at stage 0 and stage 3 (bf16, AdamW, everything on the device):
# tokens/s over the timed steps, and the engine's ledger of model states against ZeRO's formulas
# for one rank (bf16 parameters 2Ψ, bf16 gradients 2Ψ, f32 master 4Ψ, two f32 moments 8Ψ; Ψ the
# padded parameter count, so the ledger must equal them to the byte). Writes one line per stage to
# $OUT/demo_throughput.txt (or --out FILE).
#
#   bash benchmarks/gpu/demo_throughput.sh ZEROSHARD_BIN [--out FILE] [--layers N --dim N --heads N]
set -uo pipefail
bin="${1:?usage: $0 ZEROSHARD_BIN [--out FILE] [--layers N] [--dim N] [--heads N]}"
shift
out="${OUT:-.}/demo_throughput.txt"
layers=12
dim=1024
heads=16
while (($#)); do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --dim) dim="$2"; shift 2 ;;
    --heads) heads="$2"; shift 2 ;;
    *) echo "demo_throughput: unknown argument $1" >&2; exit 2 ;;
  esac
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "demo_throughput: $(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)," \
     "one rank, bf16, AdamW, layers $layers dim $dim heads $heads, seq 256, batch 16, 30 steps" | tee "$out"
status=0
for stage in 0 3; do
  "$bin" demo --device cuda --stage "$stage" --dtype bf16 --layers "$layers" --dim "$dim" \
    --heads "$heads" --seq 256 --batch 16 --steps 30 --warmup 3 --sample 0 --quiet \
    --no-dp-reference --report-json "$work/r$stage.json" >"$work/log$stage.txt" 2>&1 || {
    echo "stage $stage: failed: $(tail -3 "$work/log$stage.txt")" | tee -a "$out"
    status=1
    continue
  }
  python3 - "$work/r$stage.json" "$stage" <<'EOF' | tee -a "$out" || status=1
import json, math, sys
r, stage = json.load(open(sys.argv[1])), int(sys.argv[2])
steps = r["steps"]
assert all(math.isfinite(s["loss"]) for s in steps), "a loss is not finite"
# Tokens/s over every step, the first (first gathers, allocator warm-up) included.
n = len(steps)
tps = r["tokens_per_step"] * n / r["train_wall_s"]
psi = sum(u["padded_numel"] for u in r["units"])
dev = r["memory"]["ranks"][0]["device"]
want = {"param": 2 * psi, "grad": 2 * psi, "master": 4 * psi, "optim_state": 8 * psi}
rows = ", ".join(f"{k} {dev[k] / 2**20:.1f} MiB (formula {v / 2**20:.1f})" for k, v in want.items())
ok = all(dev[k] == v for k, v in want.items())
print(f"stage {stage}: {r['model']['params'] / 1e6:.1f} M parameters, {tps:,.0f} tokens/s over {n} steps "
      f"({r['train_wall_s'] / n * 1e3:.1f} ms/step), loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}; "
      f"device ledger: {rows}, buffers {dev['buffer'] / 2**20:.1f} MiB; ledger == ZeRO formulas: {ok}")
sys.exit(0 if ok else 1)
EOF
done
exit $status
