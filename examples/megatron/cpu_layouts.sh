#!/usr/bin/env bash
# Megatron-DeepSpeed's pretrain_gpt.py with ACCO in the layouts its users train in, on 4 CPU ranks:
# data parallel 2 x tensor parallel 2, with Megatron's default PipelineEngine (pipeline size 1, no
# --no-pipeline-parallel) and with --no-pipeline-parallel. For each layout:
#   1. ACCO, 30-iteration schedule, saved and stopped at iteration 20 (--exit-interval 20);
#   2. the same with ACCO_DS_AUTOPATCH=0 (stock ZeRO-1);
#   3. run 1 resumed from its checkpoint to 30;
#   4. one uninterrupted 30-iteration ACCO run, whose checkpoint must equal run 3's bit for bit;
#   5. the iteration-20 checkpoint's module weights against zero_to_fp32's master weights.
# The case "universal" moves a checkpoint to other layouts instead (global batch 16 throughout):
#   1. acco on DP=2 x TP=2 saved and stopped at 20, and the same run uninterrupted to 30;
#   2. DeepSpeed's ds_to_universal converts the iteration-20 checkpoint;
#   3. resumed from it with Megatron's --universal-checkpoint on DP=2 x TP=1 (2 ranks) and DP=4 x TP=1;
#   4. resumed from the checkpoint itself (acco_ds's resharding load, no conversion) on DP=1 x TP=2;
#   5. diloco (2 replicas x 2 ranks, a sync every 5 inner steps) on DP=4 saved at 20 (and uninterrupted),
#      converted, and resumed on DP=2 (2 replicas x 1) from the universal checkpoint and from the checkpoint.
#   Stock ZeRO-1 (ACCO_DS_AUTOPATCH=0) takes route 1-3 too, as the reference for the universal checkpoint.
# The case "pipeline2" runs pipeline parallel 2 x data parallel 2 x TP 1 on 4 ranks (one transformer layer
# per stage, the word embeddings tied across the first and the last stage), 20 iterations, global batch 16:
#   acco (two flushes of 2 micro-batches per iteration), diloco (replica_group_size 1: 2 replicas of one
#   data-parallel rank with its 2 stages, a sync every 5 inner steps) and stock ZeRO-1 (ACCO_DS_AUTOPATCH=0);
#   acco again, saved and stopped at 10 and resumed to 20: its checkpoint must equal the uninterrupted run's
#   bit for bit, and the module weights must equal zero_to_fp32's master weights.
# The case "moe" trains a mixture of experts on 4 ranks, data parallel 4 x TP 1 with --no-pipeline-parallel
# (Megatron-DeepSpeed's MoE needs the plain engine): --num-experts 4 in every second layer (Megatron's
# --expert-interval 2: the second of the 2 layers), --moe-expert-parallel-size 2 (2 experts per rank), top-1
# gating without token dropping, DeepSpeed's expert param groups (--create-moe-param-group), 20 iterations,
# global batch 16: stock ZeRO-1 (ACCO_DS_AUTOPATCH=0), acco, and diloco (2 replicas of 2 ranks, a sync every
# 5 inner steps; each replica holds all 4 experts). Nothing is saved: DeepSpeed 0.19.8 can neither save nor
# load Megatron's MoE model (stock too; see the comment in moe()).
# The case "decoupled" runs pipeline parallel 2 x data parallel 2 x TP 1 on 4 ranks as two decoupled learners of
# 2 stages each (replica_group_size 1; the launch starts its own 2 syncer shards), a sync every 5 inner steps,
# min_quorum 2 (K = M) and grace_s 0, 20 iterations, global batch 16, beside stock ZeRO-1 (ACCO_DS_AUTOPATCH=0)
# and diloco of the same period: decoupled's lm loss must equal diloco's at every iteration. Nothing is saved.
# Everything goes to $WORK (default /tmp/acco_megatron_layouts); nothing is written into this repository.
#
#   MEGATRON=/path/to/Megatron-DeepSpeed examples/megatron/cpu_layouts.sh [pipeline|no-pipeline|universal|pipeline2|moe|decoupled]...
#
# Same requirements as cpu_smoke.sh. Each layout takes about 15 minutes on 2 cores, "universal" about 6,
# "pipeline2" about 2, "moe" about 3, "decoupled" about 2.
set -euo pipefail
MEGATRON=${MEGATRON:?set MEGATRON to a Megatron-DeepSpeed checkout}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/acco_megatron_layouts}
PORT=${PORT:-29581}
RANKS=4
SAVE_INTERVAL=10
LAYOUT=x
source "$HERE/common.sh"

