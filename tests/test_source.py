from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import SourceError
from pipeline.results import ImageError, ImageRef
from pipeline.source import EncodedImage, list_images, read_batches, read_checked, read_file

from conftest import SAMPLES


def test_file_list_resolves_relative_paths_against_its_folder_or_root(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(f"# comment\na.jpg\n\n sub/b.png \n{SAMPLES / 'china.jpg'}\n")
    refs = list_images(listing)
    assert refs == [ImageRef(0, str(tmp_path / "a.jpg")), ImageRef(1, str(tmp_path / "sub/b.png")),
                    ImageRef(2, str(SAMPLES / "china.jpg"))]
    assert list_images(listing, root="/data")[0].path == "/data/a.jpg"


def test_folder_is_recursive_sorted_and_filters_extensions(tmp_path):
    for name in ["b.jpg", "a/c.PNG", "notes.txt", "a/d.jpeg"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert [r.path.removeprefix(str(tmp_path) + "/") for r in list_images(tmp_path)] == ["a/c.PNG", "a/d.jpeg", "b.jpg"]
    assert [r.index for r in list_images(tmp_path)] == [0, 1, 2]


def test_glob_and_bad_source(tmp_path):
    assert len(list_images(str(SAMPLES / "*.png"))) == 4
    with pytest.raises(SourceError, match="nowhere"):
        list_images(tmp_path / "nowhere")


def test_read_checked_reasons(tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("hello, not a jpeg")
    (tmp_path / "dir.jpg").mkdir()
    reasons = {name: read_checked(ImageRef(0, str(tmp_path / name))) for name in
               ["empty.jpg", "text.jpg", "dir.jpg", "missing.jpg"]}
    assert {k: v.reason for k, v in reasons.items()} == {
        "empty.jpg": "empty", "text.jpg": "unknown_format", "dir.jpg": "not_a_file", "missing.jpg": "missing"}
    good = read_checked(ImageRef(3, str(SAMPLES / "china.jpg")))
    assert isinstance(good, EncodedImage) and good.data.nbytes == (SAMPLES / "china.jpg").stat().st_size


def test_read_batches_keeps_order_and_a_smaller_last_batch():
    refs = list_images(SAMPLES)
    batches = list(read_batches(refs, batch_size=4, num_threads=2))
    assert [len(b) for b in batches] == [4, 2]
    assert [i.ref.index for b in batches for i in b] == list(range(6))
    assert list(read_batches(refs[:1], batch_size=4, num_threads=2, lookahead=3))[0][0].ref.index == 0
    assert list(read_batches([], batch_size=4, num_threads=1)) == []


def test_read_file_reads_whole_files_whatever_their_stat_says(tmp_path):
    for path in [SAMPLES / "china.jpg", SAMPLES / "coffee.png"]:
        assert read_file(str(path)) == path.read_bytes()
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert read_file(str(tmp_path / "empty.jpg")) == b""
    # /proc files say 0 bytes and have more: read to the end, not to the size fstat gave
    assert read_file("/proc/self/cmdline") == Path("/proc/self/cmdline").read_bytes() != b""
    with pytest.raises(IsADirectoryError):
        read_file(str(tmp_path))




def test_read_batches_reports_every_bad_file_in_its_place(tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("hello, not a jpeg")
    (tmp_path / "dir.jpg").mkdir()
    (tmp_path / "café 北京.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes())
    paths = [r.path for r in list_images(SAMPLES)]
    paths[1:1] = [str(tmp_path / n) for n in ["empty.jpg", "text.jpg", "dir.jpg", "missing.jpg", "café 北京.jpg"]]
    refs = [ImageRef(k, p) for k, p in enumerate(paths)]
    items = [i for b in read_batches(refs, batch_size=3, num_threads=2, max_pixels=300_000) for i in b]
    assert [i.ref.index if isinstance(i, EncodedImage) else i.index for i in items] == list(range(len(refs)))
    reasons = [i.reason for i in items if isinstance(i, ImageError)]
    assert sorted(reasons) == ["empty", "missing", "not_a_file", "too_large", "unknown_format"]  # 512x600 is over
    good = [i for i in items if isinstance(i, EncodedImage)]
    assert good and all(i.data.dtype == np.uint8 for i in good)
