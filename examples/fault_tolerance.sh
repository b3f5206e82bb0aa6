#!/usr/bin/env bash
# Replicas that come and go: a torchft lighthouse and three DiLoCo replicas of the GPT of examples/train_gpt.py
# on this machine, each replica its own `deepspeed` launch. Replica 2 is killed (SIGKILL) mid-run; the other
# two go on without it; its relaunch heals from them and all three end on the same global model. The three
# summaries are printed at the end.
#
#   examples/fault_tolerance.sh          (after `make install`; about 4 minutes on 2 cores)
#
# Settings: SYNCS (outer syncs to train for, 20), KILL_AFTER (seconds of replica 2's training before the kill,
# 20), DOWN (seconds it stays dead, 10), OUT (logs, runs/fault_tolerance), PORT (the lighthouse's, 29510).
# The lighthouse waits up to 10 s (--join_timeout_ms) for a replica that is alive but late to a sync: set it
# above the spread of the replicas' arrival at a sync, or a late replica is left out and heals at the next.
# The config is configs/diloco_ft_cpu.json: "fault_tolerance": {"min_replicas": 1, "merge": "tokens", ...}
# (min_replicas 1: a replica that is last to finish can take its final syncs alone).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
SYNCS=${SYNCS:-20}
KILL_AFTER=${KILL_AFTER:-20}
DOWN=${DOWN:-10}
OUT=${OUT:-runs/fault_tolerance}
PORT=${PORT:-29510}
mkdir -p "$OUT"
rm -f "$OUT"/*.log
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCHFT_LIGHTHOUSE=http://localhost:$PORT

pids=()
cleanup() {  # stop what this script started, whatever happened
  for pid in "${pids[@]}"; do kill -9 -- -"$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

"$BIN/torchft_lighthouse" --min_replicas 1 --bind "[::]:$PORT" --join_timeout_ms 10000 \
  --heartbeat_timeout_ms 2000 > "$OUT/lighthouse.log" 2>&1 &
pids+=($!)

replica() {  # replica <id> <log>: one deepspeed launch of one rank, in its own process group ($last)
  REPLICA_GROUP_ID=$1 setsid "$BIN/deepspeed" --num_gpus 1 --master_port $((29600 + $1)) examples/train_gpt.py \
    --deepspeed_config configs/diloco_ft_cpu.json --syncs "$SYNCS" --eval_interval 4 > "$2" 2>&1 &
  last=$!
  pids+=("$last")
}
wait_for() {  # wait_for <log> <text>
  until grep -q "$2" "$1" 2>/dev/null; do sleep 1; done
}

echo "lighthouse on :$PORT; three replicas of 1 rank, $SYNCS syncs (logs in $OUT)"
replica 0 "$OUT/replica0.log"; r0=$last
replica 1 "$OUT/replica1.log"; r1=$last
replica 2 "$OUT/replica2.log"; r2=$last
wait_for "$OUT/replica2.log" "ACCO engine"
sleep "$KILL_AFTER"
kill -9 -- -"$r2"
echo "$(date +%T) killed replica 2 (SIGKILL); replicas 0 and 1 go on; relaunching it in $DOWN s"
sleep "$DOWN"
replica 2 "$OUT/replica2_relaunched.log"; r2=$last
echo "$(date +%T) relaunched replica 2: it heals from a live replica at their next sync"
status=0
for pid in "$r0" "$r1" "$r2"; do wait "$pid" || status=$?; done
for log in replica0 replica1 replica2_relaunched; do
  echo; echo "---- $log ----"
  sed -n '/==== summary ====/,$p' "$OUT/$log.log" | grep -v "^\[" || true
done
exit $status
