#!/usr/bin/env bash
# The swapper's sequential bandwidth against fio on the same settings, back to back in one run
# (docs/DESIGN.md rule 9): per round, fio writes then reads its file, then swap_bench writes then
# reads its own (O_DIRECT, io_uring, registered buffers and files, same block size, queue depth
# and file size; both files written once beforehand, untimed). Prints each round and the median
# of the per-round ratios swapper / fio.
#
#   benchmarks/io/fio_vs_swapper.sh BUILD_DIR DIR [SIZE=4G] [BS=1M] [QD=8] [ROUNDS=5]
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR DIR [SIZE] [BS] [QD] [ROUNDS]}
dir=${2:?usage: $0 BUILD_DIR DIR [SIZE] [BS] [QD] [ROUNDS]}
size=${3:-4G}
bs=${4:-1M}
qd=${5:-8}
rounds=${6:-5}
bench="$build/benchmarks/io/swap_bench"
command -v fio >/dev/null || { echo "fio is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
[[ -x "$bench" ]] || { echo "$bench not built (-DZEROSHARD_BUILD_BENCHMARKS=ON)" >&2; exit 1; }
mkdir -p "$dir"
fio_file="$dir/fio-bench.$$"
source "$(dirname "${BASH_SOURCE[0]}")/fio_common.sh"
trap 'rm -f "$fio_file"; fio_iomem_restore' EXIT

# fio's bandwidth in MB/s (10^6 bytes) for one direction, from its JSON report.
fio_mbs() {  # rw
  fio --name=zs --filename="$fio_file" --size="$size" --rw="$1" --bs="$bs" --iodepth="$qd" \
      --ioengine=io_uring --direct=1 --fixedbufs --registerfiles --iomem="$FIO_IOMEM" --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; d=j["write" if sys.argv[1]=="write" else "read"]; print("%.1f" % (d["bw_bytes"]/1e6))' "$1"
}

fio_iomem $(( $(numfmt --from=iec "$bs") * qd ))
echo "fio $(fio --version) (buffers: $FIO_IOMEM) vs swap_bench: size $size, block $bs, queue depth $qd, $rounds rounds, in $dir"
# Both sides measure overwrites of a file written once before (swap files in steady state):
# fio's first write here is untimed, as swap_bench's is inside the program.
fio_mbs write >/dev/null
printf "%-6s %12s %12s %8s %12s %12s %8s\n" round fio_write swap_write ratio fio_read swap_read ratio
wr=() rr=()
for ((r = 1; r <= rounds; ++r)); do
  fw=$(fio_mbs write)
  fr=$(fio_mbs read)
  out=$("$bench" --dir "$dir" --size "$size" --bs "$bs" --qd "$qd" --mode both)
  sw=$(awk '$2=="write"{print $5}' <<<"$out")
  sr=$(awk '$2=="read"{print $5}' <<<"$out")
  w=$(python3 -c "print('%.3f' % ($sw/$fw))")
  rd=$(python3 -c "print('%.3f' % ($sr/$fr))")
  wr+=("$w") rr+=("$rd")
  printf "%-6s %12s %12s %8s %12s %12s %8s\n" "$r" "$fw" "$sw" "$w" "$fr" "$sr" "$rd"
done
echo "median swapper/fio: write $(median "${wr[@]}"), read $(median "${rr[@]}")"
