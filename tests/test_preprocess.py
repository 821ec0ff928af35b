"""DALI preprocessing: letterbox geometry, normalisation, grayscale and PNG inputs."""


import numpy as np
import pytest
from PIL import Image

from pipeline.device import Device
from pipeline.preprocess import Preprocessor
from pipeline.source import EncodedImage, ImageRef

from conftest import SAMPLES, cpu_and_cuda, encode


def encoded(image: Image.Image, fmt: str = "PNG", **kwargs) -> np.ndarray:
    return np.frombuffer(encode(image, fmt, **kwargs), np.uint8)


def preprocessor(device: str, **overrides) -> Preprocessor:
    args = dict(batch_size=4, num_threads=2, height=64, width=96, resize="letterbox", channel_order="RGB",
                mean=[0, 0, 0], std=[1, 1, 1], pad_value=7, dtype="float32", layout="NCHW", hw_decoder_load=0.9)
    args.update(overrides)
    return Preprocessor(device=Device("cuda", 0) if device == "cuda" else Device("cpu"), **args)


def as_numpy(images) -> np.ndarray:
    return np.asarray(images.as_cpu() if hasattr(images, "as_cpu") else images)


@cpu_and_cuda()
@pytest.mark.parametrize("height, width", [(300, 200), (200, 500), (127, 191), (64, 96), (10, 11)])
def test_letterbox_geometry_portrait_landscape_odd(device, height, width):
    # A white rectangle on black; after the letterbox it must sit at its original place x scale.
    pixels = np.zeros((height, width, 3), np.uint8)
    y0, y1, x0, x1 = height // 4, height // 2, width // 3, (2 * width) // 3
    pixels[y0:y1, x0:x1] = 255
    item = EncodedImage(ImageRef(0, "rect.png"), encoded(Image.fromarray(pixels)))
    batch = preprocessor(device).run([item])
    scale = min(64 / height, 96 / width)
    resized_h, resized_w = round(height * scale), round(width * scale)
    assert batch.orig_hw.tolist() == [[height, width]]
    assert np.allclose(batch.scale_yx[0], [resized_h / height, resized_w / width])
    image = as_numpy(batch.images)[0]
    assert image.shape == (3, 64, 96)
    # Padding (right and bottom) holds pad_value; the content starts at the top-left corner.
    assert (image[:, resized_h:, :] == 7).all() and (image[:, :, resized_w:] == 7).all()
    sy, sx = batch.scale_yx[0]
    cy, cx = int((y0 + y1) / 2 * sy), int((x0 + x1) / 2 * sx)
    assert image[0, cy, cx] > 200
    assert image[0, int(y1 * sy) + 2, cx] < 50 if int(y1 * sy) + 2 < resized_h else True


@cpu_and_cuda()
@pytest.mark.parametrize("pad_value, padding", [(7.0, [(7 - 10) / 2, (7 - 20) / 4, (7 - 30) / 5]), (None, [0, 0, 0])])
def test_the_padding_is_a_pixel_value_normalised_as_the_image(device, pad_value, padding):
    """pad_value is a pixel: normalised with the image's mean and std (DALI writes its fill values
    into the normalised output); None pads the mean colour, 0 once normalised."""
    item = EncodedImage(ImageRef(0, "grey.png"), encoded(Image.new("RGB", (20, 64), (50, 50, 50))))
    image = as_numpy(preprocessor(device, mean=[10, 20, 30], std=[2, 4, 5], pad_value=pad_value).run([item]).images)[0]
    assert np.allclose(image[:, :, 40:], np.array(padding, np.float32)[:, None, None])  # right of the 20 px wide image
    assert np.allclose(image[:, :, :20], np.array([(50 - 10) / 2, (50 - 20) / 4, (50 - 30) / 5])[:, None, None])


