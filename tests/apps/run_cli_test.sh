#!/usr/bin/env bash
# The command line without MPI: help texts, and clear errors (exit 2, naming the flag) on bad
# flags, before any rank starts MPI.
# usage: run_cli_test.sh ZEROSHARD_BIN
set -uo pipefail
bin="$1"
fail=0
expect() {  # expect CODE PATTERN ARGS...: exit code and a pattern in stdout+stderr
  local code="$1" pattern="$2"
  shift 2
  local out rc
  out="$("$bin" "$@" 2>&1)"
  rc=$?
  if [[ $rc -ne $code ]] || ! grep -q -- "$pattern" <<<"$out"; then
    echo "FAIL: zeroshard $*: exit $rc (want $code), output lacks '$pattern':"
    echo "$out"
    fail=1
  fi
}
expect 0 "demo" --help
expect 0 "calibrate" --help
expect 0 "same-bytes pass" calibrate --help
expect 2 "needs a value" calibrate --out
expect 0 "zeroshard " --version
expect 0 "link-calibration" plan --help
expect 2 "need --calibration" plan --link-calibration /nonexistent/link.json
expect 2 "need --calibration" plan --compute-s 1
# capacity runs in Python (tests/python/test_capacity.py tests it): an interpreter that is not
# there is named, with the way out.
ZEROSHARD_PYTHON=/nonexistent/python expect 127 "set ZEROSHARD_PYTHON" capacity --memory-gib 1
expect 0 "capacity" --help
expect 2 "unknown command" frobnicate
expect 2 "usage" # no command
for flag in --stage --dtype --optimizer --lr --steps --batch --seq --layers --dim --offload-optimizer \
  --offload-param --nvme-path --accum --clip --config --seed --quiet --report-json; do
  expect 0 "$flag" demo --help
done
expect 2 "did you mean --stage" demo --stgae 3
expect 2 "must be one of f32, bf16, f16" demo --dtype fp8
expect 2 "not a multiple of --heads" demo --dim 100 --heads 3
expect 2 "needs a value" demo --steps
expect 2 "requires zero_optimization.stage = 3" demo --stage 1 --offload-param cpu
expect 2 "configuration" demo --config /nonexistent/ds_config.json
# Flags over a DeepSpeed file: a changed optimizer drops the file's SGD momentum (it refused to
# start), and --batch is the micro-batch the file's train_batch_size is checked against.
cfgs=$(mktemp -d)
trap 'rm -rf "$cfgs"' EXIT
echo '{"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}' >"$cfgs/sgd.json"
echo '{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 16}' >"$cfgs/tbs.json"
tiny=(--steps 1 --layers 1 --dim 32 --heads 2 --seq 16)
expect 0 "stage 0, f32 parameters and gradients, adamw" demo --config "$cfgs/sgd.json" --optimizer adamw "${tiny[@]}"
expect 1 "train_batch_size = 16 is not train_micro_batch_size_per_gpu (4)" \
  demo --config "$cfgs/tbs.json" --batch 4 "${tiny[@]}"
