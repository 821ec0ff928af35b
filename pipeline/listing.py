"""Listing: a source (a file list, a folder, a glob, one image file, or a URL prefix, glob or list)
-> indexed image paths, each with the `index` that every result and error record carries (its
position in the list, or in sorted order for folders and globs), so outputs always map back to
inputs. Reading the files is source.py's.
"""

from __future__ import annotations

import codecs
import glob as globlib
import logging
import os
import pickle
import stat
import subprocess
import traceback
from collections import Counter
from pathlib import Path

from . import layout, storage
from .errors import GpudetError, SourceError, helper_started, one_line, start_helper
from .imagefile import sniff_format
from .lines import list_lines
from .results import ImageRef

log = logging.getLogger("gpudet")

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".tif", ".tiff", ".webp", ".jp2",
                              ".pnm", ".ppm", ".pgm"})


def list_images(source: str | os.PathLike, *, root: str | os.PathLike | None = None,
                skipped: list[Path] | None = None) -> list[ImageRef]:
    """Expand SOURCE into indexed image paths: a `.txt` file list (`read_list`), a folder (its image
    files, searched recursively, sorted: `images_in`; the files in it that are no images go to
    `skipped`, and a line says how many), one image file, or a glob (`*`, `?`, `[`; sorted).
    Listed paths are kept even if missing: they fail later with an error record, not silently.
    A source that lists no image at all is an error, so that a typo does not look like success."""
    text = os.fspath(source)
    if not text:
        raise SourceError("the source is empty (''; an unset shell variable?); give a file list (.txt), a folder, "
                          "an image file or a glob in quotes")
    if storage.is_url(text):  # object storage or a web server: storage.list_url
        if root is not None:
            raise SourceError(f"--root {os.fspath(root)} applies to a local .txt file list; leave it out for {text}")
        refs = [ImageRef(i, url) for i, url in enumerate(storage.list_url(text, IMAGE_EXTENSIONS))]
        if not refs:
            raise SourceError(f"{text} holds no image (none named {', '.join(sorted(IMAGE_EXTENSIONS))}); check the "
                              "prefix")
        return refs
    path = Path(text)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except PermissionError as e:
        raise SourceError(f"source {text}: cannot look at it ({e.strerror}): a folder on its path cannot be read; "
                          "give gpudet read access, or another source") from None
    except (OSError, ValueError):  # a name too long, a loop of links, a NUL byte: none of the kinds below
        mode = None
    is_file, is_dir = mode is not None and stat.S_ISREG(mode), mode is not None and stat.S_ISDIR(mode)
    is_list = is_file and path.suffix.lower() == ".txt"
    if root is not None and not is_list:
        raise SourceError(f"--root {os.fspath(root)} applies to a .txt file list's relative paths; {text} is not one: "
                          "leave --root out")
    if root is not None and not Path(root).is_dir():
        raise SourceError(f"--root {os.fspath(root)} is not a folder; give the folder that the list's relative "
                          "paths resolve against, or leave it out (they resolve against the list's folder)")
    if is_dir:
        others: list[Path] = []
        refs = [ImageRef(i, str(p)) for i, p in enumerate(images_in(path, others))]
        if skipped is not None:
            skipped += others
        if others:
            log.info("%s", not_images_line(text, others))
        what = (f"folder {text} holds no image file (none named {', '.join(sorted(IMAGE_EXTENSIONS))}, and none "
                "that starts as an image; searched recursively)")
    elif is_list:
        try:
            refs = read_list(path, Path(root) if root is not None else path.parent)
        except OSError as e:
            raise SourceError(f"file list {text}: cannot read it ({e.strerror or e}); check its permissions and the "
                              "disk it is on") from None
        what = f"file list {text} lists no path (blank lines and lines starting with # are skipped)"
    elif is_file:
        if looks_like_a_list(path):
            raise SourceError(f"source {text} holds text, not an image: a file list's name must end in .txt "
                              f"(rename it {path.with_suffix('.txt').name})")
        return [ImageRef(0, text)]
    elif any(c in text for c in "*?["):
        refs = [ImageRef(i, p) for i, p in enumerate(sorted(p for p in globlib.glob(text, recursive=True)
                                                            if os.path.isfile(p)))]
        what = f"glob {text!r} matches no file (quote it, so that the shell does not expand it first)"
    elif mode is None and not os.path.islink(text):
        if (url := storage.URL.match(text)) is not None:  # a scheme storage.scheme does not read
            raise SourceError(f"source {text}: gpudet reads no {url.group(1)}:// URLs; give an s3://, gs://, az://, "
                              "http:// or https:// URL, or a local path")
        raise SourceError(f"source {text} does not exist; give a file list (.txt), a folder, an image file or a "
                          "glob in quotes")
    else:
        raise SourceError(f"source {text} is not a folder, a .txt file list, an image file or a glob; "
                          "check the path")
    if not refs:
        raise SourceError(f"{what}; check the source")
    return refs


