#!/usr/bin/env bash
# Checkpoint size, save and load time per optimizer-state format, the same model (SIZE / 12
# parameters) back to back in one run, rounds alternating the formats. ckpt_bench drops the
# page cache before each load (root). Prints each round and the median of each format's times
# as a ratio of f32's.
#
#   benchmarks/io/ckpt_formats.sh BUILD_DIR DIR [SIZE=2G] [ROUNDS=3]
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR DIR [SIZE] [ROUNDS]}
dir=${2:?usage: $0 BUILD_DIR DIR [SIZE] [ROUNDS]}
size=${3:-2G}
rounds=${4:-3}
bench="$build/benchmarks/io/ckpt_bench"
[[ -x "$bench" ]] || { echo "$bench not built (-DZEROSHARD_BUILD_BENCHMARKS=ON)" >&2; exit 1; }
mkdir -p "$dir"
formats=(f32 bf16 8bit)
echo "ckpt_bench --size $size in $dir, $rounds rounds; load average $(cut -d' ' -f1 /proc/loadavg)"
printf "%-6s %-5s %10s %10s %10s\n" round state file_MB save_s load_s
declare -A saves loads mb
for ((r = 1; r <= rounds; ++r)); do
  for f in "${formats[@]}"; do
    sync
    out=$("$bench" --dir "$dir" --size "$size" --rounds 1 --state "$f")
    read -r s l m < <(awk '$1=="1"{print $2, $4, $6}' <<<"$out")
    saves[$f]+="$s " loads[$f]+="$l " mb[$f]=$m
    printf "%-6s %-5s %10s %10s %10s\n" "$r" "$f" "$m" "$s" "$l"
  done
done
python3 - "${saves[f32]}" "${loads[f32]}" "${mb[f32]}" \
  "${saves[bf16]}" "${loads[bf16]}" "${mb[bf16]}" "${saves[8bit]}" "${loads[8bit]}" "${mb[8bit]}" <<'PY'
import statistics as st, sys
a = sys.argv[1:]
rows = {f: ([float(x) for x in a[3*i].split()], [float(x) for x in a[3*i+1].split()], float(a[3*i+2]))
        for i, f in enumerate(["f32", "bf16", "8bit"])}
s0, l0, m0 = st.median(rows["f32"][0]), st.median(rows["f32"][1]), rows["f32"][2]
print("%-5s %10s %8s %12s %8s %12s %8s" % ("state", "file_MB", "x f32", "save_s(med)", "x f32", "load_s(med)", "x f32"))
for f, (s, l, m) in rows.items():
    print("%-5s %10.1f %8.3f %12.3f %8.3f %12.3f %8.3f" % (f, m, m / m0, st.median(s), st.median(s) / s0, st.median(l), st.median(l) / l0))
PY