# A directory opens as a stream that reads nothing: named as such, not as a text of 0 tokens.
expect 1 "is a directory, not a text file" demo --text / --steps 1
# plan: every stage and offload choice, against the memory given (a byte of device memory fits
# nothing), and clear errors on bad flags.
small=(--layers 2 --dim 64 --heads 4 --vocab 128 --seq 16 --ranks 2)
expect 0 "--device-gib" plan --help
expect 0 "^3     nvme      nvme" plan "${small[@]}"
expect 0 "no (device)" plan "${small[@]}" --device-gib 0.000000001
expect 0 "yes" plan "${small[@]}" --device-gib 1 --host-gib 1 --nvme-gib 1
expect 2 "unknown flag --frob" plan --frob 1
expect 2 "--dtype must be one of" plan --dtype fp8
expect 2 "--ranks needs a positive integer" plan --ranks 0
# GPU engines planned without a GPU: their staging counted, the choices they take; their rates
# typed or refused where they cannot apply.
expect 0 "^3     host      host" plan "${small[@]}" --device cuda
expect 2 "--device must be one of cpu, cuda" plan --device gpu
expect 2 "need --device cuda" plan --calibration /dev/null --pcie-gbs 25
expect 2 "need --calibration or a typed rate" plan --compute-s 1
expect 2 "need --device cuda" plan --gpu-update-gps 10
# Models given as a parameter count in units, or as a JSON file of units.
expect 0 "7.500 G parameters in 75 units (largest 100.000 M)" plan --params 7.5G --largest-unit 100M --ranks 64
expect 2 "go together" plan --params 1G
expect 2 "one model" plan --params 1G --largest-unit 1M --layers 2
units="$(mktemp)"
echo '[{"name": "a", "params": [{"name": "w", "shape": [1000, 1000]}, {"name": "b", "shape": [1000], "decay": false}]},
       {"name": "b", "params": [{"name": "w", "shape": [3000]}]}]' >"$units"
expect 0 "0.001 G parameters in 2 units (largest 1.001 M)" plan --units "$units"
echo '[{"name": "a"}]' >"$units"
expect 2 "unit 0" plan --units "$units"
rm -f "$units"
expect 2 "cannot be read" plan --units /nonexistent.json
# Typed rates alone time the step; a row whose rate is missing names the flag that gives it.
expect 0 "--disk-gbs" plan "${small[@]}" --memory-gbs 20 --bus-gbs 10
if "$bin" plan "${small[@]}" --memory-gbs 20 --bus-gbs 10 --disk-gbs 2 | grep -q "not measured"; then
  echo "FAIL: plan with every rate typed left a row untimed"
  fail=1
fi
cal="$(mktemp)"
trap 'rm -f "$cal"' EXIT
echo '{"schema": "zeroshard-calibration/1", "optimizer": {"adamw": {"bf16": {"params_per_s": 1e9}}},
       "collectives": {}}' >"$cal"
expect 2 "groups of 3 in 4 ranks" plan --ranks 4 --shard-group 3 --device cuda --calibration "$cal" --bus-gbs 100
expect 2 "--bus-gbs" plan --ranks 4 --device cuda --calibration "$cal"
expect 2 "--device must be cpu or cuda" calibrate --device gpu
# The speculative step: the host rows' update hides behind a long enough backward, and their
# host memory takes the second copy of the state; the other rows do not change.
big=(--params 1G --largest-unit 40M --ranks 1 --memory-gbs 40 --compute-s 3)
off="$("$bin" plan "${big[@]}" --speculative-step off | awk '$1 == 2 && $2 == "host" && $3 == "device"')"
on="$("$bin" plan "${big[@]}" --speculative-step on | awk '$1 == 2 && $2 == "host" && $3 == "device"')"
dev_off="$("$bin" plan "${big[@]}" --speculative-step off | awk '$1 == 2 && $2 == "device"')"
dev_on="$("$bin" plan "${big[@]}" --speculative-step on | awk '$1 == 2 && $2 == "device"')"
if ! awk -v a="$off" -v b="$on" 'BEGIN { split(a, x); split(b, y)
       exit !(y[5] > 1.9 * x[5] && y[11] < x[11] / 5) }' || [[ "$dev_off" != "$dev_on" ]]; then
  echo "FAIL: plan --speculative-step: off '$off' on '$on'; device rows '$dev_off' '$dev_on'"
  fail=1
fi
expect 2 "--speculative-step must be one of" plan --speculative-step yes
if [[ $("$bin" plan "${small[@]}" --device cuda | grep -c '^[0-3]     ') != 14 ]]; then
  echo "FAIL: plan --device cuda: not the 14 choices a GPU engine takes"
  fail=1
fi
exit $fail
