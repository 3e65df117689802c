#!/usr/bin/env bash
# The engine on a GPU in one prepared run: where it syncs, where a decode step's time goes,
# the engine's own Llama pass against the module forward (ops and time per decode step),
# whether its greedy tokens are `generate`'s, bench/engine_throughput.py's rows c and d in
# bfloat16 at c = 1, 32, 64, and a 50 ms step-time target against none (its price there).
#
#   bash bench/gpu_session.sh LIKE OUT
#
# LIKE: a folder with SmolLM2's config and tokenizer (the default model's converted folder, or
# those files alone); OUT: where the tables go. The weights are random (bench/random_model.py):
# with ignore_eos the work per token depends on the shapes alone, and a GPU machine reached
# through a small transfer cannot receive the real ones. Two models: SmolLM2-135M's shapes and
# SmolLM2-1.7B's (same family, 24 layers of 2048).
set -u
LIKE=${1:?a folder with the config and tokenizer}
OUT=${2:-/tmp/gpu_session}
PY=${PYTHON:-python3}
MODELS=${MODELS_DIR:-/tmp/gpu_models}
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" "$MODELS"
cd "$(dirname "$0")/.."

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

$PY bench/random_model.py --like "$LIKE" --out "$MODELS/smollm2-135m" --device cuda
$PY bench/random_model.py --like "$LIKE" --out "$MODELS/smollm2-1.7b" --device cuda \
    --set hidden_size=2048 --set intermediate_size=8192 --set num_hidden_layers=24 \
    --set num_attention_heads=32 --set num_key_value_heads=32

echo "== synchronizing calls, 135M, bfloat16, 32 requests"
timeout 120 $PY bench/device_syncs.py --model "$MODELS/smollm2-135m" --concurrency 32 \
    2>"$OUT/syncs.err" | tee "$OUT/syncs.txt"

echo "== a decode step's time, 135M, bfloat16"
timeout 90 $PY bench/device_profile.py --model "$MODELS/smollm2-135m" --concurrency 1,64 \
    2>"$OUT/profile.err" | tee "$OUT/profile.txt"

echo "== the engine's own Llama pass against the module forward, 135M, bfloat16"
timeout 120 $PY bench/step_ops.py --model "$MODELS/smollm2-135m" --device cuda \
    --dtype bfloat16 --concurrency 1,64 2>"$OUT/step_ops.err" | tee "$OUT/step_ops.txt"

for model in smollm2-135m smollm2-1.7b; do
    echo "== engine_throughput, $model"
    timeout 200 $PY bench/engine_throughput.py --device cuda --model "$MODELS/$model" \
        --rows c,d --dtype bfloat16 --concurrency 1,32,64 --json "$OUT/$model.json" \
        2>"$OUT/$model.err" | tee "$OUT/$model.txt"
    if [ "$model" = smollm2-135m ]; then
        echo "== greedy against generate, 135M, float32"
        timeout 90 $PY bench/device_greedy.py --model "$MODELS/$model" --dtype float32 \
            2>"$OUT/greedy.err" | tee "$OUT/greedy.txt"
    fi
done

# off by default on CUDA (workers/config.py): row d with a 50 ms target against d-fixed
echo "== the step-time target, 135M: row d with a 50 ms target, and d-fixed"
timeout 120 $PY bench/engine_throughput.py --device cuda --model "$MODELS/smollm2-135m" \
    --rows d,d-fixed --step-time-target 0.05 --dtype bfloat16 --concurrency 32,64 \
    2>"$OUT/target.err" | tee "$OUT/target.txt"