class ListedApart:
    """list_images(url) in a process of its own, started here; `refs()` waits for its answer. A
    store's listing (its pages of requests, each parsed with Python's lock held) and what this
    process does meanwhile (importing torch, DALI and ONNX Runtime, which hold that lock while
    their libraries load) so run side by side, not by turns. The process makes its own clients
    from the same environment (the credentials, --storage-option). Where it cannot start, or ends
    without an answer, refs() lists here."""

    def __init__(self, url: str):
        self.url = url
        self.process: subprocess.Popen | None = None
        read, write = os.pipe()
        self.answers = os.fdopen(read, "rb")
        try:
            self.process = start_helper(f"{__name__}.list_for", url, write, os.getpid(), pass_fds=(write,))
        except (OSError, ValueError) as e:  # no process to start (limits, memory): listed here
            log.debug("cannot start a process to list %s (%s); listing it in this one", url, one_line(e, 200))
        except BaseException:  # a Ctrl-C meanwhile
            self.answers.close()
            raise
        finally:
            os.close(write)

    def refs(self) -> list[ImageRef]:
        """The URL's refs, as list_images gives them, or its error (SourceError: exit 2; another
        error with the listing process's traceback as a note)."""
        answer = None
        if self.process is not None:
            try:
                answer = pickle.loads(self.answers.read())
            except Exception as e:  # noqa: BLE001 - ended without an answer (killed, out of memory): listed here
                log.debug("the process listing %s ended without an answer (%s); listing it in this one", self.url,
                          one_line(e, 200))
            finally:
                self.close()
        if answer is None:
            return list_images(self.url)
        urls, error, where = answer
        if error is not None:
            if not isinstance(error, GpudetError):
                error.add_note(f"raised in the process listing {self.url}:\n{where}")
            raise error
        return [ImageRef(i, url) for i, url in enumerate(urls)]

    def close(self) -> None:
        """The process ended (killed where it has not answered) and waited for."""
        self.answers.close()
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()


def list_for(url: str, fd: int, parent: int) -> None:
    """ListedApart's process: the URL's listing, or the error it raised and where, written to `fd`
    once."""
    helper_started(parent)
    try:
        answer = ([ref.path for ref in list_images(url)], None, None)
    except Exception as e:  # noqa: BLE001 - raised in the parent, as it would be there
        where = traceback.format_exc()
        try:
            answer = (None, pickle.loads(pickle.dumps(e)), where)
        except Exception:  # noqa: BLE001 - an error that does not pickle: its type and words
            answer = (None, RuntimeError(f"listing {url}: {type(e).__name__}: {one_line(e, 300)}"), where)
    with os.fdopen(fd, "wb") as out:
        out.write(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))


