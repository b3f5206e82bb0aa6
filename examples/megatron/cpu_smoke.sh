#!/usr/bin/env bash
# Megatron-DeepSpeed GPT pre-training with ACCO on CPU: 2 ranks (gloo), a 2-layer GPT on
# byte tokens of the Python standard library. Launched with plain `deepspeed` (no runner): the
# "acco" block of the DeepSpeed config is honoured through acco_ds's start-up hook.
#   1. 12 iterations with ACCO, checkpoints at 6 and 12;
#   2. the same command with ACCO_DS_AUTOPATCH=0 (stock ZeRO-1) for comparison;
#   3. a resume of run 1 to 16 iterations;
#   4. the checkpoint's module weights against DeepSpeed's zero_to_fp32 master weights.
# Everything goes to $WORK (default /tmp/acco_megatron); nothing is written into this repository.
# Checked with Megatron-DeepSpeed 4efb479d, DeepSpeed 0.19.8, torch 2.13.0+cpu.
#
#   MEGATRON=/path/to/Megatron-DeepSpeed examples/megatron/cpu_smoke.sh
#
# Needs acco_ds installed (`pip install -e .`: that installs the start-up hook), `pip install nltk
# pybind11 six` (Megatron's preprocess_data.py, its dataset index helpers, its tokenizer module),
# a C++ compiler, and the `.view` -> `.reshape` fix below.
set -euo pipefail
MEGATRON=${MEGATRON:?set MEGATRON to a Megatron-DeepSpeed checkout}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/acco_megatron}
PORT=${PORT:-29561}
source "$HERE/common.sh"

rm -rf "$WORK/ckpt" "$WORK/ckpt_stock"
train 12 "$PORT" "$WORK/ckpt" 2>&1 | tee "$WORK/train.log"
ACCO_DS_AUTOPATCH=0 train 12 "$((PORT + 1))" "$WORK/ckpt_stock" 2>&1 | tee "$WORK/stock.log"
# 3. Resume from the iteration-12 checkpoint and go on to 16 (the LR schedule's length changes,
#    which Megatron only accepts with --override-opt_param-scheduler).
train 16 "$((PORT + 2))" "$WORK/ckpt" --load "$WORK/ckpt" --override-opt_param-scheduler 2>&1 | tee "$WORK/resume.log"

echo
grep -q '^\[acco_ds\] ACCO engine:' "$WORK/train.log" || { echo "no '[acco_ds] ACCO engine:' line: acco_ds's start-up hook is not installed (pip install -e <acco_ds>)" >&2; exit 1; }
if grep -q '^\[acco_ds\]' "$WORK/stock.log"; then echo "ACCO_DS_AUTOPATCH=0 still ran ACCO" >&2; exit 1; fi
echo "== per iteration: lm loss (learning rate), skipped; ACCO's start-up iteration commits nothing =="
losses "$WORK/train.log" "$WORK/stock.log" "$WORK/resume.log"
echo "== DeepSpeed checkpoint tags (global_stepK: K optimizer steps applied) =="
echo "ACCO: $(ls -d "$WORK"/ckpt/global_step* | xargs -n1 basename | tr '\n' ' ')  stock: $(ls -d "$WORK"/ckpt_stock/global_step* | xargs -n1 basename | tr '\n' ' ')"
echo "== checkpoint module weights vs zero_to_fp32 master weights (ACCO, after the resume) =="
python "$HERE/check_checkpoint.py" "$WORK/ckpt"
