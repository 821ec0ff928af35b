"""Generate a benchmark image set from the bundled photos, seeded: the same files for the same
arguments, every file distinct (its own crop, size, flip, grain and quality), plus a list.txt of
absolute paths.

  --kind crops   random crops, the longer side 480-1024 px, JPEG quality 85-95 (5% PNG)
  --kind coco    COCO-sized photos: the longer side 500-640 (4:3, 3:4 or 16:9), JPEG quality 95
                 with a photo's grain, ~150 KB
  --kind photos  12 MP phone photos: 4000x3000 (or 3000x4000), JPEG quality 90, ~1 MB, a third
                 of them stored rotated with the EXIF orientation (6, 8 or 3) that turns them back
  --kind mixed   COCO-sized photos, a tenth of them PNG or WebP

Usage:  python scripts/make_image_set.py OUT_DIR [--kind crops] [--count 4000] [--seed 0] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
KINDS = ("crops", "coco", "photos", "mixed")
ROTATED = {6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270, 3: Image.Transpose.ROTATE_180}
"""EXIF orientation -> how the stored pixels are turned so that the orientation turns them back."""


def crop_of(rng: random.Random, aspect: float | None = None) -> Image.Image:
    """A random crop (half of the photo's side or more) of a bundled photo, RGB; `aspect` (width /
    height) where given."""
    photos = sorted(p for p in SAMPLES.iterdir() if p.suffix in (".png", ".jpg"))
    image = Image.open(rng.choice(photos)).convert("RGB")
    image.info.pop("icc_profile", None)  # the skimage PNGs carry an iCCP chunk libpng warns about
    w, h = image.size
    cw, ch = rng.randint(w // 2, w), rng.randint(h // 2, h)
    if aspect is not None:
        cw, ch = (cw, min(h, round(cw / aspect))) if cw / aspect <= h else (min(w, round(ch * aspect)), ch)
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    image = image.crop((x, y, x + cw, y + ch))
    return ImageOps.mirror(image) if rng.random() < 0.5 else image


def with_grain(image: Image.Image, rng: random.Random, amplitude: int, channels: int = 1) -> Image.Image:
    """The image with a sensor's grain (uniform noise of +-amplitude levels, per pixel or per
    channel): upscaled crops of the samples are smooth, and would compress far smaller than photos."""
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-amplitude, amplitude + 1,
                                                                (image.height, image.width, channels), dtype=np.int16)
    return Image.fromarray(np.clip(np.asarray(image, np.int16) + noise, 0, 255).astype(np.uint8))


def make_one(args: tuple[int, int, str, str]) -> str:
    index, seed, out_dir, kind = args
    if kind == "crops":
        return crop_file(index, seed, out_dir)
    rng = random.Random(seed * 1_000_003 + index * 7 + KINDS.index(kind))
    if kind == "photos":
        portrait = rng.random() < 0.3
        size = (3000, 4000) if portrait else (4000, 3000)
        image = with_grain(crop_of(rng, size[0] / size[1]).resize(size, Image.Resampling.BILINEAR), rng, 2)
        exif = Image.Exif()
        orientation = rng.choice([6, 8, 3]) if rng.random() < 1 / 3 else 1
        exif[0x0112] = orientation
        stored = image.transpose(ROTATED[orientation]) if orientation != 1 else image
        name = f"photo_{index:06d}.jpg"
        stored.save(Path(out_dir) / name, quality=90, exif=exif.tobytes())
        return name
    aspect = rng.choice([4 / 3, 3 / 4, 16 / 9])
    longer = rng.randint(500, 640)
    size = (longer, round(longer / aspect)) if aspect >= 1 else (round(longer * aspect), longer)
    image = with_grain(crop_of(rng, aspect).resize(size, Image.Resampling.BILINEAR), rng, 20, channels=3)
    fmt = rng.choice(["png", "webp"]) if kind == "mixed" and rng.random() < 0.1 else "jpg"
    name = f"coco_{index:06d}.{fmt}"
    image.save(Path(out_dir) / name, quality=95)
    return name


def crop_file(index: int, seed: int, out_dir: str) -> str:
    """--kind crops: the same files for a seed as every earlier version of this script made."""
    rng = random.Random(seed * 1_000_003 + index)
    photos = sorted(p for p in SAMPLES.iterdir() if p.suffix in (".png", ".jpg"))
    image = Image.open(rng.choice(photos)).convert("RGB")
    image.info.pop("icc_profile", None)
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
    parser.add_argument("--kind", choices=KINDS, default="crops")
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(args.workers) as pool:
        names = list(pool.map(make_one, [(i, args.seed, str(args.out), args.kind) for i in range(args.count)],
                              chunksize=16))
    (args.out / "list.txt").write_text("".join(f"{(args.out / n).resolve()}\n" for n in names))
    size = sum((args.out / n).stat().st_size for n in names)
    print(f"wrote {len(names)} {args.kind} images ({size / len(names) / 1e3:.0f} KB each on average) and list.txt "
          f"to {args.out}")


if __name__ == "__main__":
    main()
