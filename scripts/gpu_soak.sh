#!/usr/bin/env bash
# Device memory over a long GPU run: the generated JPEG set listed REPEAT times, device memory
# (nvidia-smi) sampled every 0.5 s beside the number of records written so far.
# Usage (on the GPU machine): OUT=/some/dir REPEAT=15 bash scripts/gpu_soak.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpudet-out}; mkdir -p "$OUT"
PY=${PY:-python3}
[ -f /tmp/imgset/list.txt ] || $PY scripts/make_image_set.py /tmp/imgset --count 4000 > /dev/null
for k in $(seq "${REPEAT:-15}"); do grep -v png /tmp/imgset/list.txt | sed "s#^#/tmp/imgset/#"; done > /tmp/soak.txt
rm -rf /tmp/soak
$PY -m pipeline detect /tmp/soak.txt --out /tmp/soak --device cuda --batch-size 32 2>&1 \
  | grep -v -i "deprecat\|_handle_op" > "$OUT/soak_run.txt" &
RUN=$!
while kill -0 $RUN 2>/dev/null; do
  echo "$(wc -l < /tmp/soak/detections.jsonl 2>/dev/null || echo 0) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"
  sleep 0.5
done > "$OUT/soak_memory.txt"
cat "$OUT/soak_run.txt"
$PY - "$OUT/soak_memory.txt" <<'PY' | tee "$OUT/soak_summary.txt"
import sys
rows = [tuple(map(int, line.split())) for line in open(sys.argv[1]) if len(line.split()) == 2]
total = max(r for r, _ in rows)
for share in (0.05, 0.1, 0.25, 0.5, 0.75, 0.95):
    mem = [m for r, m in rows if r >= share * total]
    print(f"after {int(share * total):6d} of {total} images: device memory {mem[0]} MiB")
print(f"peak {max(m for _, m in rows)} MiB")
PY
