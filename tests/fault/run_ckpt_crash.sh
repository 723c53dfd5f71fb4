#!/usr/bin/env bash
# Crash safety for real: every rank of a training job is killed with SIGKILL in the middle of a
# save (a new tag after every step, over the tags already in the root), then:
#   - `zeroshard ckpt verify` finds the root's latest tag intact, and so is every other tag;
#   - no temporary directory of the killed save is taken for a tag;
#   - a new job on the same ranks loads the root and continues bitwise like a run that was never
#     interrupted (ckpt_crash resume), and one on another world size loads it too.
# Usage: run_ckpt_crash.sh CKPT_CRASH_BIN ZEROSHARD_CLI MPIEXEC
set -euo pipefail
bin=$1 cli=$2 mpiexec=$3
root=$(mktemp -d /tmp/zeroshard-crash-XXXXXX)
job=
cleanup() {
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null || true
  pkill -9 -f "$bin save-loop $root" 2>/dev/null || true
  rm -rf "$root"
}
trap cleanup EXIT
# Flips one bit of a data file's first block (twice: back as it was).
flip() {
  python3 - "$1" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(4096 + 1000)
    b = f.read(1)
    f.seek(4096 + 1000)
    f.write(bytes([b[0] ^ 4]))
PY
}

"$mpiexec" -np 2 "$bin" save-loop "$root" > "$root.log" 2>&1 &
job=$!
# Wait for two complete saves, then for the next save to be under way, and kill every rank.
deadline=$((SECONDS + 120))
until [[ -f "$root/latest" ]] && [[ "$(cat "$root/latest")" > "step00000001" ]]; do
  (( SECONDS < deadline )) || { echo "no save completed"; cat "$root.log"; exit 1; }
  sleep 0.05
done
until compgen -G "$root/.tmp-*" > /dev/null; do
  (( SECONDS < deadline )) || { echo "no save started"; exit 1; }
done
pkill -9 -f "$bin save-loop $root"
wait "$job" 2>/dev/null || true
job=
rm -f "$root.log"
echo "killed during a save; the root holds:"
ls -a "$root"
latest=$(cat "$root/latest")
echo "latest: $latest"

for tag in "$root"/step*; do
  "$cli" ckpt verify "$tag"
done
"$cli" ckpt inspect "$root" | head -8
# A damaged tag is reported with a non-zero exit.
flip "$root/$latest/rank00001.state0"
if "$cli" ckpt verify "$root" 2> "$root/verify.err"; then
  echo "verify passed a damaged checkpoint"; exit 1
fi
grep -q "fails its checksum" "$root/verify.err"
flip "$root/$latest/rank00001.state0"
rm -f "$root/verify.err"

"$mpiexec" -np 2 "$bin" resume "$root"
"$mpiexec" -np 3 "$bin" load "$root"
echo "crash test passed"
