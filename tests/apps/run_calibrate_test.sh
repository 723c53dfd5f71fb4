#!/usr/bin/env bash
# Runs the real `zeroshard calibrate --quick` on NP ranks (nvme through swap files in a temporary
# directory) and checks the calibration file: every figure present, positive and plausible, the
# collectives measured over NP ranks, and bad flags refused before MPI starts.
# usage: run_calibrate_test.sh ZEROSHARD_BIN MPIEXEC NP   (MPIEXEC "none": one rank, no mpirun)
set -euo pipefail
bin="$1" mpiexec="$2" np="$3"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
launch=("$mpiexec" -np "$np")
if [[ "$mpiexec" == none ]]; then launch=(); fi
if "$bin" calibrate --frobnicate 2>"$work/err"; then
  echo "FAIL: a bad flag was accepted"
  exit 1
fi
grep -q "unknown flag --frobnicate" "$work/err"
"${launch[@]}" "$bin" calibrate --quick --out "$work/c.json" --nvme-path "$work" | tee "$work/out.txt"
grep -q "same-bytes" "$work/out.txt"
/usr/bin/python3 - "$work/c.json" "$np" <<'PY'
import json, sys
c, np = json.load(open(sys.argv[1])), int(sys.argv[2])
assert c["schema"] == "zeroshard-calibration/1", c["schema"]
assert c["host"]["ranks"] == np and c["host"]["threads_per_rank"] >= 1, c["host"]
for d in ("f32", "bf16"):
    m, o = c["memory"][d], c["optimizer"]["adamw"][d]
    assert m["bytes_per_param"] == 28 and 0.1 < m["same_bytes_gbs"] < 1e4, m
    assert 1e6 < o["params_per_s"] < 1e12, o
    # The update moves the same bytes as the pass: it cannot be many times faster or slower.
    assert 0.2 < o["over_same_bytes"] < 5, o
    # Compact moments (and, for bf16 parameters, a bf16 master with each moment format): each
    # measured, and not many times off the f32 update.
    fmts = ("bf16", "8bit") + (("f32/bf16", "bf16/bf16", "8bit/bf16") if d == "bf16" else ())
    assert sorted(o["state_formats"]) == sorted(fmts), (d, o)
    for f in fmts:
        assert 0.1 < o["state_formats"][f]["params_per_s"] / o["params_per_s"] < 10, (f, o)
col = c["collectives"]
assert col["world"] == np, col
if np > 1:
    for k, f in [(k, col[k]) for k in ("reduce_scatter", "all_gather", "all_reduce")] + \
                [(k + ".cold", col[k]["cold"]) for k in ("reduce_scatter", "all_gather", "all_reduce")] + \
                [(k + ".queued", col[k]["queued"]) for k in ("reduce_scatter", "all_gather")]:
        pts = f["points_bytes_s"]
        assert len(pts) >= 4 and all(a[0] < b[0] for a, b in zip(pts, pts[1:])), (k, pts)
        assert all(t > 0 for _, t in pts), (k, pts)
        assert 0 < f["latency_s"] < 1 and 0.001 < f["bandwidth_gbs"] < 1e4, (k, f)
        # Bigger collectives take longer: the largest at least the smallest's time.
        assert pts[-1][1] > pts[0][1], (k, pts)
n = c["nvme"]
assert n is not None and n["params"] > 0 and 1e4 < n["step_params_per_s"] < 1e12, n
assert abs(n["record_gbs"] - n["step_params_per_s"] * 24 / 1e9) < 1e-9 * n["record_gbs"] + 1e-12, n
assert 0 < n["update_share"] <= 1.5, n
for f in ("bf16", "8bit", "f32/bf16", "bf16/bf16", "8bit/bf16"):
    assert 1e4 < n["state_formats"][f]["step_params_per_s"] < 1e12, (f, n)
pt = n["param_tier"]  # stage 3's shards on the nvme tier: read for gathers, written by the update
assert all(1e-3 < pt[k] < 1e4 for k in ("read_gbs", "write_gbs", "write_with_records_gbs")), pt
print("calibration file checked:", sys.argv[1])
PY

# The planner reads it: the step time of every choice it models, and a damaged file refused.
plan=(--layers 2 --dim 64 --heads 2 --vocab 100 --seq 16 --ranks "$np")
"$bin" plan "${plan[@]}" --calibration "$work/c.json" --compute-s 0.5 >"$work/plan.txt"
grep -q "step s" "$work/plan.txt" || { cat "$work/plan.txt"; echo "FAIL: no step column"; exit 1; }
# Every row's step is at least the trainer's 0.5 s of compute, and the rows with optimizer
# state on the nvme tier have an nvme step.
awk '$1 ~ /^[0-3]$/ { rows++; if ($9 < 0.5) bad = 1; if ($2 == "nvme" && $12 <= 0) bad = 1 }
     END { exit bad || rows != 17 }' "$work/plan.txt" || { cat "$work/plan.txt"; echo "FAIL: step times"; exit 1; }
