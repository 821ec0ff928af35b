#!/usr/bin/env bash
# What we run on the H200 before resolving GPU-path work: the whole test suite (the cuda-marked
# tests included), the demo on both devices, a probe of each stage alone, timed runs over a
# generated image set, and a 20,000-image soak that samples device memory.
# Usage (on the GPU machine, with the wheels installed): OUT=/some/dir bash scripts/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpudet-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
quiet() { grep -v -i "deprecat\|_handle_op\|libpng\|jpeg_parser\|libjpeg\|Corrupt JPEG"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, onnxruntime as o, nvidia.dali as d; print('torch', torch.__version__, 'ort', o.__version__, 'dali', d.__version__)" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -rs -p no:cacheprovider tests -s 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED|rows .* D2H|gpu_mem_limit_mb=" | tail -20
$PY -m pipeline detect samples --out "$OUT/demo_cuda" --device cuda --overwrite 2>&1 | quiet | tee "$OUT/demo.txt"
$PY -m pipeline detect samples --out "$OUT/demo_cpu" --device cpu --overwrite 2>&1 | quiet | tee -a "$OUT/demo.txt"
$PY scripts/make_image_set.py /tmp/imgset --count "${COUNT:-4000}" > /dev/null
grep -v png /tmp/imgset/list.txt > /tmp/imgset/jpg.txt
$PY scripts/build_retinaface.py --heads-only 640 640 --out /tmp/heads640.onnx > /dev/null
{
  for bs in 32 64; do
    $PY scripts/probe_stages.py /tmp/imgset/jpg.txt --batch-size $bs
    $PY scripts/probe_stages.py /tmp/imgset/jpg.txt --batch-size $bs --model /tmp/heads640.onnx
  done
} 2>&1 | quiet | tee "$OUT/probe.txt"
for list in list jpg; do
  for bs in 32 64; do
    for rep in 1 2; do
      echo "== $list.txt batch $bs run $rep" | tee -a "$OUT/runs.txt"
      $PY -m pipeline detect /tmp/imgset/$list.txt --out "/tmp/run_${list}_bs$bs" --device cuda --batch-size $bs \
        --overwrite 2>&1 | quiet | tee -a "$OUT/runs.txt"
    done
    cp "/tmp/run_${list}_bs$bs/summary.json" "$OUT/summary_${list}_bs$bs.json"
  done
done
# Soak: 20,000 entries (the JPEG set listed 5 times), device memory sampled every 0.5 s.
for k in 1 2 3 4 5; do sed "s#^#/tmp/imgset/#" /tmp/imgset/jpg.txt; done > /tmp/soak.txt
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > /tmp/mem.csv &
SMI=$!
$PY -m pipeline detect /tmp/soak.txt --out /tmp/soak --device cuda --batch-size 32 --overwrite 2>&1 | quiet | tee "$OUT/soak.txt"
kill $SMI
$PY - <<'PY' | tee -a "$OUT/soak.txt"
m = [int(x) for x in open("/tmp/mem.csv").read().split()]
n = len(m)
print(f"device memory MiB over {n} samples: at 20% {m[n // 5]}, at 50% {m[n // 2]}, at 95% {m[n * 19 // 20]}, peak {max(m)}")
PY
