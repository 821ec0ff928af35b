"""Generate a realistic benchmark image set from the bundled photos.

Random crops of the sample photos (faces included), resized so the longer side is 480-1024 px,
some flipped, written as JPEG quality ~90 (a few as PNG), plus a list.txt. Deterministic per seed.

Usage:  python scripts/make_image_set.py OUT_DIR [--count 4000] [--seed 0] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from PIL import Image, ImageOps

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def make_one(args: tuple[int, int, str]) -> str:
    index, seed, out_dir = args
    rng = random.Random(seed * 1_000_003 + index)
    photos = sorted(p for p in SAMPLES.iterdir() if p.suffix in (".png", ".jpg"))
    image = Image.open(rng.choice(photos)).convert("RGB")
    image.info.pop("icc_profile", None)  # the skimage PNGs carry an iCCP chunk libpng warns about
    w, h = image.size
    cw, ch = rng.randint(w // 2, w), rng.randint(h // 2, h)
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    image = image.crop((x, y, x + cw, y + ch))
    longer = rng.randint(480, 1024)
    scale = longer / max(cw, ch)
    image = image.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.Resampling.BILINEAR)
    if rng.random() < 0.5:
        image = ImageOps.mirror(image)
    name = f"img_{index:06d}." + ("png" if rng.random() < 0.05 else "jpg")
    image.save(Path(out_dir) / name, quality=rng.randint(85, 95))
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(args.workers) as pool:
        names = list(pool.map(make_one, [(i, args.seed, str(args.out)) for i in range(args.count)], chunksize=64))
    (args.out / "list.txt").write_text("".join(n + "\n" for n in names))
    print(f"wrote {len(names)} images and list.txt to {args.out}")


if __name__ == "__main__":
    main()
