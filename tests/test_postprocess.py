"""Device postprocess of the end-to-end contract, on hand-made outputs."""

import numpy as np
import pytest
import torch

from pipeline.contracts import recognise
from pipeline.session import TensorSpec
from pipeline.errors import ModelError
from pipeline.contracts.end_to_end import EndToEnd
from pipeline.postprocess import Thresholds, image_meta

from conftest import EXPECTED_FACES, ROOT, SAMPLES, cpu_and_cuda


def meta_for(device, scale_yx, orig_hw, pad_yx=None):
    scale_yx = np.array(scale_yx, np.float32)
    pad_yx = np.zeros_like(scale_yx) if pad_yx is None else np.array(pad_yx, np.float32)
    return image_meta(scale_yx, pad_yx, np.array(orig_hw, np.int64), torch.device(device))


def end_to_end(outputs, meta, *, score_threshold, max_detections, num_landmarks, num_images=None):
    post = EndToEnd(num_landmarks=num_landmarks)
    return post(outputs, meta, num_images=len(meta) if num_images is None else num_images,
                thresholds=Thresholds(score_threshold, 0.5, max_detections)).to_host()


@cpu_and_cuda()
def test_maps_back_thresholds_caps_and_orders(device):
    dev = torch.device(device)
    outputs = {
        "boxes": torch.tensor([[10, 20, 110, 220], [0, 0, 50, 50], [300, 300, 700, 700], [5, 5, 15, 15],
                               [1, 1, 2, 2]], dtype=torch.float32, device=dev),
        "scores": torch.tensor([0.95, 0.5, 0.99, 0.97, 0.96], device=dev),
        "batch_index": torch.tensor([0, 0, 1, 0, 0], device=dev),
        "landmarks": torch.arange(5 * 4, dtype=torch.float32, device=dev).reshape(5, 4),
    }
    # image 0: 200x400 (h x w) scaled by 1.6 in both axes; image 1: 640x320 scaled by 1.0 with a pad.
    meta = meta_for(device, [[1.6, 1.6], [1.0, 1.0]], [[200, 400], [640, 320]], pad_yx=[[0, 0], [0, 100]])
    det = end_to_end(outputs, meta, score_threshold=0.9, max_detections=2, num_landmarks=2)
    # image 0 keeps its two best of three above 0.9 (0.97, 0.96); 0.95 is cut by the cap, 0.5 by the score.
    assert det.batch_index.tolist() == [0, 0, 1]
    assert np.allclose(det.scores, [0.97, 0.96, 0.99])
    assert np.allclose(det.boxes_xyxy[0], np.array([5, 5, 15, 15]) / 1.6)
    # image 1: x shifted by the pad then clipped to its 320 x 640 size.
    assert np.allclose(det.boxes_xyxy[2], [200, 300, 320, 640])
    assert det.landmarks.shape == (3, 2, 2) and np.allclose(det.landmarks[0], np.array([[12, 13], [14, 15]]) / 1.6)
    assert det.labels.tolist() == [0, 0, 0]
    # Rows of images past num_images pad the batch and are dropped.
    padded = end_to_end(outputs, meta, score_threshold=0.9, max_detections=2, num_landmarks=2, num_images=1)
    assert padded.batch_index.tolist() == [0, 0]


@cpu_and_cuda()
def test_no_detections(device):
    dev = torch.device(device)
    outputs = {"boxes": torch.zeros((0, 4), device=dev), "scores": torch.zeros((0,), device=dev),
               "batch_index": torch.zeros((0,), dtype=torch.int64, device=dev),
               "labels": torch.zeros((0,), dtype=torch.int64, device=dev)}
    det = end_to_end(outputs, meta_for(device, [[1, 1]], [[10, 10]]), score_threshold=0.5, max_detections=5,
                     num_landmarks=0)
    assert len(det.scores) == 0 and det.landmarks is None and det.boxes_xyxy.shape == (0, 4)


def test_contract_detection_lists_found_and_expected(tmp_path):
    good = [TensorSpec("boxes", "tensor(float)", ("N", 4)), TensorSpec("scores", "tensor(float)", ("N",)),
            TensorSpec("batch_index", "tensor(int64)", ("N",))]
    assert recognise(good, "auto", tmp_path / "m.onnx").name == "end_to_end"
    bad = [TensorSpec("cls_logits", "tensor(float)", (1, 120087, 80)),
           TensorSpec("bbox", "tensor(float)", (1, 120087, 4))]  # RetinaNet's heads, one misnamed
    with pytest.raises(ModelError) as info:
        recognise(bad, "auto", tmp_path / "m.onnx")
    assert "cls_logits float [1, 120087, 80]" in str(info.value) and "boxes (rank 2)" in str(info.value)


