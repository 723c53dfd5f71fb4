#!/usr/bin/env bash
# The largest model the demo trainer trains on one GPU with its optimizer state offloaded to the
# host tier and to the nvme tier, and with the parameter shards offloaded too (a tier "OPT:PARAM"
# passes --offload-param PARAM): for each tier, GPT sizes in increasing order, each trained for
# a few steps at stage 3 in bf16 (`zeroshard demo --device cuda`), until one fails or runs out of
# time. A size counts only if it trained every step with a finite loss. Writes one line per
# attempt and a summary to $OUT/demo_capacity.txt (or the file given with --out).
#
#   bash benchmarks/gpu/demo_capacity.sh ZEROSHARD_BIN [--out FILE] [--nvme-dir DIR]
#                                        [--timeout SECONDS] [--tiers "cpu nvme cpu:cpu"]
#                                        [--sizes "L:D:H ..."]   (layers:dim:heads, ascending)
#
# What bounds each tier (the demo prints its ledger): host offload keeps about 16 bytes per
# parameter in pinned host memory (master, two moments, gradient shard, upload buffer) and nvme
# offload 2 x 12 bytes per parameter on disk (double-buffered records) plus 2 for gradients; the
# GPU itself holds the bf16 parameters (2 bytes per parameter) and a few units of buffers, or,
# with the parameters offloaded, only the buffers (the parameters' 2 bytes go to host or disk).
set -uo pipefail
bin="${1:?usage: $0 ZEROSHARD_BIN [--out FILE] [--nvme-dir DIR] [--timeout S] [--tiers LIST]}"
shift
out="${OUT:-.}/demo_capacity.txt"
nvme_dir="${TMPDIR:-/tmp}"
limit=600
tiers="cpu nvme cpu:cpu"
# layers:dim:heads, about 12·layers·dim² parameters: 0.4, 1.2, 2.3, 4.8, 9.7 billion.
sizes=("8:2048:16" "24:2048:16" "24:2816:22" "24:4096:32" "48:4096:32")
while (($#)); do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --nvme-dir) nvme_dir="$2"; shift 2 ;;
    --timeout) limit="$2"; shift 2 ;;
    --tiers) tiers="$2"; shift 2 ;;
    --sizes) read -r -a sizes <<<"$2"; shift 2 ;;
    *) echo "demo_capacity: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$bin" ]] || { echo "demo_capacity: $bin is not an executable" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
{
  echo "demo_capacity: $(date -u +%FT%TZ), one GPU, stage 3, bf16, 3 steps of batch 4 x 64 tokens, peak lr 1e-4"
  echo "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi: n/a')"
  echo "host memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)," \
       "nvme dir $nvme_dir: $(df -h --output=avail "$nvme_dir" 2>/dev/null | tail -1 | tr -d ' ') free"
} | tee "$out"

for tier in $tiers; do
  IFS=: read -r opt par <<<"$tier"
  best="none"
  for size in "${sizes[@]}"; do
    IFS=: read -r layers dim heads <<<"$size"
    flags=(--device cuda --stage 3 --dtype bf16 --offload-optimizer "$opt" --layers "$layers"
           --dim "$dim" --heads "$heads" --seq 64 --batch 4 --steps 3 --warmup 1 --lr 1e-4 --sample 0
           --corpus-chars 200000 --no-dp-reference --quiet --report-json "$work/report.json")
    [[ -n "$par" ]] && flags+=(--offload-param "$par")
    [[ "$opt" == nvme || "$par" == nvme ]] && flags+=(--nvme-path "$nvme_dir")
    rm -f "$work/report.json"
    start=$SECONDS
    timeout "$limit" "$bin" demo "${flags[@]}" >"$work/log.txt" 2>&1
    rc=$?
    took=$((SECONDS - start))
    # Parameters, step time and final loss from the report; "failed" unless all are there.
    line="$(python3 - "$work/report.json" <<'EOF' 2>/dev/null
import json, math, sys
r = json.load(open(sys.argv[1]))
steps = r["steps"]
loss = steps[-1]["loss"]
assert len(steps) == 3 and math.isfinite(loss) and not any(s["skipped"] for s in steps)
print(f'{r["model"]["params"] / 1e9:.2f}B params, loss {steps[0]["loss"]:.3f} -> {loss:.3f}, '
      f'{r["train_wall_s"] / 3:.1f} s/step')
EOF
)"
    if ((rc == 0)) && [[ -n "$line" ]]; then
      echo "  $tier  layers $layers dim $dim: trained ($line) in ${took} s" | tee -a "$out"
      best="layers $layers dim $dim: $line"
    else
      why="$(grep -m1 -iE 'error|no_space|out of|killed' "$work/log.txt" || tail -1 "$work/log.txt")"
      ((rc == 124)) && why="over the ${limit} s limit"
      echo "  $tier  layers $layers dim $dim: failed after ${took} s (exit $rc): $why" | tee -a "$out"
      break
    fi
  done
  echo "largest with --offload-optimizer $opt${par:+ --offload-param $par}: $best" | tee -a "$out"
done
