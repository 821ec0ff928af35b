import os
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import SourceError
from pipeline.results import ImageError, ImageRef
from pipeline.source import EncodedImage, NotAFile, batched, read_checked, read_chunks, read_file
from pipeline.listing import list_images

from conftest import SAMPLES, gpudet, read_jsonl


def test_file_list_resolves_relative_paths_against_its_folder_or_root(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(f"# comment\na.jpg\n\n   \nsub/b.png\n{SAMPLES / 'china.jpg'}\n")
    refs = list_images(listing)
    assert refs == [ImageRef(0, str(tmp_path / "a.jpg")), ImageRef(1, str(tmp_path / "sub/b.png")),
                    ImageRef(2, str(SAMPLES / "china.jpg"))]
    (tmp_path / "data").mkdir()
    assert list_images(listing, root=tmp_path / "data")[0].path == str(tmp_path / "data" / "a.jpg")


def test_a_list_that_repeats_paths_says_how_many_and_keeps_each_line(tmp_path, caplog):
    """docs/SOURCES.md: each line is an image at its own index, a repeated path too; the
    repeats are counted in one warning, so that a list built by appending is noticed."""
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg\nb.jpg\na.jpg\n./b.jpg\nc.jpg\n")
    with caplog.at_level("WARNING", logger="gpudet"):
        refs = list_images(listing)
    assert [r.index for r in refs] == [0, 1, 2, 3, 4] and refs[2].path == refs[0].path
    assert [r.getMessage() for r in caplog.records] == [
        f"{listing}: 2 lines repeat a path listed before; each line is processed and recorded at its own index "
        "(remove the repeats to process each image once)"]
    caplog.clear()
    listing.write_text("a.jpg\nb.jpg\n")
    list_images(listing)
    assert not caplog.records


def test_a_root_that_is_no_folder_or_resolves_nothing_is_refused(tmp_path):
    """--root that does not exist would make every listed path 'missing'; beside a source that is
    not a file list it would do nothing: both refused up front, naming the flag."""
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg\n")
    with pytest.raises(SourceError, match=r"--root .*nope is not a folder"):
        list_images(listing, root=tmp_path / "nope")
    for source in (SAMPLES, SAMPLES / "china.jpg", str(SAMPLES / "*.jpg")):
        with pytest.raises(SourceError, match="applies to a .txt file list's relative paths"):
            list_images(source, root=tmp_path)


def test_the_list_syntax_takes_each_name_as_written(tmp_path):
    """docs/SOURCES.md: a BOM is ignored, \\r\\n endings too; spaces at either end belong to the
    name; # starts a comment only as a line's first character (./#name lists such a file); a name
    that is not UTF-8 comes back byte for byte through os.fsencode."""
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"\xef\xbb\xbfbom.jpg\r\n leading.jpg\ntrailing.jpg \n#comment.jpg\n./#hash.jpg\n"
                        b"caf\xe9.jpg\n  # indented, not a comment\n")
    names = [os.fsencode(r.path)[len(os.fsencode(tmp_path)) + 1:] for r in list_images(listing)]
    assert names == [b"bom.jpg", b" leading.jpg", b"trailing.jpg ", b"#hash.jpg", b"caf\xe9.jpg",
                     b"  # indented, not a comment"]


def test_a_listed_name_with_a_space_at_an_end_is_missing_with_a_hint(tmp_path):
    (tmp_path / "a.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes())
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg \n")
    error = read_checked(list_images(listing)[0])
    assert error.reason == "missing" and "starts or ends with a space" in error.message


@pytest.mark.parametrize("kind", ["empty list", "comments only", "empty folder", "glob of nothing"])
def test_a_source_of_no_images_is_an_error_not_an_empty_success(tmp_path, kind):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("not an image")
    source = {"empty list": tmp_path / "empty.txt", "comments only": tmp_path / "comments.txt",
              "empty folder": tmp_path / "folder", "glob of nothing": str(tmp_path / "*.jpeg")}[kind]
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "comments.txt").write_text("# nothing here\n\n")
    with pytest.raises(SourceError, match="check the source"):
        list_images(source)