@cpu_and_cuda()
def test_grayscale_png_and_channel_order_and_normalisation(device):
    gray = Image.open(SAMPLES / "camera.png")
    assert gray.mode == "L"
    rgb = Image.new("RGB", (96, 64), (10, 20, 30))
    items = [EncodedImage(ImageRef(0, "camera.png"), encoded(gray)),
             EncodedImage(ImageRef(1, "rgb.jpg"), encoded(rgb, "JPEG", quality=100))]
    p = preprocessor(device, channel_order="BGR", mean=[1, 2, 3], std=[2, 2, 2], resize="stretch")
    batch = p.run(items)
    images = as_numpy(batch.images)
    assert images.shape == (2, 3, 64, 96)
    # Grayscale becomes 3 equal channels (before mean/std); BGR order puts blue first.
    assert np.allclose(images[0, 0] * 2 + 1, images[0, 1] * 2 + 2, atol=1e-3)
    assert np.allclose(images[1, :, 32, 48], [(30 - 1) / 2, (20 - 2) / 2, (10 - 3) / 2], atol=1.5)


@cpu_and_cuda()
def test_float16_and_nhwc(device):
    p = preprocessor(device, dtype="float16", layout="NHWC")
    item = EncodedImage(ImageRef(0, "china.jpg"), np.fromfile(SAMPLES / "china.jpg", np.uint8))
    images = as_numpy(p.run([item]).images)
    assert images.shape == (1, 64, 96, 3) and images.dtype == np.float16


@cpu_and_cuda()
def test_exif_orientation_is_applied(device):
    display = Image.fromarray(np.asarray(Image.open(SAMPLES / "china.jpg"))[:, :300])  # 427 x 300 (h x w)
    stored = display.transpose(Image.Transpose.ROTATE_90)  # what a camera held sideways writes
    exif = Image.Exif()
    exif[0x0112] = 6  # display = stored rotated 90 degrees clockwise
    item = EncodedImage(ImageRef(0, "rotated.jpg"), encoded(stored, "JPEG", quality=95, exif=exif.tobytes()))
    batch = preprocessor(device).run([item])
    assert batch.orig_hw.tolist() == [[427, 300]]


def test_a_failed_run_needs_a_rebuild_and_then_works():
    from pipeline.preprocess import PreprocessFailure

    p = preprocessor("cpu")
    good = EncodedImage(ImageRef(0, "china.jpg"), np.fromfile(SAMPLES / "china.jpg", np.uint8))
    bad = EncodedImage(ImageRef(1, "bad.jpg"), np.frombuffer(b"\xff\xd8\xff" + b"\x00" * 100, np.uint8))
    with pytest.raises(PreprocessFailure):
        p.run([good, bad])
    p.rebuild()
    assert p.run([good]).orig_hw.tolist() == [[427, 640]]


@cpu_and_cuda()
def test_batches_in_flight_come_back_in_order_and_held_buffers_stay_valid(device):
    p = preprocessor(device, batch_size=2)
    names = ["astronaut.png", "camera.png", "china.jpg", "coffee.png", "grace_hopper.jpg", "chelsea.png"]
    items = [EncodedImage(ImageRef(i, n), np.fromfile(SAMPLES / n, np.uint8)) for i, n in enumerate(names)]
    p.submit(items[0:2])
    p.submit(items[2:4])
    first = p.result()
    first_pixels = as_numpy(first.images).copy()
    p.submit(items[4:6])
    later = [p.result(), p.result()]
    assert [r.index for b in [first, *later] for r in b.refs] == list(range(6))
    # DALI's dynamic executor hands out reference-counted buffers: still intact after later runs.
    assert np.array_equal(as_numpy(first.images), first_pixels)


@cpu_and_cuda()
def test_dali_is_done_with_a_batchs_bytes_once_its_result_is_taken(device):
    # DALI reads the files' bytes in place (external_source no_copy): Preprocessor lets go of a
    # batch's bytes once its result is taken, while the batches after it are still in DALI. Bytes
    # overwritten then (as freed memory may be) must change nothing, in this batch or the next.
    names = ["china.jpg", "grace_hopper.jpg", "astronaut.png", "china.jpg", "grace_hopper.jpg", "camera.png",
             "grace_hopper.jpg", "china.jpg"]

    def run(scribble: bool) -> list[np.ndarray]:
        p = preprocessor(device, batch_size=2)
        batches = [[EncodedImage(ImageRef(i + j, n), np.frombuffer(bytearray((SAMPLES / n).read_bytes()), np.uint8))
                    for j, n in enumerate(names[i:i + 2])] for i in range(0, len(names), 2)]
        p.submit(batches[0])
        p.submit(batches[1])
        pixels = []
        for k, batch in enumerate(batches):
            pixels.append(as_numpy(p.result().images).copy())
            if scribble:
                for item in batch:
                    item.data[:] = 0xFF
            if k + 2 < len(batches):
                p.submit(batches[k + 2])
        return pixels

    expected = run(scribble=False)
    for got, want in zip(run(scribble=True), expected):
        assert np.array_equal(got, want)


