#!/usr/bin/env bash
# RetinaNet on the H200 (issues 3, 4, 7): the GPU tests, the side-by-side benchmark, and with two
# GPUs the --devices and Ray runs. Usage (GPU machine, wheels installed, PYTHONPATH set):
#   OUT=/some/dir bash scripts/gpu_retinanet.sh tests|bench|profile|kernels|fuse|fusedetect|retinaface|probe|pipeline|hostprofile|read|ab|stress|daliready|latency|scale
set -uo pipefail
OUT=${OUT:-/tmp/gpudet-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
WORK=/tmp/rn; mkdir -p $WORK
quiet() { grep -v -i "deprecat\|_handle_op\|libpng\|jpeg_parser\|libjpeg\|Corrupt JPEG\|TracerWarning\|^  \|warnings.warn"; }
parse_run() {  # "config[,key=value,...]" -> cfg, sets (--set options), tag (for file names)
  cfg=${1%%,*}; sets=$(echo "$1" | tr ',' '\n' | tail -n +2 | sed 's/^/--set /' | tr '\n' ' ')
  tag=$(echo "$1" | tr -cd '[:alnum:]_')
}
images() {  # a realistic set (random crops of the bundled photos, 480-1024 px, JPEG q90)
  [ -f /tmp/imgset/list.txt ] || $PY scripts/make_image_set.py /tmp/imgset --count "${COUNT:-4000}" > /dev/null
  grep -v png /tmp/imgset/list.txt | sed "s#^#/tmp/imgset/#" > /tmp/imgset/jpg_abs.txt
}
case "${1:-}" in
  tests)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
    $PY -c "import torch, torchvision, onnxruntime as o, nvidia.dali as d; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'ort', o.__version__, 'dali', d.__version__)" | tee -a "$OUT/gpu.txt"
    # The whole suite takes ~9 min on the H200, over one device command's 10: TESTS="tests/test_[a-o]*.py"
    # then TESTS="tests/test_[p-z]*.py" (test_retinanet.py alone ~3.5 min) split it in two.
    $PY -m pytest -q -rs -p no:cacheprovider -m cuda --durations=10 ${TESTS:-tests} -s 2>&1 | tee "$OUT/pytest_cuda.log" \
      | grep -E "passed|failed|FAILED|Error|D2H copies" | tail -25
    ;;
  bench)
    images
    $PY scripts/bench_retinanet.py /tmp/imgset/jpg_abs.txt --out $WORK --limit "${LIMIT:-2000}" 2>&1 | quiet | tee "$OUT/bench_retinanet.txt"
    cp $WORK/bench_retinanet.json "$OUT/"
    ;;
  profile)
    for m in retinanet_heads_fp16 retinanet_e2e_fp16; do
      $PY scripts/profile_ort.py $WORK/$m.onnx --nhwc 2>&1 | grep -v -i "deprecat\|warn" | tee -a "$OUT/profile.txt"
    done
    ;;
  kernels)  # device time per kernel: heads (ORT's default conv options, fuse_conv_bias) against torch eager; e2e at score 0
    [ -f $WORK/retinanet_e2e_fp16.onnx ] || $PY scripts/export_retinanet.py --contract end_to_end --fp16 \
      --out $WORK/retinanet_e2e_fp16.onnx 2>&1 | quiet | tail -1
    for opts in "" "--cuda-option fuse_conv_bias=1"; do
      $PY scripts/profile_kernels.py --model $WORK/retinanet_heads_fp16.onnx $opts 2>&1 | grep -v USDT | tee -a "$OUT/kernels.txt"
      $PY scripts/profile_kernels.py --model $WORK/retinanet_e2e_fp16.onnx --score-threshold 0 $opts 2>&1 | grep -v USDT \
        | tee -a "$OUT/kernels.txt"
    done
    ;;
  fuse)  # which convolutions ORT's fuse_conv_bias gets wrong: the RetinaFace models (broken), RetinaNet's (kept)
    for m in models/retinaface_mnet025_heads_640.onnx models/retinaface_mnet025_heads_640_fp16.onnx; do
      for nhwc in "" "--nhwc"; do
        $PY scripts/probe_fuse.py $m $nhwc --batch 1 4 8 32 2>&1 | grep -v "^\[" | tee -a "$OUT/fuse.txt"
      done
    done
    $PY scripts/probe_fuse.py models/retinaface_mnet025.onnx --nhwc --whole --batch 1 8 32 2>&1 | grep -v "^\[" \
      | tee -a "$OUT/fuse.txt"  # the default model: decode and NonMaxSuppression in the graph
    [ -f $WORK/retinanet_heads_fp16.onnx ] && $PY scripts/probe_fuse.py $WORK/retinanet_heads_fp16.onnx --nhwc \
      --batch 16 2>&1 | tee -a "$OUT/fuse.txt"
    ;;
  fusedetect)  # gpudet detect on the sample photos with fuse_conv_bias, per RetinaFace config and batch size, vs the CPU
    # (postprocess.compile off: the question is the model's outputs; each run's counts are written as it ends)
    counts() {  # FOLDER LABEL: faces per photo
      $PY - "$1" "$2" <<'PY' | tee -a "$OUT/fusedetect.txt"
import collections, json, sys
c = collections.Counter()
for line in open(f"{sys.argv[1]}/detections.jsonl"):
    r = json.loads(line)
    c[r["path"].split("/")[-1]] += len(r["detections"])
print(sys.argv[2], dict(sorted(c.items())))
PY
    }
    for cfg in ${CONFIGS:-retinaface_mnet025_heads_fp16 retinaface_mnet025_heads retinaface_mnet025}; do
      $PY -m pipeline detect samples --config configs/$cfg.yaml --device cpu --out /tmp/fd_${cfg}_cpu --overwrite \
        --quiet 2>&1 | quiet | tail -2
      counts /tmp/fd_${cfg}_cpu "$cfg cpu"
      for bs in ${BATCHES:-1 8 32}; do
        $PY -m pipeline detect samples --config configs/$cfg.yaml --device cuda --batch-size $bs --set run.prefer_nhwc=true \
          --set run.fuse_conv_bias=true --set postprocess.compile=false --out /tmp/fd_${cfg}_$bs --overwrite --quiet \
          2>&1 | quiet | tail -2
        counts /tmp/fd_${cfg}_$bs "$cfg cuda fused, batch $bs"
      done
    done
    ;;
  retinaface)  # gpudet bench on the default model, end-to-end and raw-heads configs (the latter also compiled)
    images
    for run in "retinaface_mnet025" "retinaface_mnet025_heads" "retinaface_mnet025_heads postprocess.compile=true"; do
      set -- $run; cfg=$1; tag=$(echo "$run" | tr -cd '[:alnum:]_')
      $PY -m pipeline bench /tmp/imgset/jpg_abs.txt --config configs/$cfg.yaml --device cuda --limit 4000 \
        --latency "${LATENCY:-200}" ${2:+--set $2} --json "$OUT/bench_$tag.json" 2>&1 | quiet | tee -a "$OUT/bench_retinaface.txt"
    done
    ;;
  probe)  # RetinaFace: the engine per ORT setting (fp32 / fp16 heads), DALI per thread count, then gpudet bench
    images
    [ -f models/retinaface_mnet025_heads_640_fp16.onnx ] || $PY scripts/build_retinaface.py --heads-only 640 640 \
      --fp16 --out models/retinaface_mnet025_heads_640_fp16.onnx
    [ "${ENGINE_PROBE:-1}" = 1 ] && $PY scripts/probe_retinaface.py /tmp/imgset/jpg_abs.txt \
      --models models/retinaface_mnet025_heads_640.onnx models/retinaface_mnet025_heads_640_fp16.onnx \
      --json "$OUT/probe_retinaface.json" 2>&1 | quiet | tee "$OUT/probe.txt"
    for run in ${RUNS:-"retinaface_mnet025_heads"}; do  # RUNS: "config[,key=value,...]" words
      parse_run "$run"
      $PY -m pipeline bench /tmp/imgset/jpg_abs.txt --config configs/$cfg.yaml --device cuda --limit 4000 --skip-naive \
        $sets --json "$OUT/bench_$tag.json" 2>&1 | quiet | tee -a "$OUT/probe.txt"
    done
    ;;
  pipeline)  # every kernel of the pipeline per CUDA stream (scripts/profile_pipeline.py); RUNS as for probe
    images
    for run in ${RUNS:-"retinaface_mnet025_heads_fp16"}; do
      parse_run "$run"
      $PY scripts/profile_pipeline.py /tmp/imgset/jpg_abs.txt --config configs/$cfg.yaml $sets --limit "${LIMIT:-640}" \
        --json "$OUT/pipeline_$tag.json" 2>&1 | quiet | tail -40 | tee -a "$OUT/pipeline.txt"
    done
    ;;
  hostprofile)  # where the host's time goes in gpudet's pass: py-spy on the GIL's holder and on every thread
    # (scripts/profile_host.py; py-spy staged with the wheels: stage-wheels.sh py-spy==0.4.3); RUNS as for probe
    images
    export PATH=/tmp/site/bin:$PATH
    for run in ${RUNS:-"retinaface_mnet025_heads_fp16"}; do
      parse_run "$run"
      $PY scripts/profile_host.py /tmp/imgset/jpg_abs.txt --config configs/$cfg.yaml $sets --limit 4000 \
        --repeat "${REPEAT:-3}" --json "$OUT/host_$tag.json" 2>&1 | grep -v -i "warn" | tee -a "$OUT/host.txt"
    done
    ;;
  read)  # gpudet's file reading alone: threads against worker processes, alone and beside a busy thread
    images
    $PY scripts/probe_read.py /tmp/imgset/jpg_abs.txt --threads 4 --processes 1 2 4 --rounds 3 \
      --json "$OUT/read.json" 2>&1 | tee "$OUT/read.txt"
    ;;
  ab)  # the same gpudet benches on several code trees, interleaved round by round (A B A B), on one machine:
    # TREES="_ab/main _ab/branch": folders under the repository, each holding `pipeline/` from one commit
    # (git archive COMMIT pipeline | tar -x -C _ab/NAME); RUNS as for probe; ROUNDS (default 2); DEVICE (cuda);
    # PASSES (default 1): gpudet's timed passes per run, the median reported (trees from aecf8a4 on: older ones lack --passes).
    images
    R=$PWD
    for round in $(seq "${ROUNDS:-2}"); do
      for tree in ${TREES:?TREES=\"dirA dirB\"}; do
        [ -e "$tree/models" ] || ln -s "$R/models" "$tree/models"  # gpudet's own models, as in the checkout
        for run in ${RUNS:-"retinaface_mnet025_heads_fp16"}; do
          parse_run "$run"; tag=$(basename "$tree")_${tag}_$round
          (cd "$tree" && PYTHONPATH="/tmp/site:$R/$tree" $PY -m pipeline bench /tmp/imgset/jpg_abs.txt \
            --config "$R/configs/$cfg.yaml" --device "${DEVICE:-cuda}" --limit "${LIMIT:-4000}" --skip-naive $sets ${PASSES:+--passes $PASSES} \
            --json "$OUT/ab_$tag.json" 2>&1 | quiet | tail -3 >> "$OUT/ab.log")
          # One line per run as it ends, and its JSON into one archive (the device sends back at most
          # 8 files, and nothing of a run cut by a timeout but what is already in $OUT).
          [ -f "$OUT/ab_$tag.json" ] && $PY - "$OUT/ab_$tag.json" <<'PY' | tee -a "$OUT/ab.txt"
import json, sys
r = json.load(open(sys.argv[1])); i, s = r["images_per_s"], r["gpudet_stages_s"]
waits = " / ".join(f"{s.get(k, 0):.2f}" for k in ("read", "preprocess", "postprocess", "write"))
passes = " ".join(f"{p:.0f}" for p in r.get("gpudet_passes_images_per_s", []))
print(f"{r['date'][11:19]}  {sys.argv[1].split('/')[-1][3:-5]:<60} gpudet {i['gpudet']:8.1f}  model {i['model']:8.1f}"
      f"  dali {i.get('preprocess', 0):8.1f}  waits read/dali/post/write {waits}  gpu {s.get('gpu_utilisation_percent')}%"
      + (f"  passes {passes}" if passes else "")
      + (f"  host loop {r['machine']['python_loop_ms']:.1f} ms" if "python_loop_ms" in r["machine"] else "")
      + (f"  setup {r['gpudet_setup_s']['detector']:.1f} s" if "gpudet_setup_s" in r else ""))
PY
          [ -f "$OUT/ab_$tag.json" ] && (cd "$OUT" && tar -rf ab_json.tar "ab_$tag.json" && rm "ab_$tag.json")
        done
      done
    done
    ;;
  stress)  # gpudet detect over the image set four times (15,184 images), again and again, per tree and setting, to
    # catch what fails rarely (an illegal memory access: 1 of 6 runs with postprocess.compile=false on 2026-11-30). Per
    # run: exit status, result lines against the list, summary.json written or not (written after the last batch, so a
    # crash with it is one at exit), and stderr's last lines when it failed. TREES as for ab (default: this checkout);
    # RUNS as for probe; REPEAT (default 5); DEVICE (cuda).
    images
    for k in 1 2 3 4; do cat /tmp/imgset/jpg_abs.txt; done > /tmp/imgset/x4.txt
    R=$PWD; total=$(wc -l < /tmp/imgset/x4.txt)
    for round in $(seq "${REPEAT:-5}"); do
      for tree in ${TREES:-.}; do
        [ "$tree" = . ] || [ -e "$tree/models" ] || ln -s "$R/models" "$tree/models"
        for run in ${RUNS:-"retinaface_mnet025_heads_fp16,postprocess.compile=false retinaface_mnet025_heads_fp16"}; do
          parse_run "$run"; tag=$(basename "$(cd "$tree" && pwd)")_${tag}_$round
          rm -rf /tmp/stress
          (cd "$tree" && PYTHONPATH="/tmp/site:$R/$tree" timeout 300 $PY -m pipeline detect /tmp/imgset/x4.txt \
            --config "$R/configs/$cfg.yaml" --device "${DEVICE:-cuda}" $sets --out /tmp/stress --no-progress > /tmp/stress.log 2>&1)
          rc=$?
          lines=$(cat /tmp/stress/detections.jsonl 2>/dev/null | wc -l)
          summary=$([ -f /tmp/stress/summary.json ] && echo summary || echo no-summary)
          # Each image is listed four times: copies whose detections differ (count, or a box by over 1 px)
          # are a batch read before it was written, or another batch's bytes.
          differ=$($PY - /tmp/stress/detections.jsonl <<'CHECK' 2>/dev/null
import json, sys
from collections import defaultdict
seen = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    seen[r["path"]].append(r.get("detections") or [])
def same(a, b):
    return len(a) == len(b) and all(max(abs(x - y) for x, y in zip(p["box"], q["box"])) <= 1.0 for p, q in zip(a, b))
print(sum(any(not same(c, copies[0]) for c in copies[1:]) for copies in seen.values()), "of", len(seen))
CHECK
)
          echo "$(date +%T) $tag rc=$rc results $lines/$total $summary, copies differ ${differ:-?}, illegal $(grep -c -i illegal /tmp/stress.log):" \
            "$(grep 'img/s' /tmp/stress.log | tail -1 | cut -c1-110)" | tee -a "$OUT/stress.txt"
          [ "$rc" -ne 0 ] && { echo "== $tag rc=$rc"; grep -v -i "warn" /tmp/stress.log | tail -40; } >> "$OUT/stress_failed.log"
        done
      done
    done
    ;;
  daliready)  # how often a DALI batch is handed out (outputs()) before DALI's kernels have written it: why the
    # engine names its own stream when it takes a batch through DLPack (pipeline/engine.py). Fused config's shapes.
    images
    $PY - <<'PY' 2>&1 | quiet | tee "$OUT/daliready.txt"