def test_only_regular_files_are_read(tmp_path):
    """A FIFO in the list would block a reader forever; a device (/dev/zero) has no end: both are
    refused without reading, as is a file over the size cap."""
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    reasons = {p: read_checked(ImageRef(0, str(p))) for p in [fifo, Path("/dev/zero"), tmp_path]}
    assert {str(p): (e.reason, e.message.split(",")[0]) for p, e in reasons.items()} == {
        str(fifo): ("not_a_file", "is a FIFO (named pipe)"), "/dev/zero": ("not_a_file", "is a character device"),
        str(tmp_path): ("not_a_file", "is a directory")}
    capped = read_checked(ImageRef(0, str(SAMPLES / "china.jpg")), max_bytes=1000)
    assert capped.reason == "too_large" and "over the cap of 1,000" in capped.message


def test_a_png_cut_short_is_refused_before_the_decoder(tmp_path):
    """A PNG without its IEND chunk never reaches DALI, whose CPU PNG decoder can crash the process
    on one; bytes appended after IEND are allowed."""
    whole = (SAMPLES / "astronaut.png").read_bytes()
    for name, data in (("cut.png", whole[:2000]), ("nearly.png", whole[:-1]), ("whole.png", whole),
                       ("appended.png", whole + b"\0" * 1000)):
        (tmp_path / name).write_bytes(data)
    found = {name: read_checked(ImageRef(0, str(tmp_path / name))) for name in ("cut.png", "nearly.png", "whole.png",
                                                                                "appended.png")}
    assert {name: getattr(r, "reason", "read") for name, r in found.items()} == {
        "cut.png": "truncated", "nearly.png": "truncated", "whole.png": "read", "appended.png": "read"}
    assert "cut short" in found["cut.png"].message and "fetch or copy it again" in found["cut.png"].message


