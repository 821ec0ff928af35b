import gc
import os
from pathlib import Path

import numpy as np
import pytest

from pipeline.source import (EncodedImage, ImageError, ImageRef, ProcessReaders, SourceError, list_images,
                             read_all, read_batches, read_checked, read_file)

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


def _mixed_refs(tmp_path) -> list[ImageRef]:
    """Good photos with a bad file of every kind among them."""
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("hello, not a jpeg")
    (tmp_path / "dir.jpg").mkdir()
    (tmp_path / "café 北京.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes())
    paths = [r.path for r in list_images(SAMPLES)]
    paths[1:1] = [str(tmp_path / n) for n in ["empty.jpg", "text.jpg", "dir.jpg", "missing.jpg", "café 北京.jpg"]]
    return [ImageRef(k, p) for k, p in enumerate(paths)]


def _as_comparable(batches) -> list[list[tuple]]:
    return [[(i.ref, i.data.tobytes()) if isinstance(i, EncodedImage) else i for i in b] for b in batches]


@pytest.mark.parametrize("processes", [1, 3])
def test_reading_in_processes_gives_what_threads_give(tmp_path, processes):
    refs = _mixed_refs(tmp_path)
    threads = list(read_batches(refs, batch_size=3, num_threads=2, max_pixels=300_000))  # 512x600 is over
    worker_read = list(read_batches(refs, batch_size=3, num_threads=2, max_pixels=300_000, processes=processes))
    assert _as_comparable(worker_read) == _as_comparable(threads)
    reasons = [i.reason for b in worker_read for i in b if isinstance(i, ImageError)]
    assert sorted(reasons) == ["empty", "missing", "not_a_file", "too_large", "unknown_format"]
    good = [i for b in worker_read for i in b if isinstance(i, EncodedImage)]
    assert good and all(i.data.dtype == np.uint8 and not i.data.flags.writeable for i in good)


def test_reader_processes_import_this_pipeline_wherever_they_start(tmp_path, monkeypatch):
    (tmp_path / "pipeline").mkdir()  # another project's package of the same name, in the working directory
    (tmp_path / "pipeline" / "__init__.py").write_text("raise ImportError('the wrong pipeline')\n")
    monkeypatch.chdir(tmp_path)
    refs = [ImageRef(k, str(SAMPLES / "china.jpg")) for k in range(3)]
    with ProcessReaders(2) as readers:
        readers.start(refs, batch_size=2)
        readers.submit(0)
        readers.submit(1)
        got = [readers.result(0), readers.result(1)]
        assert readers.alive == [True, True]
    assert _as_comparable(got) == _as_comparable(read_all_batches([refs[:2], refs[2:]]))


def test_a_dead_reader_process_loses_no_image(tmp_path, caplog):
    refs = _mixed_refs(tmp_path)
    expected = _as_comparable(read_all_batches([refs[k:k + 2] for k in range(0, len(refs), 2)]))
    with ProcessReaders(1) as readers:
        readers.start(refs, batch_size=2)
        readers.submit(0)
        readers.submit(1)
        got = [readers.result(0)]
        readers._workers[0].kill()  # batch 1 asked of it, maybe answered; the rest asked of a dead one
        readers._workers[0].wait()
        for k in range(2, len(expected)):
            readers.submit(k)
        got += [readers.result(k) for k in range(1, len(expected))]
        assert readers.alive == [False]
    assert _as_comparable(got) == expected
    assert "file reader process 0" in caplog.text and "read in this process" in caplog.text


def test_a_reader_process_that_fails_on_a_batch_hands_it_back():
    refs = [ImageRef(0, "bad\0name.jpg"), ImageRef(1, str(SAMPLES / "china.jpg"))]  # open() raises ValueError
    with ProcessReaders(1) as readers:
        readers.start(refs, batch_size=1)
        readers.submit(0)
        readers.submit(1)
        with pytest.raises(ValueError, match="null"):
            readers.result(0)  # read here, where the error is the caller's
        assert _as_comparable([readers.result(1)]) == _as_comparable(read_all_batches([refs[1:]]))
        assert readers.alive == [True]


def test_read_file_reads_whole_files_whatever_their_stat_says(tmp_path):
    for path in [SAMPLES / "china.jpg", SAMPLES / "coffee.png"]:
        assert read_file(str(path)) == path.read_bytes()
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert read_file(str(tmp_path / "empty.jpg")) == b""
    # /proc files say 0 bytes and have more: read to the end, not to the size fstat gave
    assert read_file("/proc/self/cmdline") == Path("/proc/self/cmdline").read_bytes() != b""
    with pytest.raises(IsADirectoryError):
        read_file(str(tmp_path))


def read_all_batches(chunks):
    return [read_all(chunk) for chunk in chunks]


def test_stopping_early_ends_the_reader_processes_quietly(capfd):
    refs = [ImageRef(k, str(SAMPLES / "china.jpg")) for k in range(400)]
    batches = read_batches(refs, batch_size=8, num_threads=1, lookahead=6, processes=3)
    assert next(batches)[0].ref.index == 0
    assert len(_reader_processes()) == 3
    batches.close()  # as a consumer that fails mid-run does: answers still owed to it
    assert not _reader_processes()
    assert "Traceback" not in capfd.readouterr().err  # the workers' stderr is the user's terminal


def test_reader_processes_serve_list_after_list_after_a_stream_stopped_early(tmp_path):
    refs = _mixed_refs(tmp_path)
    threads = _as_comparable(read_batches(refs, batch_size=3, num_threads=2, max_pixels=300_000))
    many = [ImageRef(k, str(SAMPLES / "grace_hopper.jpg")) for k in range(40)]
    with ProcessReaders(2) as readers:
        pids = [w.pid for w in readers._workers]
        stopped = read_batches(many, batch_size=2, num_threads=1, lookahead=4, readers=readers)
        assert next(stopped)[0].ref.index == 0
        stopped.close()  # batches 1-4 were asked for: their answers must not be taken for the next list's
        assert sum(readers._owed) > 0
        for _ in range(2):
            got = read_batches(refs, batch_size=3, num_threads=2, max_pixels=300_000, readers=readers)
            assert _as_comparable(got) == threads
        assert readers.alive == [True, True] and readers._owed == [0, 0]
        assert [w.pid for w in readers._workers] == pids and len(_reader_processes()) == 2
    assert not _reader_processes()


def test_reader_processes_end_when_their_owner_is_collected():
    readers = ProcessReaders(1)
    assert len(_reader_processes()) == 1
    del readers
    gc.collect()
    assert not _reader_processes()


def _reader_processes() -> list[str]:
    return [p for p in _children() if "_read_worker" in p]


def _children() -> list[str]:
    """Command lines of this process's living children."""
    found = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.append((status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found
