"""--out at an object-store prefix (s3://, gs://, az://) with --format parquet.

The run writes into a local mirror of the prefix, a folder under gpudet's cache
(~/.cache/gpudet/out/HASH, $XDG_CACHE_HOME honoured), where every rule of a local output folder
holds: the lock, --resume, --overwrite, what is gpudet's. Its files go up as they are complete:
each Parquet part once it is renamed into place, settings.json and errors.jsonl with them, and
summary.json last, so that a prefix holding a summary.json holds the whole run. The prefix is
the run's record: each command first makes the mirror what the prefix holds (another machine ran
the job, the cache was cleared or is older), so --resume goes on where any machine left off.
Only gpudet's names are read, written or removed under the prefix (layout.py): other objects
there are never touched.

JSONL stays local: its records are appended to, and --resume cuts an interrupted file back to its
last complete line, which an object store cannot do in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path

from . import layout, storage
from .errors import ConfigError, OutputError

log = logging.getLogger("gpudet")

SYNC_S = 5.0
"""How often complete files go up while the run goes on."""
PARTS = layout.DETECTIONS["parquet"]
SYNCED = ".gpudet-mirror.json"
"""In the mirror: gpudet's objects under the prefix, with their sizes, as the last upload left them."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpudet" / "out"


class Mirror:
    """The local folder a run writes for an object-store --out, and its uploads."""

    def __init__(self, url: str):
        if storage.scheme(url) in ("http", "https"):
            raise ConfigError(f"--out {url}: gpudet writes to s3://, gs:// and az:// prefixes, not to web servers")
        self.url = url.rstrip("/")
        self.fs, self.path = storage.fs_of(self.url)
        self.local = cache_root() / hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self._sent: dict[str, int] = {}
        """Name under the prefix -> the size uploaded."""
        self._lock = threading.Lock()

    def _remote(self, name: str) -> str:
        return f"{self.path}/{name}"

    def _remote_names(self) -> dict[str, int]:
        """gpudet's objects under the prefix, by name relative to it, with their sizes."""
        found = {}
        for name in (layout.SETTINGS, layout.ERRORS, layout.SUMMARY):
            try:
                found[name] = int(self.fs.info(self._remote(name))["size"])
            except FileNotFoundError:
                pass
        try:
            listed = self.fs.ls(self._remote(PARTS), detail=True)
        except FileNotFoundError:
            listed = []
        for entry in listed:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if layout.PARQUET_PART.fullmatch(name) and entry.get("type") != "directory":
                found[f"{PARTS}/{name}"] = int(entry["size"])
        return found

    def _local_names(self) -> dict[str, int]:
        found = {}
        for name in (layout.SETTINGS, layout.ERRORS):
            if (self.local / name).is_file():
                found[name] = (self.local / name).stat().st_size
        for part in sorted((self.local / PARTS).glob("part-*.parquet")):
            if layout.PARQUET_PART.fullmatch(part.name) and part.is_file() and not part.is_symlink():
                found[f"{PARTS}/{part.name}"] = part.stat().st_size
        return found

    def pull(self) -> None:
        """The mirror made what the prefix holds: the prefix is the run's record, whichever machine
        wrote it. gpudet's files the prefix lacks go from the mirror (a part this machine wrote but
        never uploaded is processed again by --resume, never merged with another machine's run);
        those it holds come down where the mirror's differ."""
        try:
            remote = self._remote_names()
        except PermissionError:
            raise OutputError(f"--out {self.url}: the object store refused to list it; check the credentials "
                              "(--storage-option, the AWS_/GOOGLE_/AZURE_ variables)") from None
        self.local.mkdir(parents=True, exist_ok=True)
        local = {**self._local_names(), **({layout.SUMMARY: (self.local / layout.SUMMARY).stat().st_size}
                                           if (self.local / layout.SUMMARY).is_file() else {})}
        # The prefix as this mirror last left it: then what the mirror holds beyond it is this
        # machine's work not uploaded yet (an upload failed), and it stays, to go up with the next.
        unchanged = self._last_synced() == {k: v for k, v in remote.items() if k != layout.SUMMARY}
        for name in local:
            if name not in remote and not (unchanged and name != layout.SUMMARY):
                (self.local / name).unlink()
        fetched = [name for name, size in remote.items()  # unchanged: the mirror's own files are newer
                   if name not in local or not unchanged and (local[name] != size or not name.startswith(PARTS))]
        for name in fetched:
            (self.local / name).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(self._remote(name), str(self.local / name))
        if fetched:
            log.info("the run so far at %s copied to %s", self.url, self.local)
        self._sent = {k: v for k, v in remote.items() if k != layout.SUMMARY}
        self._summary_up = layout.SUMMARY in remote

    def push(self, final: bool = False) -> None:
        """Complete files up; final: parts the run removed (--overwrite) gone from the prefix too,
        then summary.json. A run that changed nothing (refused, say) changes nothing there."""
        with self._lock:
            local = self._local_names()
            changed = [name for name, size in local.items() if self._sent.get(name) != size]
            removed = [name for name in self._sent if name not in local] if final else []
            if (changed or removed) and self._summary_up:  # the old summary no longer tells this run
                self.fs.rm_file(self._remote(layout.SUMMARY))
                self._summary_up = False
            for name in changed:
                self.fs.put_file(str(self.local / name), self._remote(name))
                self._sent[name] = local[name]
            for name in removed:
                self.fs.rm_file(self._remote(name))
                del self._sent[name]
            if final and not self._summary_up and (self.local / layout.SUMMARY).is_file():
                self.fs.pipe_file(self._remote(layout.SUMMARY), self._summary())
                self._summary_up = True
            (self.local / SYNCED).write_text(json.dumps(self._sent, sort_keys=True))

    def _last_synced(self) -> dict[str, int] | None:
        try:
            return json.loads((self.local / SYNCED).read_text())
        except (OSError, ValueError):
            return None

    def _summary(self) -> bytes:
        """summary.json as it goes up: its out and results name the prefix, mirror the folder here."""
        summary = json.loads((self.local / layout.SUMMARY).read_bytes())
        local = str(self.local)
        for key in ("out", "results"):
            if isinstance(summary.get(key), str) and summary[key].startswith(local):
                summary[key] = self.url + summary[key][len(local):]
        return (json.dumps({**summary, "mirror": local}, indent=2) + "\n").encode()

    @contextmanager
    def syncing(self, every_s: float = SYNC_S):
        """Complete files go up every `every_s` seconds while the run goes on; all of them, and
        the summary last, when it ends (also when it was interrupted: what was recorded is kept
        for --resume)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.push()
                except Exception as e:  # noqa: BLE001 (a failed upload is tried again next time and at the end)
                    log.warning("uploading to %s: %s; trying again", self.url, e)

        thread = threading.Thread(target=loop, name="gpudet-upload", daemon=True)
        thread.start()
        failed = None
        try:
            yield self.local
        finally:
            stop.set()
            thread.join()
            try:
                self.push(final=True)
            except Exception as e:  # noqa: BLE001 (said below, or beside the error the run stopped on)
                failed = e
                log.warning("uploading to %s: %s", self.url, e)
        if failed is not None:  # the run ended: its results are here, not all of them there
            raise OutputError(f"--out {self.url}: uploading the results failed ({failed}); they are in "
                              f"{self.local}: run the same command with --resume") from None
        log.info("results uploaded to %s", self.url)