def test_folder_is_recursive_sorted_and_filters_extensions(tmp_path):
    for name in ["b.jpg", "a/c.PNG", "notes.txt", "a/d.jpeg"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert [r.path.removeprefix(str(tmp_path) + "/") for r in list_images(tmp_path)] == ["a/c.PNG", "a/d.jpeg", "b.jpg"]
    assert [r.index for r in list_images(tmp_path)] == [0, 1, 2]


def test_glob_and_bad_source(tmp_path):
    assert len(list_images(str(SAMPLES / "*.png"))) == 4
    with pytest.raises(SourceError, match="nowhere does not exist"):
        list_images(tmp_path / "nowhere")
    with pytest.raises(SourceError, match="list.txt does not exist"):
        list_images(tmp_path / "list.txt")


def test_read_checked_reasons(tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("hello, not a jpeg")
    (tmp_path / "dir.jpg").mkdir()
    reasons = {name: read_checked(ImageRef(0, str(tmp_path / name))) for name in
               ["empty.jpg", "text.jpg", "dir.jpg", "missing.jpg"]}
    assert {k: v.reason for k, v in reasons.items()} == {
        "empty.jpg": "empty", "text.jpg": "unknown_format", "dir.jpg": "not_a_file", "missing.jpg": "missing"}
    assert "hello" not in reasons["text.jpg"].message  # the reason, never the file's bytes
    good = read_checked(ImageRef(3, str(SAMPLES / "china.jpg")))
    assert isinstance(good, EncodedImage) and good.data.nbytes == (SAMPLES / "china.jpg").stat().st_size


def read_batches(refs, *, batch_size, **options):
    return read_chunks(batched(refs, batch_size), batch_size=batch_size, **options)


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
    with pytest.raises(NotAFile, match="directory"):
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


def test_a_list_line_with_a_nul_byte_is_an_unreadable_image_and_resume_reads_its_record(tmp_path):
    """A NUL byte cannot be in a file name (a binary file given as the list, say): that line's
    image is recorded as unreadable, the others are processed, and --resume accepts the record."""
    from pipeline.cli import main

    listing = tmp_path / "list.txt"
    listing.write_bytes(b"bad\x00name.jpg\n~a\x00b.jpg\n" + str(SAMPLES / "china.jpg").encode() + b"\n")
    out = tmp_path / "out"
    assert main(["detect", str(listing), "--out", str(out), "--device", "cpu", "--quiet"]) == 3
    error, home = read_jsonl(out / "errors.jsonl")
    assert error["reason"] == "unreadable" and "NUL" in error["message"] and error["path"].endswith("bad\x00name.jpg")
    assert home["reason"] == "unreadable" and home["path"].endswith("~a\x00b.jpg")  # ~ followed by no user name
    assert main(["detect", str(listing), "--out", str(out), "--device", "cpu", "--quiet", "--resume"]) == 3


def test_a_consumer_that_stops_early_does_not_wait_for_the_reads_ahead(monkeypatch):
    """Closing read_chunks (Ctrl-C, an error, a stream stopped) drops the batches read ahead and
    does not wait for one still being read (a slow network file system would hold the exit)."""
    import threading

    from pipeline import source

    release, started = threading.Event(), threading.Event()
    read_all = source.read_all

    def read(items, *args):
        if items[0].index >= 4:  # the second batch on: a read that hangs until the test lets it go
            started.set()
            release.wait(30)
        return read_all(items, *args)

    monkeypatch.setattr(source, "read_all", read)
    chunks = [[ImageRef(4 * b + i, str(SAMPLES / "china.jpg")) for i in range(4)] for b in range(6)]
    stream = read_chunks(iter(chunks), batch_size=4, num_threads=2)
    assert [item.ref.index for item in next(stream)] == [0, 1, 2, 3]
    assert started.wait(10)
    closing = threading.Thread(target=stream.close)
    closing.start()
    closing.join(timeout=5)
    try:
        assert not closing.is_alive(), "closing the stream waited for the reads ahead"
    finally:
        release.set()
        closing.join()


def test_a_folder_lists_what_pathlib_calls_an_image_sorted_as_pathlib_sorts(tmp_path):
    """The folder's walk keeps pathlib's order and suffixes (a name such as ..jpg has the suffix
    .jpg), links to files, and hidden files and folders; a link to a folder is not followed."""
    from pipeline.listing import IMAGE_EXTENSIONS, list_images

    for name in ["b.jpg", "a-b.png", "a/b.jpg", "a/c.txt", "..jpg", ".hidden/d.JPG", "e.webp"]:
        (tmp_path / "f" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "f" / name).write_bytes(b"x")
    (tmp_path / "f" / "link.jpg").symlink_to(tmp_path / "f" / "b.jpg")
    (tmp_path / "f" / "linked").symlink_to(tmp_path / "f" / "a")
    folder = tmp_path / "f"
    expected = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    assert [r.path for r in list_images(folder)] == [str(p) for p in expected]
    assert str(folder / "..jpg") in [r.path for r in list_images(folder)]


def test_a_folder_is_read_by_content_follows_links_outside_it_once_and_counts_what_it_skips(tmp_path):
    """A .jfif, a photo with no extension and a .heic holding JPEG bytes are listed, as a file list
    lists them; a text file and a real HEIC's bytes are skipped and counted; a linked folder outside
    the source is followed, and a loop of links through it walked once."""
    from pipeline.listing import list_images

    jpeg = (SAMPLES / "grace_hopper.jpg").read_bytes()
    src, outside = tmp_path / "src", tmp_path / "elsewhere"
    src.mkdir()
    outside.mkdir()
    for name in ("a.jfif", "noext", "photo.heic", "plain.jpg"):
        (src / name).write_bytes(jpeg)
    (src / "notes.txt").write_text("not an image\n")
    (src / "real.heic").write_bytes(b"\x00\x00\x00\x18ftypheic" + bytes(64))
    (outside / "far.jpg").write_bytes(jpeg)
    (src / "linked").symlink_to(outside)
    (outside / "back").symlink_to(tmp_path)  # a loop: elsewhere/back/elsewhere/back/...
    skipped = []
    listed = [r.path.removeprefix(str(src) + "/") for r in list_images(src, skipped=skipped)]
    assert listed == ["a.jfif", "linked/far.jpg", "noext", "photo.heic", "plain.jpg"]
    assert sorted(p.name for p in skipped) == ["notes.txt", "real.heic"]


def test_a_folders_files_that_are_no_images_are_counted_in_the_summary_and_named_once(tmp_path):
    import json

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes((SAMPLES / "grace_hopper.jpg").read_bytes())
    for name in ("notes.txt", "b.json", "c.txt"):
        (src / name).write_text("{}")
    run = gpudet("detect", src, "--out", tmp_path / "o", "--device", "cpu", "--no-progress", "--log-level", "INFO")
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["images"] == 1 and summary["processed"] == 1 and summary["skipped_not_images"] == 3
    assert "skipped: 3 files of the folder that are no images (--log-level INFO names them)" in run.stdout
    assert f"folder {src}: 3 files that are no images of a format gpudet reads (.txt 2, .json 1; by their first " \
           "bytes) are skipped, e.g. " in run.stderr, run.stderr
