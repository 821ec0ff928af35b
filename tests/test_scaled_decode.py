"""Large JPEGs decoded at a reduced scale (preprocess.scaled_decode): the reduction chosen, the
pixels it makes, and the same faces as a full decode, on the CPU (and the GPU)."""


import numpy as np
import pytest
from PIL import Image

from pipeline import Detector, ImageError
from pipeline.results import ImageRef
from pipeline.source import EncodedImage, PixelImage, ScaledDecode, checked_bytes, read_all

from conftest import SAMPLES, cpu_and_cuda, encode


@pytest.mark.parametrize("size, resize, factor", [((4000, 3000), "letterbox", 4), ((6000, 4000), "letterbox", 8),
                                                 ((1280, 960), "letterbox", 2), ((1000, 750), "letterbox", 1),
                                                 ((4000, 3000), "stretch", 4), ((2000, 700), "stretch", 1)])
def test_the_reduction_leaves_at_least_what_the_letterbox_makes(size, resize, factor):
    assert ScaledDecode(640, 640, resize).factor(*size) == factor


def big(name: str, scale: int = 5) -> Image.Image:
    image = Image.open(SAMPLES / name).convert("RGB")
    return image.resize((image.width * scale, image.height * scale), Image.Resampling.BICUBIC)


def test_a_large_jpeg_is_decoded_here_at_a_reduced_scale_with_its_orientation():
    """A 2560x3000 portrait stored turned (EXIF orientation 6): decoded at 1/4, upright, with the
    size its records give; CMYK stays DALI's; a small JPEG stays DALI's."""
    exif = Image.Exif()
    exif[0x0112] = 6
    stored = big("grace_hopper.jpg").transpose(Image.Transpose.ROTATE_90)
    data = np.frombuffer(encode(stored, "JPEG", quality=90, exif=exif.tobytes()), np.uint8)
    scaled = ScaledDecode(640, 640)
    assert checked_bytes(EncodedImage(ImageRef(0, "p.jpg"), data), scaled=scaled).scaled == scaled  # to decode so
    (item,) = read_all([EncodedImage(ImageRef(0, "p.jpg"), data)], scaled=scaled)
    assert isinstance(item, PixelImage) and item.original_hw == (3000, 2560) and item.data.shape == (750, 640, 3)
    upright = np.asarray(big("grace_hopper.jpg").resize((640, 750), Image.Resampling.BOX), np.int16)
    assert np.abs(item.data.astype(np.int16) - upright).mean() < 6  # upright: its orientation applied
    cmyk = np.frombuffer(encode(big("grace_hopper.jpg").convert("CMYK"), "JPEG"), np.uint8)
    assert checked_bytes(EncodedImage(ImageRef(1, "c.jpg"), cmyk), scaled=scaled).scaled is None  # DALI's
    small = np.frombuffer(encode(Image.open(SAMPLES / "grace_hopper.jpg"), "JPEG"), np.uint8)
    assert checked_bytes(EncodedImage(ImageRef(2, "s.jpg"), small), scaled=scaled).scaled is None


def iou(a, b) -> float:
    lt, rb = np.maximum(a[:2], b[:2]), np.minimum(a[2:], b[2:])
    inter = np.prod(np.clip(rb - lt, 0, None))
    return inter / (np.prod(a[2:] - a[:2]) + np.prod(b[2:] - b[:2]) - inter)


@cpu_and_cuda()
def test_the_scaled_decode_finds_the_full_decodes_faces(tmp_path, device):
    """Large JPEGs made from the samples (upright, EXIF-turned, grey): every face of the full
    decode scoring 0.9 or more is found by the scaled decode at IoU 0.85 or more, and the other
    way round; the same sizes in the records."""
    paths = []
    for name in ("astronaut.png", "grace_hopper.jpg", "camera.png", "chelsea.png"):
        image = big(name)
        paths.append(tmp_path / f"{name}.jpg")
        image.save(paths[-1], quality=90)
        exif = Image.Exif()
        exif[0x0112] = 8
        paths.append(tmp_path / f"{name}_turned.jpg")
        image.transpose(Image.Transpose.ROTATE_270).save(paths[-1], quality=90, exif=exif.tobytes())
    paths.append(tmp_path / "grey.jpg")
    big("camera.png").convert("L").save(paths[-1], quality=90)
    runs = {}
    for scaled in (False, True):
        detector = Detector.from_config(device=device, overrides=[f"preprocess.scaled_decode={str(scaled).lower()}"])
        runs[scaled] = list(detector.run([str(p) for p in paths]))
    assert not any(isinstance(r, ImageError) for rs in runs.values() for r in rs)
    faces = 0
    for full, scaled in zip(runs[False], runs[True]):
        assert (full.width, full.height) == (scaled.width, scaled.height)
        for one, other in ((full, scaled), (scaled, full)):
            for box, score in zip(one.boxes_xyxy, one.scores):
                if score >= 0.9:
                    faces += 1
                    assert max((iou(box, b) for b in other.boxes_xyxy), default=0) >= 0.85, (one.path, box)
    assert faces >= 2 * 7  # three faces, each upright and turned, and the grey camera: both ways
