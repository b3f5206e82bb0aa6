#!/usr/bin/env bash
# GPT pre-training with Megatron-DeepSpeed and ACCO: the "acco" block of ds_config_acco.json turns it on
# (acco_ds must be pip-installed: its startup hook patches deepspeed.initialize; with acco_ds only on
# PYTHONPATH, launch with `deepspeed --module acco_ds.cli.run pretrain_gpt.py ...` instead).
# Run from a Megatron-DeepSpeed checkout (not vendored here): MEGATRON=/path/to/Megatron-DeepSpeed
# DATA_PREFIX must point at an indexed dataset made with Megatron's tools/preprocess_data.py.
set -euo pipefail
MEGATRON=${MEGATRON:?set MEGATRON to a Megatron-DeepSpeed checkout}
DATA_PREFIX=${DATA_PREFIX:?set DATA_PREFIX to an indexed dataset prefix}
HERE=$(cd "$(dirname "$0")" && pwd)
NGPUS=${NGPUS:-2}
MICRO=4; GAS=8; GLOBAL=$((MICRO * GAS * NGPUS))   # must agree with ds_config_acco.json

REPO=$(cd "$HERE/../.." && pwd)
# compat/: stand-ins for imports DeepSpeed 0.19 removed (see README).
export PYTHONPATH="$HERE/compat:$MEGATRON${PYTHONPATH:+:$PYTHONPATH}"
python -c "import acco_ds._autopatch" 2>/dev/null || { echo "install acco_ds first: pip install -e $REPO" >&2; exit 1; }

cd "$MEGATRON"
deepspeed --num_gpus "$NGPUS" pretrain_gpt.py \
  --no-pipeline-parallel \
  --tensor-model-parallel-size 1 \
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
  --seq-length 1024 --max-position-embeddings 1024 \
  --micro-batch-size $MICRO --global-batch-size $GLOBAL \
  --train-iters 2000 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 100 \
  --weight-decay 0.1 --clip-grad 1.0 --bf16 \
  --data-path "$DATA_PREFIX" --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
  --split 98,2,0 --log-interval 10 --eval-interval 200 --eval-iters 10 \
  --deepspeed --deepspeed_config "$HERE/ds_config_acco.json" \
  ${EXTRA_ARGS:-}
# On CPU (no GPU): DS_ACCELERATOR=cpu, drop --bf16 (and "bf16" in the config), and add
#   --distributed-backend gloo --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
#   --no-gradient-accumulation-fusion --use-cpu-initialization
