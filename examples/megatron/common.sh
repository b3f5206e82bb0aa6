# Sourced by cpu_smoke.sh and cpu_layouts.sh: the checkout check, the environment, the byte-level
# dataset, the DeepSpeed config and `train`, which runs Megatron-DeepSpeed's pretrain_gpt.py with the
# plain `deepspeed` launcher. Expects MEGATRON, HERE, WORK; RANKS (default 2) and LAYOUT (Megatron's
# parallelism flags; default TP=1 with --no-pipeline-parallel) may be set by the caller, and per call
# DS_CONFIG (a DeepSpeed config file) and GLOBAL_BATCH (default 8 per data-parallel rank).
RANKS=${RANKS:-2}
LAYOUT=${LAYOUT:---no-pipeline-parallel --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1}
SAVE_INTERVAL=${SAVE_INTERVAL:-6}
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

# A tiny indexed dataset: byte values of stdlib sources, NullTokenizer (vocab 256, no download).
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

# micro-batch 2 x 4 accumulation x data-parallel ranks = Megatron's --global-batch-size.
cat > "$WORK/ds_config_acco_cpu.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
 "steps_per_print": 4, "zero_optimization": {"stage": 1},
 "acco": {"enabled": true, "mode": "acco", "accumulation": "fixed"}}
JSON

train() {  # $1 = --train-iters, $2 = port, $3 = checkpoint folder, rest = extra Megatron flags
  local iters=$1 port=$2 ckpt=$3; shift 3
  local dp=$((RANKS / $(echo "$LAYOUT" | sed -n 's/.*--tensor-model-parallel-size \([0-9]*\).*/\1/p')))
  # shellcheck disable=SC2086  # LAYOUT is a list of flags
  (cd "$MEGATRON" && timeout 900 deepspeed --num_gpus "$RANKS" --master_port "$port" pretrain_gpt.py $LAYOUT \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 2 --global-batch-size "${GLOBAL_BATCH:-$((8 * dp))}" --train-iters "$iters" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 \
    --data-path "$WORK/bytes_text_document" --tokenizer-type NullTokenizer --vocab-size 256 \
    --split 98,2,0 --log-interval 1 --eval-interval 1000 --eval-iters 1 \
    --distributed-backend gloo --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion \
    --no-gradient-accumulation-fusion --use-cpu-initialization --attention-dropout 0 --hidden-dropout 0 \
    --save "$ckpt" --save-interval "$SAVE_INTERVAL" \
    --deepspeed --deepspeed_config "${DS_CONFIG:-$WORK/ds_config_acco_cpu.json}" "$@")
}

losses() {  # per-iteration lm loss, learning rate and skipped count from Megatron's logs
  python - "$@" <<'PY'
import re, sys
for path in sys.argv[1:]:
    for line in open(path, errors="replace"):
        it = re.search(r"iteration\s+(\d+)/\s*(\d+) \|", line)
        if it:
            loss = re.search(r"lm loss: ([0-9.E+-]+)", line)
            lr = re.search(r"learning rate: ([0-9.E+-]+)", line)
            skipped = re.search(r"number of skipped iterations:\s+(\d+)", line)
            print(f"{path.rsplit('/', 1)[-1]:<14} iteration {it.group(1):>3}  lm loss {loss.group(1) if loss else '-':<13}"
                  f"  lr {lr.group(1)}  skipped {skipped.group(1) if skipped else '?'}")
PY
}
