#!/usr/bin/env bash
# The demo trainer's checkpoints: a run of 6 steps saving every 3 (--save, --save-every), then a
# second run resumed from the tag after step 3 (--resume): its losses for steps 4-6 and its final
# validation loss must equal the first run's bit for bit (same world size and stage: the engine's
# state, the loss scaler and the data sampler's position all continue). A resume past --steps is
# refused.
# usage: run_demo_resume_test.sh ZEROSHARD_BIN MPIEXEC NP [demo flags...]
set -euo pipefail
bin="$1" mpiexec="$2" np="$3"
shift 3
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
small=(--steps 6 --layers 2 --dim 64 --heads 2 --seq 32 --batch 4 --corpus-chars 200000
       --sample 0 --no-dp-reference --quiet)
launch=("$mpiexec" -np "$np")
if [[ "$mpiexec" == none ]]; then launch=(); fi
"${launch[@]}" "$bin" demo "${small[@]}" --save "$work/ckpt" --save-every 3 \
  --report-json "$work/whole.json" "$@"
[[ -f "$work/ckpt/step00000003/manifest.json" && -f "$work/ckpt/step00000006/manifest.json" ]] ||
  { ls -R "$work/ckpt"; echo "FAIL: the tags of steps 3 and 6 are not there"; exit 1; }
"${launch[@]}" "$bin" demo "${small[@]}" --resume "$work/ckpt/step00000003" \
  --report-json "$work/resumed.json" "$@"
/usr/bin/python3 - "$work/whole.json" "$work/resumed.json" <<'PY'
import json, sys
whole, resumed = (json.load(open(f)) for f in sys.argv[1:3])
a = {s["step"]: s["loss"] for s in whole["steps"]}
b = {s["step"]: s["loss"] for s in resumed["steps"]}
assert sorted(b) == [4, 5, 6], f"the resumed run trained steps {sorted(b)}"
for k in b:
    assert a[k] == b[k], f"step {k}: loss {b[k]!r} resumed, {a[k]!r} uninterrupted"
va, vb = whole["validation_loss"]["after"], resumed["validation_loss"]["after"]
assert va == vb, f"final validation loss {vb!r} resumed, {va!r} uninterrupted"
print(f"resumed after step 3: losses of steps 4-6 and the final validation loss ({vb:.6f}) "
      "equal the uninterrupted run's")
PY
if "${launch[@]}" "$bin" demo "${small[@]}" --resume "$work/ckpt" > "$work/past.txt" 2>&1; then
  cat "$work/past.txt"; echo "FAIL: a resume past --steps ran"; exit 1
fi
grep -q "nothing left to train" "$work/past.txt" || { cat "$work/past.txt"; echo "FAIL: the refusal"; exit 1; }
echo "demo resume: passed"
