#!/usr/bin/env bash
# What we run on a GPU machine before a change to the GPU path lands, and where docs/BENCHMARKS.md's
# numbers come from. Needs gpudet's dependencies importable (PYTHONPATH) and nvidia-smi.
#
#   OUT=DIR bash scripts/gpu_check.sh tests       # the cuda-marked tests (TESTS="a.py b.py::test": only those)
#   OUT=DIR bash scripts/gpu_check.sh retinaface  # gpudet bench per config, then the default detect over 106,288 images
#   OUT=DIR bash scripts/gpu_check.sh retinanet   # scripts/bench_retinanet.py at the realistic load
#   OUT=DIR bash scripts/gpu_check.sh ray         # --ray --workers 1 against one process, JSONL and Parquet
#
# BEFORE=DIR (a checkout's root) also benches that tree's configs beside this one, for before/after.
set -uo pipefail
OUT=${OUT:-/tmp/gpudet-check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGES=${IMAGES:-/tmp/gpudet-images}
quiet() { grep -v -i "deprecat\|_handle_op\|libpng\|jpeg_parser\|libjpeg\|Corrupt JPEG\|TracerWarning\|warnings.warn"; }

image_set() {  # the JPEGs of scripts/make_image_set.py (crops of the bundled photos, 480-1024 px), absolute paths
  [ -f "$IMAGES/jpg.txt" ] && return
  $PY "$ROOT/scripts/make_image_set.py" "$IMAGES" --count "${COUNT:-4000}" > /dev/null
  grep -v png "$IMAGES/list.txt" | sed "s#^#$IMAGES/#" > "$IMAGES/jpg.txt"
  for _ in $(seq 28); do cat "$IMAGES/jpg.txt"; done > "$IMAGES/jpg_x28.txt"
}

versions() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, onnxruntime as o, nvidia.dali as d; print('torch', torch.__version__, 'ort', o.__version__, \
'dali', d.__version__, 'cores', __import__('os').cpu_count())"
}

case "${1:-}" in
  tests)
    versions | tee "$OUT/versions.txt"
    # pytest-xdist: several test processes share the GPU
    $PY -m pytest -q -rs -p no:cacheprovider ${JOBS:+-n $JOBS} -m "${MARK:-cuda}" --durations=8 ${TESTS:-$ROOT/tests} \
      2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED|ERROR" | tail -30
    ;;
  retinaface)
    versions | tee "$OUT/versions.txt"
    image_set
    for run in ${RUNS:-"now:retinaface_mnet025" "now:retinaface_mnet025_e2e"}; do  # TREE:CONFIG[,key=value...]
      tree=${run%%:*}; spec=${run#*:}; cfg=${spec%%,*}
      sets=$(echo "$spec" | tr ',' '\n' | tail -n +2 | sed 's/^/--set /' | tr '\n' ' ')
      home=$ROOT; [ "$tree" = before ] && home=$BEFORE
      tag=$(echo "${tree}_$spec" | tr -c '[:alnum:]_\n' '_')
      (cd "$home" && PYTHONPATH="$home:${PYTHONPATH:-}" $PY -m pipeline bench "$IMAGES/jpg.txt" --config \
        "configs/$cfg.yaml" --device cuda --limit 4000 --passes "${PASSES:-3}" --naive-limit 300 $sets \
        --json "$OUT/bench_$tag.json") 2>&1 | quiet | tee -a "$OUT/bench.txt"
    done
    # The default command over 106,288 images, timed from the shell: what a user meets.
    start=$(date +%s%N)
    $PY -m pipeline detect "$IMAGES/jpg_x28.txt" --out /tmp/gpudet-x28 --overwrite 2>&1 | quiet | tee "$OUT/detect_x28.txt"
    elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf 'wall clock from the shell: %d.%03d s\n' $((elapsed_ms / 1000)) $((elapsed_ms % 1000)) | tee -a "$OUT/detect_x28.txt"
    cp /tmp/gpudet-x28/summary.json "$OUT/detect_x28_summary.json"
    ;;
  retinanet)
    versions | tee "$OUT/versions.txt"
    image_set
    $PY "$ROOT/scripts/bench_retinanet.py" "$IMAGES/jpg.txt" --out /tmp/gpudet-rn --limit "${LIMIT:-2000}" \
      --detections-per-image "${LOAD:-100}" 2>&1 | quiet | tee "$OUT/bench_retinanet.txt"
    cp /tmp/gpudet-rn/bench_retinanet.json "$OUT/"
    ;;
  ray)
    versions | tee "$OUT/versions.txt"
    image_set
    # one process and one Ray actor, each format, side by side (RAY_LIST: jpg_x28, 106,288 images, or jpg_x4;
    # RAY_RUNS: "NAME OPTIONS;NAME OPTIONS...")
    for _ in 1 2 3 4; do cat "$IMAGES/jpg.txt"; done > "$IMAGES/jpg_x4.txt"
    IFS=';' read -ra runs <<< "${RAY_RUNS:-one;ray --ray --workers 1;one_parquet --format parquet;ray_parquet --ray --workers 1 --format parquet}"
    for how in "${runs[@]}"; do
      set -- $how
      $PY -m pipeline detect "$IMAGES/${RAY_LIST:-jpg_x28}.txt" --out "/tmp/gpudet-$1" --overwrite ${2:+"${@:2}"} \
        2>&1 | quiet | tee -a "$OUT/ray.txt"
      cp "/tmp/gpudet-$1/summary.json" "$OUT/ray_$1_summary.json"
    done
    ;;
  *)
    echo "usage: OUT=DIR bash scripts/gpu_check.sh tests|retinaface|retinanet|ray" >&2
    exit 2
    ;;
esac