@cpu_and_cuda()
@pytest.mark.parametrize("score_threshold", [0.9, 0.5])
def test_ssd_heads_on_the_device_match_the_in_graph_nms(device, score_threshold):
    """The raw-heads model decoded by SsdHeads (torch) gives the shipped end-to-end model's detections."""
    from pipeline import Detector
    from pipeline.listing import list_images

    def detections(config):
        detector = Detector.from_config(config, device=device, batch_size=8,
                                        overrides=[f"postprocess.score_threshold={score_threshold}"])
        (batch, found), = list(detector.stream(list_images(SAMPLES), on_error=lambda errors: None))
        return detector.contract, found

    contract_heads, heads = detections(ROOT / "configs" / "retinaface_mnet025_heads.yaml")
    contract_e2e, e2e = detections(ROOT / "configs" / "retinaface_mnet025_e2e.yaml")
    assert (contract_heads, contract_e2e) == ("ssd_heads", "end_to_end")
    assert len(heads.scores) == len(e2e.scores) >= 3
    order_h = np.lexsort((-heads.scores, heads.batch_index))
    order_e = np.lexsort((-e2e.scores, e2e.batch_index))
    assert heads.batch_index[order_h].tolist() == e2e.batch_index[order_e].tolist()
    assert np.allclose(heads.scores[order_h], e2e.scores[order_e], atol=1e-5)
    assert np.abs(heads.boxes_xyxy[order_h] - e2e.boxes_xyxy[order_e]).max() < 0.05
    assert np.abs(heads.landmarks[order_h] - e2e.landmarks[order_e]).max() < 0.05


def test_ssd_heads_contract_is_recognised(tmp_path):
    heads = [TensorSpec("loc", "tensor(float)", ("b", 16800, 4)), TensorSpec("conf", "tensor(float)", ("b", 16800, 2)),
             TensorSpec("landmarks", "tensor(float)", ("b", 16800, 10))]
    assert recognise(heads, "auto", tmp_path / "m.onnx").name == "ssd_heads"
    with pytest.raises(ModelError, match="end_to_end"):
        recognise(heads, "end_to_end", tmp_path / "m.onnx")


@cpu_and_cuda()
def test_graph_cache_replays_on_what_the_buffers_hold_now(device):
    """One capture per buffer; every replay computes from the buffer's current contents and the
    current staged values (the engine overwrites its output buffers every batch; the image count
    and the letterbox meta change with every batch)."""
    from pipeline.postprocess import GraphCache

    cache = GraphCache(torch.device(device))
    buffer = torch.zeros(4, 8, device=device)

    def fn(x, num_images, offset, *, scale):
        return x * scale * (torch.arange(len(x), device=x.device)[:, None] < num_images) + offset

    for step, num_images in enumerate((4, 3, 1)):
        buffer.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device))
        offset = torch.full((8,), float(step))
        out = cache(fn, (buffer,), (torch.tensor(num_images), offset), scale=2.0)
        torch.testing.assert_close(out, fn(buffer, torch.tensor(num_images, device=device), offset.to(device),
                                           scale=2.0))
    assert cache.enabled == (device == "cuda") and len(cache._graphs) == (1 if device == "cuda" else 0)


@cpu_and_cuda()
def test_packed_rows_hold_each_images_kept_detections_best_first(device):
    """pack_detections (kept_slots, pack_rows) + PackedDetections against a per-image nonzero: the same rows,
    on the host and on the device; padding images dropped; an image with more detections than
    the reader's first copy holds is read in a second copy, and the next batch's copy is larger."""
    from pipeline.postprocess import BlockReader, PackedDetections, pack_detections

    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    batch, k, cap = 4, 200, 120
    keep = torch.rand(batch, k, generator=g) < torch.tensor([[0.05], [0.0], [0.5], [0.3]])
    keep &= torch.cumsum(keep, 1) <= cap  # image 2 keeps ~100 (> 16, the first copy), image 1 none
    scores = torch.sort(torch.rand(batch, k, generator=g), dim=1, descending=True).values
    labels = torch.randint(0, 91, (batch, k), generator=g)
    xy = torch.rand(batch, k, 2, generator=g) * 300
    boxes = torch.cat([xy, xy + 20], dim=2)
    meta = meta_for(device, [[2.0, 2.0]] * batch, [[200, 150]] * batch)
    keep, scores, labels, boxes = (t.to(dev) for t in (keep, scores, labels, boxes))

    block = pack_detections(scores, labels, boxes, keep, torch.ones(batch, dtype=torch.bool, device=dev), meta, cap)
    reader = BlockReader()

    def packed():
        return PackedDetections(block=block, num_landmarks=0, num_images=3, reader=reader, settle=None)

    found = packed().to_host()
    most = int(keep.sum(1).max())
    assert most > 16 and reader.rows == min(1 << (most - 1).bit_length(), cap)  # read twice, then wider

    image, candidate = keep[:3].nonzero(as_tuple=True)
    assert found.batch_index.tolist() == image.tolist()
    assert np.array_equal(found.scores, scores[image, candidate].cpu().numpy())
    assert np.array_equal(found.labels, labels[image, candidate].cpu().numpy())
    expected = (boxes[image, candidate] / 2).clamp(min=0).cpu().numpy()
    expected = np.minimum(expected, [150, 200, 150, 200])
    assert np.allclose(found.boxes_xyxy, expected)
    on_device = packed().on_device()
    assert on_device.scores.device.type == device
    assert np.array_equal(on_device.to_host().scores, found.scores)
    assert np.array_equal(on_device.to_host().batch_index, found.batch_index)


