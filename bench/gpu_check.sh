#!/usr/bin/env bash
# The CUDA paths, on a machine with one NVIDIA GPU (run by hand when one is lent; CI never has one):
#   1. the demo (built-in GPT, float32) on cuda, twice: bit-identical metrics? and once with
#      train.cuda_deterministic=false: seconds per step against the deterministic kernels
#   2. GRPO on a ~60M-parameter Llama (random weights, built here) in bfloat16 on cuda: 5 steps twice, and
#      3 steps + resume to 5: bit-identical? seconds per step.
# vLLM on a GPU is not part of it: the vllm wheel (hundreds of MB) cannot reach a machine without a network.
#     OUT=/tmp/gpu bash bench/gpu_check.sh        (PY=python3 by default; grpolab from this checkout)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
run() { $PY -m grpolab.cli train "$@" log.level=quiet; }
steps() { $PY -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; r=[x for x in r if 'time/step' in x]; t=sorted(x['time/step'] for x in r[1:]);
print(sys.argv[1].split('/')[-2], 'median s/step (after the first):', round(t[len(t)//2], 3), '| reward first/last:',
      round(r[0]['reward'], 3), round(r[-1]['reward'], 3))" "$1"; }

for r in a b; do
  SECONDS=0; run configs/demo.yaml model.device=cuda train.max_steps=30 train.output_dir="$OUT/demo_$r"
  echo "demo_$r: $SECONDS s wall"
done
$PY scripts/compare_runs.py "$OUT/demo_a" "$OUT/demo_b" | tail -3; echo "demo bit-identical rc=${PIPESTATUS[0]}"
SECONDS=0; run configs/demo.yaml model.device=cuda train.max_steps=30 train.output_dir="$OUT/demo_nd" \
  train.cuda_deterministic=false; echo "demo_nd (non-deterministic kernels): $SECONDS s wall"
steps "$OUT/demo_a/metrics.jsonl"; steps "$OUT/demo_nd/metrics.jsonl"

$PY -c "from grpolab.models.tiny_hf import save_tiny_model as s; s('$OUT/llama', vocab_size=4096, hidden=512,
layers=8, heads=8, intermediate=1408)"
HF=(configs/demo.yaml model.name_or_path="$OUT/llama" model.dtype=bfloat16 model.device=cuda sft.steps=0
    data.task=arithmetic reward.functions=[length] rollout.prompts_per_step=16 rollout.num_generations=8
    rollout.max_new_tokens=64 algorithm.beta=0.04 optim.lr=1e-5 eval.num_problems=32 eval.k=2 train.save_every=3)
run "${HF[@]}" train.max_steps=5 train.output_dir="$OUT/bf16_a"
run "${HF[@]}" train.max_steps=5 train.output_dir="$OUT/bf16_b"
$PY scripts/compare_runs.py "$OUT/bf16_a" "$OUT/bf16_b" | tail -3; echo "bf16 repeat bit-identical rc=${PIPESTATUS[0]}"
run "${HF[@]}" train.max_steps=3 train.output_dir="$OUT/bf16_c"
run "${HF[@]}" train.max_steps=5 train.output_dir="$OUT/bf16_c" train.resume=auto
$PY scripts/compare_runs.py "$OUT/bf16_a" "$OUT/bf16_c" | tail -3; echo "bf16 resume bit-identical rc=${PIPESTATUS[0]}"
steps "$OUT/bf16_a/metrics.jsonl"
