#!/usr/bin/env bash
# The largest model that trains on a fixed disk with each optimizer-state format: capacity_bench
# (stage 3, parameters, gradients, master weights and optimizer state all on the nvme tier) in a
# loop-mounted ext4 image of DISK bytes, its model size found by bisection (a size counts when
# the engine finalizes and takes STEPS steps; a larger one fails with ENOSPC when the swap files
# are allocated). Needs root (losetup, mount); removes the image and mount point at exit, also on
# failure.
#
#   benchmarks/io/format_capacity.sh BUILD_DIR [DISK=4G] [STEPS=2] [UNITS=16] [FORMATS="f32 bf16 8bit"]
#
# A format is the moments' (f32, bf16, 8bit), optionally with "/bf16" for a bf16 master
# (Config::bf16_master), e.g. "8bit/bf16".
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR [DISK=4G] [STEPS=2] [UNITS=16] [FORMATS]}
disk=${2:-4G}
steps=${3:-2}
units=${4:-16}
formats=${5:-"f32 bf16 8bit"}
bench="$build/benchmarks/io/capacity_bench"
[[ -x "$bench" ]] || { echo "$bench not built (-DZEROSHARD_BUILD_BENCHMARKS=ON)" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || { echo "format_capacity.sh: needs root (a loop-mounted image)" >&2; exit 1; }

work=$(mktemp -d /tmp/zeroshard-capacity.XXXXXX)
img="$work/disk.img"
mnt="$work/mnt"
cleanup() {
  mountpoint -q "$mnt" && umount "$mnt"
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$mnt"
truncate -s "$disk" "$img"
mkfs.ext4 -q -F "$img"
mount -o loop "$img" "$mnt"
avail=$(df -B1 --output=avail "$mnt" | tail -1)
echo "disk: $disk ext4 image, $avail bytes available to the swap files; $units units, $steps steps"

# Fits PARAMS (in millions; the bisection's resolution)? The run's output goes to $work/last.log.
# ext4 frees a deleted file's blocks at its next journal commit: sync first, so that every trial
# sees the whole disk free.
fits() {
  sync -f "$mnt"
  local state=${2%%/*} master=f32
  [[ $2 == */* ]] && master=${2#*/}
  "$bench" --dir "$mnt" --params "$1M" --units "$units" --steps "$steps" --budget 16G \
    --state "$state" --master "$master" >"$work/last.log" 2>&1
}

printf '%-10s %14s %16s %12s\n' format largest_params swap_files_GiB vs_f32
first=""
for fmt in $formats; do
  lo=0                                # fits (0: nothing yet)
  hi=$((avail / 1000000 / 8 + 1))     # never fits: fewer than 8 bytes a parameter on disk
  while ((hi - lo > 1)); do
    mid=$(((lo + hi) / 2))
    if fits "$mid" "$fmt"; then lo=$mid; else hi=$mid; fi
    echo "  $fmt: ${mid}M parameters $( ((lo == mid)) && echo fit || echo "did not fit: $(tail -1 "$work/last.log" | cut -c1-150)")" >&2
  done
  fits "$lo" "$fmt" || { echo "format_capacity.sh: $fmt: ${lo}M no longer fits" >&2; exit 1; }
  files=$(grep -o 'swap files: [0-9.]* GiB' "$work/last.log" | grep -o '[0-9.]*')
  [[ -z "$first" ]] && first=$lo
  printf '%-10s %13sM %16s %12s\n' "$fmt" "$lo" "$files" \
    "$(python3 -c "print('%.2f' % ($lo / $first))")"
done