@cpu_and_cuda()
def test_ssd_heads_finish_an_image_that_does_not_converge_exactly(device, monkeypatch):
    """With one in-graph NMS step, some images' suppression chains do not settle: those images (and
    only those) are done again exactly, and the detections are those of the default steps."""
    from pipeline import Detector
    from pipeline.contracts import ssd_heads
    from pipeline.listing import list_images

    def detections():
        detector = Detector.from_config(ROOT / "configs" / "retinaface_mnet025_heads.yaml", device=device,
                                        batch_size=8, overrides=["postprocess.score_threshold=0.5"])
        (batch, found), = list(detector.stream(list_images(SAMPLES), on_error=lambda errors: None))
        return found, detector.postprocess

    expected, _ = detections()
    monkeypatch.setattr(ssd_heads, "NMS_STEPS", 1)
    redone = []
    packed = ssd_heads.SsdHeads.packed

    def spy(self, *tensors, **options):
        if options.get("sync_every"):
            redone.append(len(tensors[0]))
        return packed(self, *tensors, **options)

    monkeypatch.setattr(ssd_heads.SsdHeads, "packed", spy)
    found, _ = detections()
    assert redone and 0 < redone[0] < 6, redone  # some images, not all six
    assert found.batch_index.tolist() == expected.batch_index.tolist()
    assert np.array_equal(found.scores, expected.scores) and np.allclose(found.boxes_xyxy, expected.boxes_xyxy)
    assert np.allclose(found.landmarks, expected.landmarks)


def sample_detections(config: str, device: str = "cpu", overrides: tuple[str, ...] = ()):
    """The detector of configs/`config` at batch 8 and its detections of the six sample photos (one batch)."""
    from pipeline import Detector
    from pipeline.listing import list_images

    detector = Detector.from_config(ROOT / "configs" / config, device=device, batch_size=8, overrides=overrides)
    (batch, found), = list(detector.stream(list_images(SAMPLES), on_error=lambda errors: None))
    return detector, found


def test_the_default_gpu_model_finds_the_float32_faces():
    """The default config's GPU model (float16 heads, NHWC input), run here on the CPU: the faces of
    the float32 heads model, within 3 px and 0.01 in score (float16 weights and activations)."""
    (_, fp16), (_, fp32) = sample_detections("retinaface_mnet025.yaml", overrides=("model.cpu_path=null",)), \
        sample_detections("retinaface_mnet025_heads.yaml")
    assert fp16.batch_index.tolist() == fp32.batch_index.tolist() and len(fp32.scores) >= 3
    assert np.allclose(fp16.scores, fp32.scores, atol=0.01)
    assert np.abs(fp16.boxes_xyxy - fp32.boxes_xyxy).max() < 3 and np.abs(fp16.landmarks - fp32.landmarks).max() < 3


@pytest.mark.cuda
@pytest.mark.parametrize("batch_size", [32, 4])
def test_the_default_config_on_the_gpu_finds_the_cpus_faces(batch_size):
    """The default config as it runs on a GPU (the float16 heads, ORT's CUDA graph and the config's
    CUDA EP options, the postprocess replayed as CUDA graphs, several batches through the
    pipeline's threads) finds, image by image, the faces it finds on the CPU (the float32 model):
    within 3 px and 0.01 in score. 36 images: at batch 32 a full batch and a short one."""
    from pipeline import Detector
    from pipeline.listing import list_images

    paths = [ref.path for ref in list_images(SAMPLES)] * 6

    def results(device, batch):
        return list(Detector.from_config(device=device, batch_size=batch).run(paths))

    cpu, gpu = results("cpu", 8), results("cuda", batch_size)
    assert [r.index for r in gpu] == [r.index for r in cpu] == list(range(len(paths)))
    assert sum(len(r.scores) for r in cpu) == 6 * sum(EXPECTED_FACES.values())
    for want, got in zip(cpu, gpu):
        assert len(got.scores) == len(want.scores), f"{got.path}: {len(got.scores)} faces, the CPU {len(want.scores)}"
        np.testing.assert_allclose(got.scores, want.scores, atol=0.01, err_msg=got.path)
        assert np.abs(got.boxes_xyxy - want.boxes_xyxy).max(initial=0) < 3, got.path
        assert np.abs(got.landmarks - want.landmarks).max(initial=0) < 3, got.path
