#!/usr/bin/env bash
# What we run on the H200 before resolving GPU-path work: the whole test suite (the cuda-marked
# tests included), the demo on both devices, a probe of each stage alone, and timed runs over a
# generated image set. Usage (on the GPU machine, with the wheels installed):
#   OUT=/some/dir bash scripts/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpudet-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, onnxruntime as o, nvidia.dali as d; print('torch', torch.__version__, 'ort', o.__version__, 'dali', d.__version__)" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -rs -p no:cacheprovider tests -s 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED|rows .* D2H" | tail -20
$PY -m pipeline detect samples --out "$OUT/demo_cuda" --device cuda | tee "$OUT/demo.txt"
$PY -m pipeline detect samples --out "$OUT/demo_cpu" --device cpu | tee -a "$OUT/demo.txt"
$PY scripts/make_image_set.py /tmp/imgset --count "${COUNT:-4000}" > /dev/null
$PY scripts/build_retinaface.py --heads-only 640 640 --out /tmp/heads640.onnx > /dev/null
{
  for bs in 32 64; do
    $PY scripts/probe_stages.py /tmp/imgset/list.txt --batch-size $bs
    $PY scripts/probe_stages.py /tmp/imgset/list.txt --batch-size $bs --cuda-option cudnn_conv_algo_search=HEURISTIC
    $PY scripts/probe_stages.py /tmp/imgset/list.txt --batch-size $bs --cuda-option prefer_nhwc=1
    $PY scripts/probe_stages.py /tmp/imgset/list.txt --batch-size $bs --model /tmp/heads640.onnx
  done
} 2>&1 | grep -v -i "deprecat\|_handle_op" | tee "$OUT/probe.txt"
for bs in 32 64; do
  for rep in 1 2; do
    $PY -m pipeline detect /tmp/imgset/list.txt --out "/tmp/run_bs$bs" --device cuda --batch-size $bs | tee -a "$OUT/runs.txt"
  done
  cp "/tmp/run_bs$bs/summary.json" "$OUT/summary_cuda_bs$bs.json"
done
