import pytest

from pipeline.source import EncodedImage, ImageRef, SourceError, list_images, read_batches, read_checked

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
