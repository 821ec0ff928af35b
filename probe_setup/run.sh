#!/usr/bin/env bash
# setup phases, before (HEAD~) and now, alternating; warm Triton cache and cold
set -u
cd "$(dirname "$0")/.."
NOW=$PWD; BEFORE=/tmp/before
rm -rf $BEFORE && mkdir -p $BEFORE && cp -r probe_setup/before/pipeline configs models $BEFORE/
RN=/tmp/gpudet-rn/retinanet_heads_fp16_load_16_800x800_0.7617.onnx
one() {  # tag tree cache config...
  tag=$1; tree=$2; cache=$3; shift 3
  if [ "$cache" = cold ]; then c=$(mktemp -d); else c=/tmp/triton-warm; fi
  home=$NOW; [ "$tree" = before ] && home=$BEFORE
  line=$(cd "$home" && TRITON_CACHE_DIR=$c PYTHONPATH="$home:/tmp/site" python3 "$NOW/probe_setup/phases.py" "$@" 2>/tmp/phases_err.txt | tail -1)
  echo "{\"tag\": \"$tag\", \"tree\": \"$tree\", \"cache\": \"$cache\", \"r\": $line}" | tee -a "$OUT/phases.jsonl"
  [ -n "$line" ] || tail -5 /tmp/phases_err.txt
}
mkdir -p /tmp/triton-warm
# prime the warm cache for both trees (same kernels source? not necessarily): one run each
one prime now warm - ; one prime before warm -
for rep in 1 2 3; do
  one rf now warm -; one rf before warm -
done
for rep in 1 2; do
  one rf_cold now cold -; one rf_cold before cold -
done
if [ -f "$RN" ]; then
  one prime_rn now warm configs/retinanet_r50_coco.yaml --set model.path=$RN
  for rep in 1 2; do
    one rn now warm configs/retinanet_r50_coco.yaml --set model.path=$RN
    one rn before warm configs/retinanet_r50_coco.yaml --set model.path=$RN
  done
  one rn_cold now cold configs/retinanet_r50_coco.yaml --set model.path=$RN
  one rn_cold before cold configs/retinanet_r50_coco.yaml --set model.path=$RN
fi
