#!/usr/bin/env bash
# Megatron-DeepSpeed's pretrain_gpt.py with ACCO in the layouts its users train in, on 4 CPU ranks:
# data parallel 2 x tensor parallel 2, with Megatron's default PipelineEngine (pipeline size 1, no
# --no-pipeline-parallel) and with --no-pipeline-parallel. For each layout:
#   1. ACCO, 30-iteration schedule, saved and stopped at iteration 20 (--exit-interval 20);
#   2. the same with ACCO_DS_AUTOPATCH=0 (stock ZeRO-1);
#   3. run 1 resumed from its checkpoint to 30;
#   4. one uninterrupted 30-iteration ACCO run, whose checkpoint must equal run 3's bit for bit;
#   5. the iteration-20 checkpoint's module weights against zero_to_fp32's master weights.
# Everything goes to $WORK (default /tmp/acco_megatron_layouts); nothing is written into this repository.
#
#   MEGATRON=/path/to/Megatron-DeepSpeed examples/megatron/cpu_layouts.sh [pipeline|no-pipeline]...
#
# Same requirements as cpu_smoke.sh. Each layout takes about 15 minutes on 2 cores.
set -euo pipefail
MEGATRON=${MEGATRON:?set MEGATRON to a Megatron-DeepSpeed checkout}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/acco_megatron_layouts}
PORT=${PORT:-29581}
RANKS=4
SAVE_INTERVAL=10
LAYOUT=x
source "$HERE/common.sh"

status=0
for layout in "${@:-pipeline no-pipeline}"; do
  for name in $layout; do
    case $name in
      pipeline) LAYOUT="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1" ;;
      no-pipeline) LAYOUT="--no-pipeline-parallel --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1" ;;
      *) echo "unknown layout $name (pipeline | no-pipeline)" >&2; exit 2 ;;
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
