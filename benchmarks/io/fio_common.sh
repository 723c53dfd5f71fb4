# Sourced by the fio comparisons (fio_vs_swapper.sh, ckpt_vs_fio.sh): fio's buffers on huge
# pages, and the median of a series.
#
# fio's default buffers are 4 KiB pages, so a 1 MiB O_DIRECT request is 256 scattered segments,
# more than a virtio disk takes in one request (/sys/block/*/queue/max_segments, 254 here): the
# block layer splits it, and fio measures less than the disk gives (on this project's VM, reads
# of 1 MiB blocks at qd 8: 1.6-1.9 GB/s with 4 KiB pages, 3.0-3.2 GB/s with huge pages). The
# engine's staging is 2 MiB huge pages, so the ceiling quoted must be fio on huge pages too.

# fio_iomem BYTES: sets FIO_IOMEM to fio's --iomem for buffers of BYTES. As root it reserves
# enough 2 MiB huge pages (restored by fio_iomem_restore) and uses shmhuge; otherwise it warns
# that the ceiling is fio's, not the disk's, and keeps malloc.
fio_iomem() {
  local need=$(( ($1 + (2 << 20) - 1) / (2 << 20) + 2 ))
  FIO_HUGEPAGES_BEFORE=$(cat /proc/sys/vm/nr_hugepages)
  FIO_IOMEM=malloc
  if (( FIO_HUGEPAGES_BEFORE < need )) && [[ -w /proc/sys/vm/nr_hugepages ]]; then
    echo "$need" > /proc/sys/vm/nr_hugepages
  fi
  if (( $(awk '/HugePages_Free/{print $2}' /proc/meminfo) >= need )); then
    FIO_IOMEM=shmhuge
  else
    echo "warning: cannot reserve $need huge pages for fio (needs root): fio runs on 4 KiB" \
         "pages and measures less than the disk gives" >&2
  fi
}

fio_iomem_restore() {
  [[ -n "${FIO_HUGEPAGES_BEFORE:-}" && -w /proc/sys/vm/nr_hugepages ]] &&
    echo "$FIO_HUGEPAGES_BEFORE" > /proc/sys/vm/nr_hugepages || true
}

median() { printf "%s\n" "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
