#!/usr/bin/env bash
# docs/BENCHMARKS.md's CPU numbers ("On a CPU"): `gpudet bench --device cpu` with the default config
# over 240 distinct COCO-sized JPEGs (scripts/make_image_set.py --kind coco, seeded), beside the naive
# loop over the same 240, three passes, each tree's report kept in OUT.
#
#   OUT=docs/bench/cpu bash scripts/cpu_check.sh              # this tree
#   BEFORE=DIR OUT=... bash scripts/cpu_check.sh              # a checkout of another commit first, then this one
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpudet-cpu-check}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY=${PY:-python3}
IMAGES=${IMAGES:-/tmp/gpudet-cpu-images}
[ -f "$IMAGES/coco/list.txt" ] || $PY "$ROOT/scripts/make_image_set.py" "$IMAGES/coco" --kind coco --count 240
for tree in ${BEFORE:+before} now; do
  home=$ROOT; [ "$tree" = before ] && home=$BEFORE
  (cd "$home" && PYTHONPATH="$home" $PY -m pipeline bench "$IMAGES/coco/list.txt" --device cpu --limit 240 \
    --naive-limit 240 --passes 3 --json "$OUT/coco240_$tree.json")
done