# With 8-bit moments the planner takes their own rates (not f32's): the nvme column changes.
# The measured rates of two formats can coincide on a noisy machine, so the formats' nvme
# rates are set apart here: 8-bit at half f32's rate, 8-bit with a bf16 master at a quarter.
# (A model of 16 M parameters, so that the nvme step shows in the table's milliseconds.)
/usr/bin/python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); n = c["nvme"]
n["state_formats"]["8bit"]["step_params_per_s"] = n["step_params_per_s"] / 2
n["state_formats"]["8bit/bf16"]["step_params_per_s"] = n["step_params_per_s"] / 4
json.dump(c, open(sys.argv[2], "w"))' "$work/c.json" "$work/cfmt.json"
big=(--layers 4 --dim 256 --heads 4 --vocab 50000 --seq 16 --ranks "$np" --calibration "$work/cfmt.json")
"$bin" plan "${big[@]}" >"$work/plan.txt"
# Parameters on the nvme tier: read and written, so an nvme step even with the state in memory.
awk '$3 == "nvme" { rows++; if ($12 <= 0) bad = 1 } END { exit bad || rows != 3 }' "$work/plan.txt" ||
  { cat "$work/plan.txt"; echo "FAIL: parameters on nvme"; exit 1; }
"$bin" plan "${big[@]}" --optimizer-state 8bit >"$work/plan8.txt"
grep -q "adamw with 8bit moments" "$work/plan8.txt" || { cat "$work/plan8.txt"; echo "FAIL: format"; exit 1; }
a=$(awk '$1 == "1" && $2 == "nvme" {print $12}' "$work/plan.txt")
b=$(awk '$1 == "1" && $2 == "nvme" {print $12}' "$work/plan8.txt")
awk -v a="$a" -v b="$b" 'BEGIN { exit !(a > 0 && b > a) }' || { echo "FAIL: 8-bit nvme step $b, f32 $a"; exit 1; }
# And a bf16 master its own: the nvme column changes again.
"$bin" plan "${big[@]}" --optimizer-state 8bit --master bf16 >"$work/plan8m.txt"
grep -q "8bit moments and a bf16 master" "$work/plan8m.txt" || { cat "$work/plan8m.txt"; echo "FAIL: master"; exit 1; }
c=$(awk '$1 == "1" && $2 == "nvme" {print $12}' "$work/plan8m.txt")
awk -v b="$b" -v c="$c" 'BEGIN { exit !(c > b) }' || { echo "FAIL: bf16-master nvme step $c, f32 master $b"; exit 1; }
# Across nodes, the link taken per collective from a calibration of several ranks (here the
# one just made): 4 ranks, 2 per node, flat, so every collective crosses and every row sends
# bytes out of its node; typing the link as well is refused.
if (( np > 1 )); then
  nodes=(--layers 2 --dim 64 --heads 2 --vocab 100 --seq 16 --ranks 4 --ranks-per-node 2
         --calibration "$work/c.json")
  "$bin" plan "${nodes[@]}" --link-calibration "$work/c.json" >"$work/plann.txt"
  awk '$1 ~ /^[1-3]$/ { rows++; if ($NF <= 0) bad = 1 } END { exit bad || !rows }' \
    "$work/plann.txt" || { cat "$work/plann.txt"; echo "FAIL: nothing crossed nodes"; exit 1; }
  if "$bin" plan "${nodes[@]}" --link-calibration "$work/c.json" --inter-node-gbs 1 2>"$work/err"; then
    echo "FAIL: two links taken"; exit 1
  fi
  grep -q "one of them" "$work/err" || { cat "$work/err"; echo "FAIL: reason"; exit 1; }
fi
# A calibration without the nvme tier: the nvme rows say so, the others are still predicted.
/usr/bin/python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["nvme"] = None
json.dump(c, open(sys.argv[2], "w"))' "$work/c.json" "$work/nonvme.json"
"$bin" plan "${plan[@]}" --calibration "$work/nonvme.json" >"$work/plan.txt"
grep -q "^1 *nvme .*nvme step rate with f32 moments is not measured" "$work/plan.txt" &&
  grep -q "^1 *host  *device .* 0\.[0-9]" "$work/plan.txt" || { cat "$work/plan.txt"; echo "FAIL: rows"; exit 1; }
echo '{"schema": "zeroshard-calibration/0"}' >"$work/bad.json"
if "$bin" plan --calibration "$work/bad.json" 2>"$work/err"; then echo "FAIL: bad file taken"; exit 1; fi
grep -q "zeroshard-calibration/0" "$work/err" || { cat "$work/err"; echo "FAIL: reason"; exit 1; }
echo "the planner read the calibration"