def looks_like_a_list(path: Path) -> bool:
    """A file given as one image, not named as one, that starts with no image signature and with a
    line of UTF-8 text: a file list named other than .txt."""
    if path.suffix.lower() in IMAGE_EXTENSIONS:
        return False  # an image file that is not one: its record says so
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False  # read again, and reported, as the image
    first = head.split(b"\n", 1)[0].removeprefix(codecs.BOM_UTF8).strip()
    if not first or sniff_format(head[:16]) is not None or b"\x00" in head:
        return False
    try:
        first.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def images_in(folder: Path, skipped: list[Path] | None = None) -> list[Path]:
    """The image files under `folder`, searched recursively, in pathlib's sorted order. A file
    named as an image (IMAGE_EXTENSIONS) is listed; any other file is listed when its first bytes
    are an image's (a .jfif, a photo with no extension), else it goes to `skipped`. A link to a
    folder outside `folder` is followed (a loop of links is walked once); one to a folder inside it
    is not, its images listed by their own paths. gpudet's own files (the records of an output
    folder, the drawings of `gpudet draw`) are left out (layout.skipped_in_walk). What is named as
    an image but is no regular file (a dangling link, a FIFO) is listed, as a file list lists it,
    so that its record says why it was not read. A folder inside it that cannot be read is named
    in a warning (the images in it cannot be listed, so no record can say they were missed);
    `folder` itself unreadable is an error."""
    found: list[Path] = []
    unreadable: list[OSError] = []
    inside = os.path.realpath(folder)
    walked: set[tuple[int, int]] = set()
    for top, dirs, names in os.walk(folder, onerror=unreadable.append, followlinks=True):
        try:
            here = os.stat(top)
        except OSError:
            continue
        if (here.st_dev, here.st_ino) in walked:  # reached again through links outside: a loop
            dirs[:] = []
            continue
        walked.add((here.st_dev, here.st_ino))
        dirs[:], names = layout.skipped_in_walk(Path(top), dirs, names)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))
                   or not is_within(os.path.realpath(os.path.join(top, d)), inside)]
        for name in names:
            path = Path(top, name)
            if path.suffix.lower() in IMAGE_EXTENSIONS or is_image_file(path):  # pathlib's suffix: ..jpg's is .jpg
                found.append(path)
            elif skipped is not None:
                skipped.append(path)
    for e in unreadable:
        if os.fspath(e.filename) == os.fspath(folder):
            raise SourceError(f"folder {folder}: cannot read it ({e.strerror}); give gpudet read access, or "
                              "another source")
        log.warning("%s: cannot read this folder (%s): the images in it are not listed and get no record; to "
                    "detect them, give gpudet read access to it and run again", e.filename, e.strerror)
    return sorted(found)


def is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def is_image_file(path: Path) -> bool:
    """Whether a regular file starts as an image of a format gpudet reads does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and sniff_format(os.read(fd, 16)) is not None
    except OSError:
        return False
    finally:
        os.close(fd)


def not_images_line(folder: str, skipped: list[Path]) -> str:
    """One line on the files of a folder source that are no images, by kind (their extensions)."""
    kinds = Counter(p.suffix.lower() or "no extension" for p in skipped)
    shown = ", ".join(f"{kind} {n}" for kind, n in kinds.most_common(5)) + (", ..." if len(kinds) > 5 else "")
    many = len(skipped) != 1
    return (f"folder {folder}: {len(skipped)} file{'s' if many else ''} that {'are no images' if many else 'is no image'} "
            f"of a format gpudet reads ({shown}; by their first bytes) {'are' if many else 'is'} skipped, e.g. "
            f"{skipped[0]}")


def read_list(path: Path, base: Path) -> list[ImageRef]:
    """A file list, one path per line, taken as written: only the line ending (\\n or \\r\\n) is
    not part of it, so spaces at either end belong to the name. A line that is empty or holds
    only whitespace is skipped, and so is a line that starts with `#` (list a file whose name
    starts with # as `./#name`). A UTF-8 byte-order mark at the start of the file is ignored.
    Paths are UTF-8; other bytes are taken as they are, as the file system's names are (a
    record's path gives them back through os.fsencode). A relative path resolves against `base`
    (--root, else the list's folder); a leading ~ is the home folder. A path listed twice is two
    images, at two indexes; how many lines repeat one before is logged as a warning."""
    base_text = str(base)
    refs = [ImageRef(k, resolved(base_text, line)) for k, line in enumerate(list_lines(path.read_bytes()))]
    repeats = len(refs) - len({ref.path for ref in refs})
    if repeats:
        log.warning("%s: %d %s a path listed before; each line is processed and recorded at its own index "
                    "(remove the repeats to process each image once)", path, repeats,
                    "line repeats" if repeats == 1 else "lines repeat")
    return refs


def resolved(base: str, text: str) -> str:
    """str(Path(base) / Path(expanduser(text))), as pathlib writes it, without pathlib's cost on
    the plain names of a list of millions (~20 us a line): those are joined by hand, anything
    pathlib would normalise (//, ./, a trailing /, ~) goes through it. A URL (s3://, https://, ...)
    is taken as it is."""
    if "://" in text and storage.is_url(text):
        return text
    if text.startswith("~") or "//" in text or "/./" in text or text.startswith("./") or text.endswith(("/", "/.")) \
            or text == "." or base in (".", "") or base.endswith("/"):
        try:
            item = Path(os.path.expanduser(text))  # pathlib's expanduser raises for an unknown user (~nobody)
        except ValueError:  # a NUL byte after the ~: the path is recorded as unreadable when it is read
            item = Path(text)
        return str(item if item.is_absolute() else Path(base) / item)
    return text if text.startswith("/") else base + "/" + text
