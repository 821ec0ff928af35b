"""The runner's preprocessing stream: failure isolation with batches in flight."""

import numpy as np

from pipeline.device import Device
from pipeline.preprocess import Preprocessor
from pipeline.runner import StageClock, preprocess_stream
from pipeline.source import EncodedImage, ImageRef

from conftest import SAMPLES, cpu_and_cuda

GOOD = np.fromfile(SAMPLES / "grace_hopper.jpg", np.uint8)
CORRUPT = np.concatenate([GOOD[:400], np.zeros(2000, np.uint8)])  # a JPEG cut off in its scan data
GARBAGE = np.frombuffer(b"\xff\xd8\xff" + b"\x13" * 500, np.uint8)  # a JPEG signature, then noise


@cpu_and_cuda()
def test_every_good_image_exactly_once_around_bad_ones(device):
    kinds = ["g", "b", "g", "g", "g", "g", "x", "b", "g", "g", "g", "x", "g"]
    data = {"g": GOOD, "b": CORRUPT, "x": GARBAGE}
    items = [EncodedImage(ImageRef(i, f"{k}{i}.jpg"), data[k]) for i, k in enumerate(kinds)]
    batches = [items[i:i + 4] for i in range(0, len(items), 4)]
    p = Preprocessor(device=Device("cuda", 0) if device == "cuda" else Device("cpu"), batch_size=4, num_threads=2,
                     height=64, width=64, resize="letterbox", channel_order="RGB", mean=[0, 0, 0], std=[1, 1, 1],
                     pad_value=0, dtype="float32", layout="NCHW")
    errors = []
    done = [r.index for b in preprocess_stream(p, batches, errors.extend, depth=3) for r in b.refs]
    failed = [e.index for e in errors]
    assert sorted(done) == [i for i, k in enumerate(kinds) if k == "g"]
    assert len(done) == len(set(done))
    # Some corrupt JPEGs decode to garbage without an error; those that fail must be the bad ones.
    assert set(failed) <= {i for i, k in enumerate(kinds) if k != "g"} and {6, 11} <= set(failed)
    assert all(e.reason == "decode_failed" and e.message.startswith("cannot decode") for e in errors)
    assert len(done) + len(failed) <= len(kinds)


def test_stage_clock_is_exclusive():
    import time

    clock = StageClock()
    with clock("outer"):
        time.sleep(0.02)
        with clock("inner"):
            time.sleep(0.03)
    assert 0.02 <= clock.seconds["outer"] < 0.03 + 0.01 and clock.seconds["inner"] >= 0.03
