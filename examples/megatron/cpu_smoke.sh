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
mkdir -p "$WORK"

# Megatron's CoreAttention calls .view on tensors that recent PyTorch leaves non-contiguous.
if grep -q "query_layer = query_layer.view(output_size\[2\]" "$MEGATRON/megatron/model/transformer.py"; then
  echo "Megatron's megatron/model/transformer.py still calls .view on non-contiguous tensors; fix it with:" >&2
  echo "  sed -i -e 's/query_layer = query_layer.view(output_size\[2\]/query_layer = query_layer.reshape(output_size[2]/' \\" >&2
  echo "         -e 's/key_layer = key_layer.view(output_size\[3\]/key_layer = key_layer.reshape(output_size[3]/' \\" >&2
  echo "         -e 's/value_layer = value_layer.view(value_layer.size(0)/value_layer = value_layer.reshape(value_layer.size(0)/' \\" >&2
  echo "         $MEGATRON/megatron/model/transformer.py" >&2
  exit 2
fi

export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
export PYTHONPATH="$HERE/compat:$MEGATRON${PYTHONPATH:+:$PYTHONPATH}"

# 1. A tiny indexed dataset: byte values of stdlib sources, NullTokenizer (vocab 256, no download).
if [ ! -f "$WORK/bytes_text_document.idx" ]; then
  python - "$WORK/corpus.jsonl" <<'PY'
import json, os, sys, sysconfig
std = sysconfig.get_paths()["stdlib"]
with open(sys.argv[1], "w") as f:
    for name in ["argparse.py", "json/decoder.py", "textwrap.py", "string.py", "this.py", "functools.py",
                 "dataclasses.py", "typing.py"]:
        data = open(os.path.join(std, name), "rb").read()
        for i in range(0, len(data), 2048):
            f.write(json.dumps({"text": " ".join(str(b) for b in data[i:i + 2048])}) + "\n")
PY
  (cd "$MEGATRON" && python tools/preprocess_data.py --input "$WORK/corpus.jsonl" --tokenizer-type NullTokenizer \
     --vocab-size 256 --output-prefix "$WORK/bytes" --workers 1 --append-eod)
fi

# 2. micro-batch 2 x 4 accumulation x 2 ranks = global batch 16 (must match the Megatron flags).
cat > "$WORK/ds_config_acco_cpu.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
 "steps_per_print": 4, "zero_optimization": {"stage": 1},
 "acco": {"enabled": true, "mode": "acco", "accumulation": "fixed"}}
JSON

train() {  # $1 = --train-iters, $2 = port, $3 = checkpoint folder, rest = extra Megatron flags
  local iters=$1 port=$2 ckpt=$3; shift 3
  (cd "$MEGATRON" && timeout 600 deepspeed --num_gpus 2 --master_port "$port" pretrain_gpt.py \
    --no-pipeline-parallel --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 2 --global-batch-size 16 --train-iters "$iters" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 \
    --data-path "$WORK/bytes_text_document" --tokenizer-type NullTokenizer --vocab-size 256 \
    --split 98,2,0 --log-interval 1 --eval-interval 1000 --eval-iters 1 \
    --distributed-backend gloo --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion \
    --no-gradient-accumulation-fusion --use-cpu-initialization --attention-dropout 0 --hidden-dropout 0 \
    --save "$ckpt" --save-interval 6 \
    --deepspeed --deepspeed_config "$WORK/ds_config_acco_cpu.json" "$@")
}

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
python - "$WORK/train.log" "$WORK/stock.log" "$WORK/resume.log" <<'PY'
import re, sys
for path in sys.argv[1:]:
    for line in open(path, errors="replace"):
        it = re.search(r"iteration\s+(\d+)/\s*(\d+) \|", line)
        if it:
            loss = re.search(r"lm loss: ([0-9.E+-]+)", line)
            lr = re.search(r"learning rate: ([0-9.E+-]+)", line)
            skipped = re.search(r"number of skipped iterations:\s+(\d+)", line)
            print(f"{path.rsplit('/', 1)[-1]:<11} iteration {it.group(1):>3}  lm loss {loss.group(1) if loss else '-':<13}"
                  f"  lr {lr.group(1)}  skipped {skipped.group(1) if skipped else '?'}")
PY
echo "== DeepSpeed checkpoint tags (global_stepK: K optimizer steps applied) =="
echo "ACCO: $(ls -d "$WORK"/ckpt/global_step* | xargs -n1 basename | tr '\n' ' ')  stock: $(ls -d "$WORK"/ckpt_stock/global_step* | xargs -n1 basename | tr '\n' ' ')"
echo "== checkpoint module weights vs zero_to_fp32 master weights (ACCO, after the resume) =="
python - "$WORK/ckpt" <<'PY'
import sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
ckpt = sys.argv[1]
tag = open(f"{ckpt}/latest").read().strip()
sd = torch.load(f"{ckpt}/{tag}/mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
flat = {}
def walk(d, pre=""):
    for k, v in d.items():
        if isinstance(v, dict):
            walk(v, pre + k + ".")
        elif torch.is_tensor(v):
            flat[pre + k] = v
walk(sd["module"])
master = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag)
assert set(flat) == set(master), set(flat) ^ set(master)
diff = {k: (v.float() - master[k].to(v.dtype).float()).abs().max().item() for k, v in flat.items()}
print(f"{tag}: {len(diff)} tensors, max abs difference {max(diff.values()):.3e} "
      f"(LR scheduler at {sd['lr_scheduler']['num_steps']} samples, global_steps {sd['global_steps']})")
PY