import torch
from pipeline.device import Device
from pipeline.preprocess import Preprocessor
from pipeline.source import list_images, read_checked

items = [read_checked(r) for r in list_images("/tmp/imgset/jpg_abs.txt")[:32 * 60]]
batches = [items[i:i + 32] for i in range(0, len(items), 32)]
for depth in (1, 2):
    p = Preprocessor(device=Device("cuda", 0), batch_size=32, num_threads=4, height=640, width=640,
                     resize="letterbox", channel_order="BGR", mean=[104, 117, 123], std=[1, 1, 1], pad_value=0,
                     dtype="float16", layout="NCHW")
    unready = 0

    def take():
        global unready
        images = p.result().images
        reader = torch.cuda.Stream()
        images.__dlpack__(stream=reader.cuda_stream)  # the reader waits for DALI's event
        unready += not reader.query()
        reader.synchronize()

    for batch in batches:
        p.submit(batch)
        if len(p.in_flight) == depth:
            take()
    while p.in_flight:
        take()
    print(f"depth {depth}: {unready} of {len(batches)} batches handed out before DALI's kernels finished")
PY
    ;;
  latency)  # batch-1 latency of RetinaNet: a batch-1 heads model through gpudet bench --latency
    [ -f $WORK/retinanet_heads_fp16_b1.onnx ] || $PY scripts/export_retinanet.py --contract retinanet_heads --fp16 \
      --batch-size 1 --out $WORK/retinanet_heads_fp16_b1.onnx 2>&1 | quiet | tail -2
    images
    $PY -m pipeline bench /tmp/imgset/jpg_abs.txt --config configs/retinanet_r50_coco.yaml --device cuda \
      --set model.path=$WORK/retinanet_heads_fp16_b1.onnx --limit 500 --latency "${LATENCY:-200}" --skip-naive \
      --json "$OUT/bench_retinanet_b1.json" 2>&1 | quiet | tee -a "$OUT/latency.txt"
    ;;
  scale)
    images
    for k in 1 2 3 4; do cat /tmp/imgset/jpg_abs.txt; done > /tmp/imgset/x4.txt
    M=$WORK/retinanet_heads_fp16.onnx
    for run in "--device cuda:0" "--devices 0,1"; do
      tag=$(echo "$run" | tr -cd '[:alnum:]')
      echo "== retinanet heads fp16, $run" | tee -a "$OUT/scale.txt"
      $PY -m pipeline detect /tmp/imgset/x4.txt --config configs/retinanet_r50_coco.yaml --model $M $run \
        --out /tmp/scale_$tag --overwrite 2>&1 | quiet | tail -4 | tee -a "$OUT/scale.txt"
      cp /tmp/scale_$tag/summary.json "$OUT/scale_$tag.json"
    done
    echo "== retinanet heads fp16, --ray --workers 2" | tee -a "$OUT/scale.txt"
    $PY -m pipeline detect /tmp/imgset/x4.txt --config configs/retinanet_r50_coco.yaml --model $M --ray --workers 2 \
      --out /tmp/scale_ray --overwrite 2>&1 | quiet | tail -6 | tee -a "$OUT/scale.txt"
    cp /tmp/scale_ray/summary.json "$OUT/scale_ray.json"
    $PY - <<'PY' | tee -a "$OUT/scale.txt"
import json
a, b = (json.load(open(f"/tmp/scale_{t}/summary.json")) for t in ("devicecuda0", "devices01"))
print("one GPU, img/s after setup:", a["images_per_s"], "| two workers, per worker:",
      [w.get("images_per_s") for w in b.get("workers", [])], "| wall totals:", a["seconds"]["total"], b["seconds"]["total"])
PY
    ;;
  *) echo "usage: $0 tests|bench|profile|kernels|fuse|fusedetect|retinaface|probe|pipeline|hostprofile|read|ab|stress|daliready|latency|scale" >&2; exit 2 ;;
esac
