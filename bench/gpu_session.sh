#!/usr/bin/env bash
# The engine on a GPU in one prepared run (under 10 minutes): where it syncs, where a decode
# step's time goes and how many launches it takes with CUDA graphs and without
# (workers/decode_graphs.py), whether its greedy tokens are `generate`'s (graphs on, the
# default), whether torch.compile's fused element-wise chains save GPU time inside a graph
# (bench/elementwise_fusion.py), bench/engine_throughput.py's rows d (graphs), d-eager (no
# graphs) and c (transformers CB) in bfloat16 at c = 1, 32, 64, and last the step-time target
# under Poisson arrivals with launches priced apart (rows d, d-fixed). The engine's own Llama
# pass against the module forward (bench/step_ops.py) was measured in an earlier run
# (docs/performance/history.md) and is left out to keep the run short.
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
timeout 45 $PY bench/device_syncs.py --model "$MODELS/smollm2-135m" --concurrency 32 \
    2>"$OUT/syncs.err" | tee "$OUT/syncs.txt"

echo "== a decode step's time and launches, 135M, bfloat16, CUDA graphs on and off"
timeout 90 $PY bench/device_profile.py --model "$MODELS/smollm2-135m" --concurrency 1,64 \
    --graphs on,off 2>"$OUT/profile.err" | tee "$OUT/profile.txt"

echo "== greedy against generate, 135M, float32 (decode steps through the graphs)"
timeout 45 $PY bench/device_greedy.py --model "$MODELS/smollm2-135m" --dtype float32 \
    2>"$OUT/greedy.err" | tee "$OUT/greedy.txt"

echo "== element-wise chains, eager against torch.compile, inside a CUDA graph, 135M widths"
timeout 40 $PY bench/elementwise_fusion.py --device cuda --dtype bfloat16 --tokens 64 \
    2>"$OUT/fusion.err" | tee "$OUT/fusion.txt"

# rows d (graphs) and d-eager first: the comparison this run is for; c last (a cut keeps d's)
echo "== engine_throughput, smollm2-135m"
timeout 180 $PY bench/engine_throughput.py --device cuda --model "$MODELS/smollm2-135m" \
    --rows d,d-eager,c --dtype bfloat16 --concurrency 1,32,64 \
    --json "$OUT/smollm2-135m.json" 2>"$OUT/smollm2-135m.err" | tee "$OUT/smollm2-135m.txt"

echo "== engine_throughput, smollm2-1.7b"
timeout 120 $PY bench/engine_throughput.py --device cuda --model "$MODELS/smollm2-1.7b" \
    --rows d,d-eager --dtype bfloat16 --concurrency 1,32,64 \
    --json "$OUT/smollm2-1.7b.json" 2>"$OUT/smollm2-1.7b.err" | tee "$OUT/smollm2-1.7b.txt"

# the step-time target on CUDA with launches priced apart (workers/step_time.py): a replayed
# decode step teaches only the cadence; d-fixed (no target) beside it, Poisson arrivals
echo "== step-time target, smollm2-135m, Poisson arrivals"
timeout 50 $PY bench/engine_throughput.py --device cuda --model "$MODELS/smollm2-135m" \
    --rows d,d-fixed --dtype bfloat16 --concurrency 32 --arrivals poisson --rate 40 \
    --requests 64 --step-time-target 0.05 \
    2>"$OUT/step-target.err" | tee "$OUT/step-target.txt"
