#!/usr/bin/env bash
# Replicas that come and go: a torchft lighthouse and three DiLoCo replicas of the GPT of examples/train_gpt.py
# on this machine, each replica its own `deepspeed` launch. Replica 2 is killed (SIGKILL) mid-run; the other
# two go on without it; its relaunch heals from them and all three end on the same global model. The three
# summaries are printed at the end.
#
#   examples/fault_tolerance.sh          (after `make install`; about 4 minutes on 2 cores)
#
# Settings: SYNCS (outer syncs to train for, 20), KILL_AFTER (seconds of replica 2's training before the kill,
# 20), DOWN (seconds it stays dead, 10), OUT (logs, runs/fault_tolerance), PORT (the lighthouse's, 29510),
# MASTER_PORT (replica i's launch uses MASTER_PORT + i, 29600). QUICK=1: a smoke run of a few seconds' training
# (1 sync, a tiny model and corpus, the kill and relaunch at once; tests/test_examples_cleanup.py runs it).
# Everything the script starts (the lighthouse and each replica's launcher and ranks, each in a session of its
# own) is stopped when it ends: on success, on failure and on Ctrl-C or SIGTERM.
# The lighthouse waits up to 10 s (--join_timeout_ms) for a replica that is alive but late to a sync: set it
# above the spread of the replicas' arrival at a sync, or a late replica is left out and heals at the next.
# The config is configs/diloco_ft_cpu.json: "fault_tolerance": {"min_replicas": 1, "merge": "tokens", ...}
# (min_replicas 1: a replica that is last to finish can take its final syncs alone).
set -euo pipefail
cd "$(dirname "$0")/.."
set +m  # no job control: each `setsid cmd &` below keeps its PID as the id of its new session and group
BIN=${BIN:-.venv/bin}
QUICK=${QUICK:-0}
if [ "$QUICK" = 1 ]; then
  SYNCS=${SYNCS:-1} KILL_AFTER=${KILL_AFTER:-0} DOWN=${DOWN:-0}
  MODEL=(--n_layer 1 --n_head 2 --n_embd 32 --block_size 32 --corpus_bytes 200000 --eval_batches 1)
else
  MODEL=()
fi
SYNCS=${SYNCS:-20}
KILL_AFTER=${KILL_AFTER:-20}
DOWN=${DOWN:-10}
OUT=${OUT:-runs/fault_tolerance}
PORT=${PORT:-29510}
MASTER_PORT=${MASTER_PORT:-29600}
mkdir -p "$OUT"
rm -f "$OUT"/*.log
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCHFT_LIGHTHOUSE=http://localhost:$PORT

groups=()  # the process groups this script started, each led by a `setsid` child (its PID is the group's id)
sleeper=  # the `sleep` that `pause` waits for
cleanup() {  # stop what this script started, whatever happened: every group, children included
  trap - EXIT INT TERM
  [ -n "$sleeper" ] && kill "$sleeper" 2>/dev/null || true
  for pid in "${groups[@]}"; do kill -TERM -- -"$pid" 2>/dev/null || true; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do  # up to 2 s to exit, then SIGKILL
    alive=0
    for pid in "${groups[@]}"; do kill -0 -- -"$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.2
  done
  for pid in "${groups[@]}"; do kill -KILL -- -"$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'echo "interrupted: stopping the lighthouse and the replicas" >&2; cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

# The lighthouse in a session of its own too: a plain `&` child would share the script's group, which
# cleanup cannot signal without signalling itself.
setsid "$BIN/torchft_lighthouse" --min_replicas 1 --bind "[::]:$PORT" --join_timeout_ms 10000 \
  --heartbeat_timeout_ms 2000 > "$OUT/lighthouse.log" 2>&1 &
lighthouse=$!
groups+=("$lighthouse")

replica() {  # replica <id> <log>: one deepspeed launch of one rank, in its own session and group ($last)
  REPLICA_GROUP_ID=$1 setsid "$BIN/deepspeed" --num_gpus 1 --master_port $((MASTER_PORT + $1)) examples/train_gpt.py \
    --deepspeed_config configs/diloco_ft_cpu.json --syncs "$SYNCS" --eval_interval 4 "${MODEL[@]}" > "$2" 2>&1 &
  last=$!
  groups+=("$last")
}
# Waiting runs no foreground command: when Ctrl-C reaches a foreground child that then exits normally
# (a `grep` or `sleep` just finishing), bash drops the SIGINT and its trap never runs. `wait` is interrupted at
# once by a trapped signal, and the background `sleep` it waits for ignores SIGINT (cleanup stops it).
pause() { sleep "$1" & sleeper=$!; wait "$sleeper"; sleeper=; }
shows() {  # shows <log> <text>: the log has a line with text (builtins only)
  local line
  [ -f "$1" ] || return 1
  while IFS= read -r line || [ -n "$line" ]; do [[ $line == *"$2"* ]] && return 0; done < "$1"
  return 1
}
wait_for() {  # wait_for <log> <text> <pid>: until the log shows text; fails if the process ends first
  until shows "$1" "$2"; do
    kill -0 "$3" 2>/dev/null || { echo "$1 ended before \"$2\":" >&2; tail -20 "$1" >&2; return 1; }
    pause 0.5
  done
}

wait_for "$OUT/lighthouse.log" "listening on" "$lighthouse"  # a port in use ends it here, named
echo "lighthouse on :$PORT; three replicas of 1 rank, $SYNCS syncs (logs in $OUT)"
replica 0 "$OUT/replica0.log"; r0=$last
replica 1 "$OUT/replica1.log"; r1=$last
replica 2 "$OUT/replica2.log"; r2=$last
wait_for "$OUT/replica2.log" "ACCO engine" "$r2"
pause "$KILL_AFTER"
kill -9 -- -"$r2"
wait "$r2" 2>/dev/null || true  # reaped here, quietly
printf '%(%T)T killed replica 2 (SIGKILL); replicas 0 and 1 go on; relaunching it in %s s\n' -1 "$DOWN"
pause "$DOWN"
replica 2 "$OUT/replica2_relaunched.log"; r2=$last
printf '%(%T)T relaunched replica 2: replicas 0 and 1 end their period early for it, and it heals from one\n' -1
status=0
for pid in "$r0" "$r1" "$r2"; do wait "$pid" || status=$?; done
for log in replica0 replica1 replica2_relaunched; do
  echo; echo "---- $log ----"
  sed -n '/==== summary ====/,$p' "$OUT/$log.log" | grep -v "^\[" || true
done
exit $status