def test_a_failure_reports_the_batches_submitted_after_it():
    from pipeline.preprocess import PreprocessFailure

    p = preprocessor("cpu", batch_size=2)
    good = [EncodedImage(ImageRef(i, "china.jpg"), np.fromfile(SAMPLES / "china.jpg", np.uint8)) for i in range(3)]
    bad = EncodedImage(ImageRef(9, "bad.jpg"), np.frombuffer(b"\xff\xd8\xff" + b"\x00" * 100, np.uint8))
    p.submit([good[0]])
    p.submit([bad, good[1]])
    p.submit([good[2]])
    assert p.result().refs[0].index == 0
    with pytest.raises(PreprocessFailure) as info:
        p.result()
    assert [i.ref.index for i in info.value.failed] == [9, 1]
    assert [[i.ref.index for i in b] for b in info.value.unfinished] == [[2]]
    assert not p.in_flight and p.run([good[2]]).refs[0].index == 2


@cpu_and_cuda()
def test_a_short_batch_is_padded_to_one_shape_when_asked(device):
    p = preprocessor(device, batch_size=4, pad_partial_batches=True)
    items = [EncodedImage(ImageRef(i, n), np.fromfile(SAMPLES / n, np.uint8))
             for i, n in enumerate(["china.jpg", "camera.png"])]
    batch = p.run(items)
    assert as_numpy(batch.images).shape[0] == 4 and [r.index for r in batch.refs] == [0, 1]
    assert batch.orig_hw[:2].tolist() == [[427, 640], [512, 512]] and batch.orig_hw[3].tolist() == [512, 512]


@pytest.mark.cuda
def test_decoder_cpu_on_a_gpu_gives_the_cpu_runs_pixels():
    """preprocess.decoder=cpu: JPEGs decoded on the CPU, resized and normalised on the GPU, equal
    the CPU-only pipeline's output up to float rounding; nvJPEG's (the default) may differ by a
    few levels, which this prints."""
    data = np.fromfile(SAMPLES / "grace_hopper.jpg", np.uint8)
    item = EncodedImage(ImageRef(0, "grace_hopper.jpg"), data)
    cpu = as_numpy(preprocessor("cpu").run([item]).images)
    on_gpu = preprocessor("cuda", decoder="cpu").run([item]).images
    assert type(on_gpu).__name__ == "TensorListGPU" or "GPU" in type(on_gpu).__name__
    assert np.abs(as_numpy(on_gpu) - cpu).max() < 0.01
    nvjpeg = as_numpy(preprocessor("cuda").run([item]).images)
    print(f"nvJPEG vs CPU decode after resize: max {np.abs(nvjpeg - cpu).max():.2f}, "
          f"mean {np.abs(nvjpeg - cpu).mean():.3f} levels")


def test_batches_submitted_again_after_a_failure_come_before_a_flush():
    """A FLUSH (a stream fed by requests: nothing more for now) says every batch before it is out;
    a batch DALI had to take again after another's failure is one of them."""
    from pipeline.preprocess import preprocess_stream
    from pipeline.source import FLUSH

    good = [EncodedImage(ImageRef(i, "china.jpg"), np.fromfile(SAMPLES / "china.jpg", np.uint8)) for i in range(3)]
    bad = EncodedImage(ImageRef(9, "bad.jpg"), np.frombuffer(b"\xff\xd8\xff" + b"\x00" * 100, np.uint8))
    errors = []
    out = preprocess_stream(preprocessor("cpu", batch_size=2), [[bad, good[1]], [good[2]], FLUSH, [good[0]]],
                            errors.extend, depth=3)
    order = ["flush" if b is FLUSH else [r.index for r in b.refs] for b in out]
    assert order == [[1], [2], "flush", [0]]
    assert [e.index for e in errors] == [9]
