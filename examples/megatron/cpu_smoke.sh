#!/usr/bin/env bash
# Megatron-DeepSpeed GPT pre-training with ACCO on CPU: 2 ranks (gloo), a 2-layer GPT on
# byte tokens of the Python standard library, 12 iterations with checkpoints, then a resume
# to 16 iterations. Everything goes to $WORK (default /tmp/acco_megatron); nothing is written
# into this repository. Checked with Megatron-DeepSpeed f4157bea and DeepSpeed 0.19.8.
#
#   MEGATRON=/path/to/Megatron-DeepSpeed examples/megatron/cpu_smoke.sh
#
# Needs, on top of acco_ds's environment: `pip install nltk pybind11` (Megatron's
# preprocess_data.py and its dataset index helpers), and the `.view` -> `.reshape` fix below.
set -euo pipefail
MEGATRON=${MEGATRON:?set MEGATRON to a Megatron-DeepSpeed checkout}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
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
export PYTHONPATH="$HERE/compat:$MEGATRON:$REPO${PYTHONPATH:+:$PYTHONPATH}"

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
 "steps_per_print": 1, "zero_optimization": {"stage": 1},
 "acco": {"enabled": true, "mode": "acco", "accumulation": "fixed"}}
JSON

train() {  # $1 = --train-iters, $2 = port, rest = extra Megatron flags
  local iters=$1 port=$2; shift 2
  (cd "$MEGATRON" && timeout 600 deepspeed --num_gpus 2 --master_port "$port" --module acco_ds.run pretrain_gpt.py \
    --no-pipeline-parallel --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 2 --global-batch-size 16 --train-iters "$iters" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 \
    --data-path "$WORK/bytes_text_document" --tokenizer-type NullTokenizer --vocab-size 256 \
    --split 98,2,0 --log-interval 1 --eval-interval 1000 --eval-iters 1 \
    --distributed-backend gloo --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion \
    --no-gradient-accumulation-fusion --use-cpu-initialization --attention-dropout 0 --hidden-dropout 0 \
    --save "$WORK/ckpt" --save-interval 6 \
    --deepspeed --deepspeed_config "$WORK/ds_config_acco_cpu.json" "$@")
}

rm -rf "$WORK/ckpt"
train 12 "$PORT" 2>&1 | tee "$WORK/train.log"
# 3. Resume from the iteration-12 checkpoint and go on to 16 (the LR schedule's length changes,
#    which Megatron only accepts with --override-opt_param-scheduler).
train 16 "$((PORT + 1))" --load "$WORK/ckpt" --override-opt_param-scheduler 2>&1 | tee "$WORK/resume.log"

echo
echo "== per iteration: lm loss, skipped (ACCO's start-up iteration commits nothing) =="
python - "$WORK/train.log" "$WORK/resume.log" <<'PY'
import re, sys
for path in sys.argv[1:]:
    for line in open(path, errors="replace"):
        it = re.search(r"iteration\s+(\d+)/\s*(\d+) \|", line)
        if it:
            loss = re.search(r"lm loss: ([0-9.E+-]+)", line)
            skipped = re.search(r"number of skipped iterations:\s+(\d+)", line)
            print(f"{path.rsplit('/', 1)[-1]:<11} iteration {it.group(1):>3}  lm loss {loss.group(1) if loss else '-':<13}"
                  f"  skipped {skipped.group(1) if skipped else '?'}")
PY
echo "== DeepSpeed checkpoint tags (global_step = ACCO engine's committed steps) =="
ls "$WORK/ckpt"
