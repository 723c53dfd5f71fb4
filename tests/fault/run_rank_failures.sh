#!/usr/bin/env bash
# A rank that fails on its own, or freezes, must end the whole job within about the collective
# timeout, not hang it: the demo trainer on 2 ranks (mpirun),
#  1. one rank (MPMD) given a --text file that does not exist (rank 0's does), under the
#     default 300 s timeout:
#     it fails at once and aborts the job (zeroshard::abort_mpi_job from main), rather than
#     waiting in MPI_Finalize while the other rank waits in a collective for it;
#  2. the ranks given different flags (--steps): every rank fails at once, naming the flag,
#     instead of pairing different collectives and failing late with another message;
#  3. one rank frozen with SIGSTOP while training, under a 5 s timeout: the other rank's
#     collective times out, it reports it, and its exit aborts the job (a collective that never
#     completed), rather than waiting in MPI_Finalize for the frozen rank forever.
# Each case must end non-zero within its bound, with the failing rank's message in the log.
#
#   run_rank_failures.sh ZEROSHARD_CLI [MPIRUN]
set -euo pipefail
zs=${1:?usage: $0 ZEROSHARD_CLI [MPIRUN]}
mpirun=${2:-mpirun}
work=$(mktemp -d /tmp/zs-rankfail.XXXXXX)
job=""
finish() {
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null || true
  pkill -CONT -f "$work" 2>/dev/null || true
  rm -rf "$work"
}
trap finish EXIT
small=(--layers 2 --dim 64 --heads 2 --seq 32 --corpus-chars 100000 --no-dp-reference --sample 0
       --quiet)

# Runs the command in the background and waits up to $1 s for it to end; sets rc and took.
bounded() {
  local limit=$1
  shift
  local start=$SECONDS
  "$@" > "$work/log" 2>&1 &
  job=$!
  while kill -0 "$job" 2>/dev/null && (( SECONDS - start < limit )); do sleep 0.5; done
  if kill -0 "$job" 2>/dev/null; then
    cat "$work/log"
    echo "FAIL: still running after ${limit} s: $*"
    exit 1
  fi
  rc=0
  wait "$job" || rc=$?
  job=""
  took=$(( SECONDS - start ))
}

echo "1. one rank fails on its own (default collective timeout, 300 s)"
head -c 300000 < <(yes "the quick brown fox jumps over the lazy dog") > "$work/corpus.txt"
bounded 60 "$mpirun" -np 1 "$zs" demo "${small[@]}" --stage 2 --steps 50 --text "$work/corpus.txt" : \
                    -np 1 "$zs" demo "${small[@]}" --stage 2 --steps 50 --text "$work/no-such-file"
grep -q "no-such-file" "$work/log" || { cat "$work/log"; echo "FAIL: the failing rank's error"; exit 1; }
(( rc != 0 )) || { cat "$work/log"; echo "FAIL: the job exited 0"; exit 1; }
echo "   ended with rc $rc after ${took} s"

echo "2. the ranks given different flags (--steps)"
bounded 60 "$mpirun" -np 1 "$zs" demo "${small[@]}" --stage 2 --steps 50 : \
                    -np 1 "$zs" demo "${small[@]}" --stage 2 --steps 40
grep -q "rank 1 has --steps 40 where rank 0 has --steps 50" "$work/log" ||
  { cat "$work/log"; echo "FAIL: the differing flag is not named"; exit 1; }
(( rc != 0 )) || { cat "$work/log"; echo "FAIL: the job exited 0"; exit 1; }
echo "   ended with rc $rc after ${took} s"

echo "3. one rank frozen (SIGSTOP) while training, collective timeout 5 s"
echo '{"zeroshard": {"collective_timeout_s": 5}}' > "$work/timeout5.json"
"$mpirun" -np 2 "$zs" demo "${small[@]}" --stage 3 --steps 100000 --log-every 1000 \
  --config "$work/timeout5.json" > "$work/log" 2>&1 &
job=$!
frozen=""
for _ in $(seq 1 120); do
  for p in $(pgrep -f "$work/timeout5.json" || true); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1; then
      frozen=$p
    fi
  done
  [[ -n "$frozen" ]] && break
  sleep 0.5
done
[[ -n "$frozen" ]] || { cat "$work/log"; echo "FAIL: rank 1 never started"; exit 1; }
sleep 3  # into training (a freeze during set-up would be a frozen peer all the same)
kill -STOP "$frozen"
start=$SECONDS
while kill -0 "$job" 2>/dev/null && (( SECONDS - start < 60 )); do sleep 0.5; done
if kill -0 "$job" 2>/dev/null; then
  kill -CONT "$frozen" 2>/dev/null || true
  cat "$work/log"
  echo "FAIL: the job still runs 60 s after rank 1 froze (timeout 5 s)"
  exit 1
fi
rc=0
wait "$job" || rc=$?
job=""
grep -q "did not complete within 5 s" "$work/log" || { cat "$work/log"; echo "FAIL: no timeout error"; exit 1; }
(( rc != 0 )) || { cat "$work/log"; echo "FAIL: the job exited 0"; exit 1; }
echo "   ended with rc $rc $(( SECONDS - start )) s after the freeze"
echo "rank failures: passed"
