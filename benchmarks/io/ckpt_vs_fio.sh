#!/usr/bin/env bash
# Checkpoint save and load bandwidth against fio on the same disk, back to back in one run
# (docs/DESIGN.md rule 9). Per round: fio writes a file of SIZE sequentially (4 MiB blocks, io_uring,
# O_DIRECT, queue depth 8) and reads it back after the page cache is dropped; then ckpt_bench
# saves a checkpoint of the same bytes and loads it (cache dropped in between). Prints each
# round and the median of the per-round ratios checkpoint / fio. Needs root to drop the cache.
#
#   benchmarks/io/ckpt_vs_fio.sh BUILD_DIR DIR [SIZE=2G] [ROUNDS=3]
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR DIR [SIZE] [ROUNDS]}
dir=${2:?usage: $0 BUILD_DIR DIR [SIZE] [ROUNDS]}
size=${3:-2G}
rounds=${4:-3}
bench="$build/benchmarks/io/ckpt_bench"
command -v fio >/dev/null || { echo "fio is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
[[ -x "$bench" ]] || { echo "$bench not built (-DZEROSHARD_BUILD_BENCHMARKS=ON)" >&2; exit 1; }
mkdir -p "$dir"
fio_file="$dir/fio-ckpt.$$"
source "$(dirname "${BASH_SOURCE[0]}")/fio_common.sh"
trap 'rm -f "$fio_file"; fio_iomem_restore' EXIT

fio_mbs() {  # rw
  sync
  echo 3 > /proc/sys/vm/drop_caches
  fio --name=zs --filename="$fio_file" --size="$size" --rw="$1" --bs=4M --iodepth=8 \
      --ioengine=io_uring --direct=1 --end_fsync=1 --iomem="$FIO_IOMEM" --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; d=j["write" if sys.argv[1]=="write" else "read"]; print("%.1f" % (d["bw_bytes"]/1e6))' "$1"
}

fio_iomem $(( (4 << 20) * 8 ))  # 4 MiB blocks, queue depth 8
echo "fio $(fio --version) (buffers: $FIO_IOMEM) vs ckpt_bench: size $size, $rounds rounds, in $dir; load average $(cut -d' ' -f1 /proc/loadavg)"
printf "%-6s %10s %10s %7s %10s %10s %7s\n" round fio_write save ratio fio_read load ratio
wr=() rr=()
for ((r = 1; r <= rounds; ++r)); do
  rm -f "$fio_file"
  fw=$(fio_mbs write)
  fr=$(fio_mbs read)
  rm -f "$fio_file"
  out=$("$bench" --dir "$dir" --size "$size" --rounds 1)
  sw=$(awk '$1=="1"{print $3}' <<<"$out")
  sl=$(awk '$1=="1"{print $5}' <<<"$out")
  w=$(python3 -c "print('%.3f' % ($sw/$fw))")
  l=$(python3 -c "print('%.3f' % ($sl/$fr))")
  wr+=("$w") rr+=("$l")
  printf "%-6s %10s %10s %7s %10s %10s %7s\n" "$r" "$fw" "$sw" "$w" "$fr" "$sl" "$l"
done
echo "median checkpoint/fio: save $(median "${wr[@]}"), load $(median "${rr[@]}")"
