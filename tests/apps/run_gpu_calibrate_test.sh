#!/usr/bin/env bash
# `zeroshard calibrate --quick --device cuda` on one rank, its gpu section checked (pinned copies
# up and down, the update in GPU memory per dtype and moments' format), then
# `zeroshard plan --device cuda` from it: GPU engines' rows timed, with the host-GPU copies in a
# pcie column, none where the state stays on the GPU. Without a GPU, calibrate says
# "--device cuda: no usable GPU", which ctest reads as a skip.
# usage: run_gpu_calibrate_test.sh ZEROSHARD_BIN
set -euo pipefail
bin="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bin" calibrate --quick --device cuda --out "$work/c.json" | tee "$work/out.txt"
grep -q "pinned copies up" "$work/out.txt"
/usr/bin/env python3 - "$work/c.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))["gpu"]
assert g is not None, "no gpu section"
# PCIe 3 x16 moves about 12 GB/s, an H200's link about 55: anything outside 1-1000 is a bug.
assert 1 < g["h2d_gbs"] < 1000 and 1 < g["d2h_gbs"] < 1000, g
for d in ("f32", "bf16"):
    a = g["adamw"][d]
    assert 1e8 < a["params_per_s"] < 1e13, (d, a)
    assert sorted(a["state_formats"]) == ["8bit", "bf16"], (d, a)
    for f, r in a["state_formats"].items():
        assert 0.1 < r["params_per_s"] / a["params_per_s"] < 10, (d, f, a)
print("gpu calibration checked:", g)
PY
"$bin" plan --device cuda --calibration "$work/c.json" >"$work/plan.txt"
cat "$work/plan.txt"
grep -q "pcie s" "$work/plan.txt" || { echo "FAIL: no pcie column"; exit 1; }
# GPT-2 small on one GPU: the gradients (about 250 MB of bf16) go down and the parameters up
# with the optimizer on the host, at well under 1000 GB/s: some copies show unless hidden by
# the update; none with the state on the GPU.
awk '$1 ~ /^[0-3]$/ && $2 == "device" && $3 == "device" { dev++; if ($NF != 0) bad = 1 }
     $1 ~ /^[0-3]$/ && $2 == "host" && $3 != "nvme" { host++; if ($NF !~ /^[0-9.]+$/) bad = 1 }
     END { exit bad || dev != 4 || host != 4 }' "$work/plan.txt" ||
  { echo "FAIL: the pcie column"; exit 1; }
echo "gpu calibrate test passed"