engines() {  # $1 = a case's folder, rest = its runs whose log must show ACCO's engine line; stock's must not
  local dir=$1 log; shift
  if grep -q '^\[acco_ds\]' "$dir/stock.log"; then echo "ACCO_DS_AUTOPATCH=0 still ran ACCO" >&2; exit 1; fi
  for log in "$@"; do
    grep -q '^\[acco_ds\] ACCO engine:' "$dir/$log.log" || { echo "$log: no '[acco_ds] ACCO engine:' line" >&2; status=1; }
  done
}

universal() {
  local W="$WORK/universal" port=$PORT
  local tp2="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1"
  local tp1="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1"
  mkdir -p "$W"; rm -rf "$W"/ckpt* "$W"/*.log
  config() {  # $1 = file, $2 = gradient_accumulation_steps, $3 = the acco block (micro-batch 2, global batch 16)
    echo "{\"train_micro_batch_size_per_gpu\": 2, \"gradient_accumulation_steps\": $2, \"gradient_clipping\": 1.0,
 \"steps_per_print\": 4, \"zero_optimization\": {\"stage\": 1}, \"acco\": $3}" > "$W/$1"
  }
  config acco_gas2.json 2 '{"enabled": true, "mode": "acco"}'
  config acco_gas4.json 4 '{"enabled": true, "mode": "acco"}'
  config acco_gas8.json 8 '{"enabled": true, "mode": "acco"}'
  config diloco_k2.json 2 '{"enabled": true, "mode": "diloco", "local_sgd": {"sync_every": 5, "replica_group_size": 2}}'
  config diloco_k1.json 4 '{"enabled": true, "mode": "diloco", "local_sgd": {"sync_every": 5, "replica_group_size": 1}}'
  run() {  # $1 = log name, $2 = ranks, $3 = Megatron layout flags, $4 = config file, rest = train's arguments
    local log=$1 ranks=$2 layout=$3 config=$4; shift 4
    port=$((port + 1))
    RANKS=$ranks LAYOUT=$layout DS_CONFIG="$W/$config" GLOBAL_BATCH=16 train 30 "$port" "$@" 2>&1 | tee "$W/$log.log"
  }
  convert() {  # DeepSpeed's own converter; it writes <ckpt>/global_step20_universal and <ckpt>/latest_universal
    python -m deepspeed.checkpoint.ds_to_universal --input_folder "$1/global_step20" \
      --output_folder "$1/global_step20_universal" 2>&1 | tee "$W/convert_$(basename "$1").log"
  }
  run acco 4 "$tp2" acco_gas4.json "$W/ckpt" --exit-interval 20
  run acco_once 4 "$tp2" acco_gas4.json "$W/ckpt_once"
  ACCO_DS_AUTOPATCH=0 run stock 4 "$tp2" acco_gas4.json "$W/ckpt_stock" --exit-interval 20
  convert "$W/ckpt"
  convert "$W/ckpt_stock"
  run universal_dp2_tp1 2 "$tp1" acco_gas4.json "$W/ckpt_u1" --load "$W/ckpt" --universal-checkpoint
  run universal_dp4_tp1 4 "$tp1" acco_gas2.json "$W/ckpt_u2" --load "$W/ckpt" --universal-checkpoint
  ACCO_DS_AUTOPATCH=0 run stock_universal_dp2_tp1 2 "$tp1" acco_gas4.json "$W/ckpt_su" --load "$W/ckpt_stock" \
    --universal-checkpoint
  run native_dp1_tp2 2 "$tp2" acco_gas8.json "$W/ckpt_n1" --load "$W/ckpt"
  run diloco 4 "$tp1" diloco_k2.json "$W/ckpt_diloco" --exit-interval 20
  run diloco_once 4 "$tp1" diloco_k2.json "$W/ckpt_diloco_once"
  convert "$W/ckpt_diloco"
  run diloco_universal_dp2 2 "$tp1" diloco_k1.json "$W/ckpt_du" --load "$W/ckpt_diloco" --universal-checkpoint
  run diloco_native_dp2 2 "$tp1" diloco_k1.json "$W/ckpt_dn" --load "$W/ckpt_diloco"
  if grep -q '^\[acco_ds\]' "$W"/stock*.log; then echo "ACCO_DS_AUTOPATCH=0 still ran ACCO" >&2; exit 1; fi
  echo "== universal: lm loss per iteration (saved at 20; each resume starts at 21) =="
  losses "$W"/acco.log "$W"/acco_once.log "$W"/stock.log "$W"/universal_dp2_tp1.log "$W"/universal_dp4_tp1.log \
    "$W"/stock_universal_dp2_tp1.log "$W"/native_dp1_tp2.log "$W"/diloco.log "$W"/diloco_once.log \
    "$W"/diloco_universal_dp2.log "$W"/diloco_native_dp2.log | tee "$W/losses.txt"
  echo "== universal: what acco_ds said when it loaded =="
  grep -h "ACCO: resharded\|ACCO: loaded the universal" "$W"/*.log | cut -c1-400
}

pipeline2() {
  local W="$WORK/pipeline2" port=$((PORT + 40))
  local pp2="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2"
  mkdir -p "$W"; rm -rf "$W"/ckpt* "$W"/*.log
  echo '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
 "steps_per_print": 4, "zero_optimization": {"stage": 1}, "acco": {"enabled": true, "mode": "acco"}}' > "$W/acco.json"
  echo '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
 "steps_per_print": 4, "zero_optimization": {"stage": 1}, "acco": {"enabled": true, "mode": "diloco",
 "local_sgd": {"sync_every": 5, "replica_group_size": 1}}}' > "$W/diloco.json"
  run() {  # $1 = log name, $2 = config file, rest = train's arguments; 4 ranks, 20 iterations, saved at 10 and 20
    local log=$1 config=$2; shift 2
    port=$((port + 1))
    RANKS=4 LAYOUT=$pp2 DS_CONFIG="$W/$config" GLOBAL_BATCH=16 train 20 "$port" "$W/ckpt_$log" "$@" 2>&1 | tee "$W/$log.log"
  }
  run acco acco.json
  run diloco diloco.json
  ACCO_DS_AUTOPATCH=0 run stock acco.json
  run acco_resume acco.json --exit-interval 10  # saved and stopped at 10, then resumed to 20
  run acco_resumed acco.json --load "$W/ckpt_acco_resume"
  grep -q '^\[acco_ds\] ACCO engine:' "$W/acco.log" || { echo "no '[acco_ds] ACCO engine:' line" >&2; exit 1; }
  if grep -q '^\[acco_ds\]' "$W/stock.log"; then echo "ACCO_DS_AUTOPATCH=0 still ran ACCO" >&2; exit 1; fi
  echo "== pipeline2: lm loss per iteration (PP 2 x DP 2) =="
  losses "$W/acco.log" "$W/diloco.log" "$W/stock.log" "$W/acco_resumed.log" | tee "$W/losses.txt"
  echo "== pipeline2: checkpoint tags =="
  for c in ckpt_acco ckpt_diloco ckpt_stock ckpt_acco_resume ckpt_acco_resumed; do
    echo "$c: $(ls -d "$W/$c"/global_step* | xargs -n1 basename | tr '\n' ' ')"; done
  echo "== pipeline2: acco's iteration-20 checkpoint: module weights against zero_to_fp32, resumed against uninterrupted =="
  python "$HERE/check_checkpoint.py" "$W/ckpt_acco" global_step20 | tee "$W/check20.log" || status=1
  python "$HERE/check_checkpoint.py" "$W/ckpt_acco_resumed" "$W/ckpt_acco" | tee "$W/check_resume.log" || status=1
}

moe() {
  local W="$WORK/moe" port=$((PORT + 60))
  local dp4="--no-pipeline-parallel --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1"
  local experts="--num-experts 4 --moe-expert-parallel-size 2 --topk 1 --disable-moe-token-dropping
    --moe-min-capacity 0 --moe-loss-coeff 0.01 --create-moe-param-group"
  mkdir -p "$W"; rm -f "$W"/*.log
  echo '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
 "steps_per_print": 4, "zero_optimization": {"stage": 1}, "acco": {"enabled": true, "mode": "acco"}}' > "$W/acco.json"
  echo '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
 "steps_per_print": 4, "zero_optimization": {"stage": 1}, "acco": {"enabled": true, "mode": "diloco",
 "local_sgd": {"sync_every": 5, "replica_group_size": 2}}}' > "$W/diloco.json"
  run() {  # $1 = log name, $2 = config file, rest = train's arguments; 4 ranks, 20 iterations, nothing saved
    local log=$1 config=$2; shift 2
    port=$((port + 1))
    # --save '' (an empty checkpoint folder): Megatron saves nothing. DeepSpeed 0.19.8 cannot save a MoE model
    # from Megatron-DeepSpeed, stock ZeRO-1 too: its _save_moe_checkpoint calls dict() on the module's
    # universal_checkpoint_info, which Megatron's GPTModel defines as a method ("'method' object is not
    # iterable"), and refuses that key in Megatron's client_state (README.md, Compatibility).
    # shellcheck disable=SC2086  # experts is a list of flags
    RANKS=4 LAYOUT=$dp4 DS_CONFIG="$W/$config" GLOBAL_BATCH=16 train 20 "$port" "" $experts "$@" 2>&1 | tee "$W/$log.log"
  }
  ACCO_DS_AUTOPATCH=0 run stock acco.json || status=1
  run acco acco.json || status=1
  run diloco diloco.json || status=1
  engines "$W" acco diloco
  echo "== moe: lm loss per iteration (DP 4, 4 experts, expert parallel 2) =="
  losses "$W/stock.log" "$W/acco.log" "$W/diloco.log" | tee "$W/losses.txt"
}

decoupled() {
  local W="$WORK/decoupled" port=$((PORT + 80))
  local pp2="--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2"
  local common='"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
 "steps_per_print": 4, "zero_optimization": {"stage": 1}'
  mkdir -p "$W"; rm -f "$W"/*.log
  echo "{$common, \"acco\": {\"enabled\": true, \"mode\": \"acco\"}}" > "$W/acco.json"
  echo "{$common, \"acco\": {\"enabled\": true, \"mode\": \"diloco\",
 \"local_sgd\": {\"sync_every\": 5, \"replica_group_size\": 1}}}" > "$W/diloco.json"
  echo "{$common, \"acco\": {\"enabled\": true, \"mode\": \"decoupled\",
 \"local_sgd\": {\"sync_every\": 5, \"replica_group_size\": 1, \"min_quorum\": 2, \"grace_s\": 0}}}" > "$W/decoupled.json"
  run() {  # $1 = log name, $2 = config file; 4 ranks, 20 iterations, nothing saved (--save '')
    local log=$1 config=$2; shift 2
    port=$((port + 1))
    RANKS=4 LAYOUT=$pp2 DS_CONFIG="$W/$config" GLOBAL_BATCH=16 train 20 "$port" "" "$@" 2>&1 | tee "$W/$log.log"
  }
  ACCO_DS_AUTOPATCH=0 run stock acco.json || status=1
  run diloco diloco.json || status=1
  run decoupled decoupled.json || status=1
  engines "$W" diloco decoupled
  echo "== decoupled: lm loss per iteration (2 learners of PP 2, K = M = 2, grace_s 0) against diloco =="
  losses "$W/stock.log" "$W/diloco.log" "$W/decoupled.log" | tee "$W/losses.txt"
  python - "$W/losses.txt" <<'PY' || status=1
import sys
rows = [line.split() for line in open(sys.argv[1])]
loss = {}
for r in rows:
    loss.setdefault(r[0], {})[int(r[2])] = r[5]
d, c = loss.get("diloco.log", {}), loss.get("decoupled.log", {})
same = len(d) == 20 and d == c
print(f"decoupled equals diloco at every iteration: {same}")
sys.exit(0 if same else 1)
PY
}

status=0
for layout in "${@:-pipeline no-pipeline}"; do
  for name in $layout; do
    if [ "$name" = universal ]; then universal; continue; fi
    if [ "$name" = pipeline2 ]; then pipeline2; continue; fi
    if [ "$name" = moe ]; then moe; continue; fi
    if [ "$name" = decoupled ]; then decoupled; continue; fi
    case $name in
      pipeline) LAYOUT="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1" ;;
      no-pipeline) LAYOUT="--no-pipeline-parallel --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1" ;;
      *) echo "unknown layout $name (pipeline | no-pipeline | universal | pipeline2 | moe | decoupled)" >&2; exit 2 ;;
    esac
    W="$WORK/$name"; mkdir -p "$W"; rm -rf "$W"/ckpt*
    train 30 "$PORT" "$W/ckpt" --exit-interval 20 2>&1 | tee "$W/acco.log"
    ACCO_DS_AUTOPATCH=0 train 30 "$((PORT + 1))" "$W/ckpt_stock" --exit-interval 20 2>&1 | tee "$W/stock.log"
    python "$HERE/check_checkpoint.py" "$W/ckpt" global_step20 | tee "$W/check20.log" || status=1
    train 30 "$((PORT + 2))" "$W/ckpt" --load "$W/ckpt" 2>&1 | tee "$W/resume.log"
    train 30 "$((PORT + 3))" "$W/ckpt_once" 2>&1 | tee "$W/once.log"
    grep -q '^\[acco_ds\] ACCO engine:' "$W/acco.log" || { echo "no '[acco_ds] ACCO engine:' line" >&2; exit 1; }
    if grep -q '^\[acco_ds\]' "$W/stock.log"; then echo "ACCO_DS_AUTOPATCH=0 still ran ACCO" >&2; exit 1; fi
    echo "== $name: lm loss per iteration =="
    losses "$W/acco.log" "$W/stock.log" "$W/resume.log" "$W/once.log" | tee "$W/losses.txt"
    echo "== $name: checkpoint tags =="
    for c in ckpt ckpt_stock ckpt_once; do echo "$c: $(ls -d "$W/$c"/global_step* | xargs -n1 basename | tr '\n' ' ')"; done
    cat "$W/check20.log"
    python "$HERE/check_checkpoint.py" "$W/ckpt" "$W/ckpt_once" || status=1
    PORT=$((PORT + 10))
  done
done
exit $status
