"""One-off: the seeded RetinaNet heads fp16 model as bench_retinanet.py exports it (kept in git history for its command)."""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_retinanet as b
exporter = b.exporter
images, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
paths = [l.strip() for l in open(images) if l.strip()][:2000]
model = exporter.build_model("retinanet_resnet50_fpn", None, 91, 0)
t = time.perf_counter()
shift = exporter.detection_load_shift(model, 100, paths[:8], (800, 800))
print("shift", round(shift, 4), round(time.perf_counter() - t, 1), "s")
import copy
loaded = copy.deepcopy(model); exporter.shift_class_bias(loaded, shift)
path = out / "rn_load.onnx"
t = time.perf_counter()
exporter.export(loaded, "retinanet_heads", path, size_hw=(800, 800), batch_size=16, dynamic_batch=False, fp16=True)
print("exported", path, round(time.perf_counter() - t, 1), "s")
(out / "rn2000.txt").write_text("\n".join(paths) + "\n")
