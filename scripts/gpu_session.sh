#!/usr/bin/env bash
# What we run on the H200 before resolving GPU-path work: the whole test suite (the cuda-marked
# tests included), the demo on both devices, and a timed run over a generated image set.
# Usage (on the GPU machine, after the wheels are installed): OUT=/some/dir bash scripts/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpudet-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, onnxruntime as o, nvidia.dali as d; print('torch', torch.__version__, 'ort', o.__version__, 'dali', d.__version__)" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -rs -p no:cacheprovider tests -s 2>&1 | tee "$OUT/pytest.log" | tail -25
$PY -m pipeline detect samples --out "$OUT/demo_cuda" --device cuda
$PY -m pipeline detect samples --out "$OUT/demo_cpu" --device cpu
$PY scripts/make_image_set.py /tmp/imgset --count "${COUNT:-4000}" > /dev/null
for bs in 32 64; do
  $PY -m pipeline detect /tmp/imgset/list.txt --out "/tmp/run_bs$bs" --device cuda --batch-size $bs
  $PY -m pipeline detect /tmp/imgset/list.txt --out "/tmp/run_bs$bs" --device cuda --batch-size $bs
  cp "/tmp/run_bs$bs/summary.json" "$OUT/summary_cuda_bs$bs.json"
done
