#!/usr/bin/env bash
# Training quality of the optimizer-state formats: the demo trainer with f32, bf16 and 8-bit
# moments, the same seeds and steps, and its final validation loss for each; then each
# format's mean against f32's. FORMATS (default "f32 bf16 8bit", f32 first) may name a bf16
# master after a '/', e.g. FORMATS="f32 8bit/bf16".
#   [FORMATS=...] benchmarks/state_format_quality.sh BUILD_DIR [STEPS] [SEEDS...]
set -euo pipefail
build=${1:?usage: state_format_quality.sh BUILD_DIR [STEPS] [SEEDS...]}
steps=${2:-300}
shift $(( $# >= 2 ? 2 : 1 ))
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(1 2 3)
read -r -a formats <<<"${FORMATS:-f32 bf16 8bit}"
[ "${formats[0]}" = f32 ] || { echo "FORMATS must start with f32 (the reference)" >&2; exit 1; }
declare -A sum
echo "| moments | seed | validation loss after $steps steps |"
echo "|---|---|---|"
for fmt in "${formats[@]}"; do
  sum[$fmt]=0
  master=f32
  [[ $fmt == */* ]] && master=${fmt#*/}
  for seed in "${seeds[@]}"; do
    out=$("$build/apps/zeroshard" demo --stage 0 --steps "$steps" --seed "$seed" \
      --optimizer-state "${fmt%%/*}" --master "$master")
    loss=$(printf "%s\n" "$out" | sed -n "s/.*validation loss [0-9.]* -> \([0-9.]*\).*/\1/p" | tail -1)
    [ -n "$loss" ] || { printf '%s\n' "$out" | tail -5 >&2; echo "no validation loss in the demo's output" >&2; exit 1; }
    echo "| $fmt | $seed | $loss |"
    sum[$fmt]=$(python3 -c "print(${sum[$fmt]} + $loss)")
  done
done
n=${#seeds[@]}
for fmt in "${formats[@]:1}"; do
  python3 -c "f=${sum[f32]}/$n; g=${sum[$fmt]}/$n; print(f'$fmt: mean {g:.4f} against f32 {f:.4f}: {100*(g-f)/f:+.2f} %')"
done
