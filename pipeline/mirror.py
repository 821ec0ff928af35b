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
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from . import layout, storage
from .errors import ConfigError, GpudetError, OutputError, one_line, signals_held
from .folder import hold_lock, remove_shards

log = logging.getLogger("gpudet")

SYNC_S = 5.0
"""How often complete files go up while the run goes on."""
PARTS = layout.DETECTIONS["parquet"]
SYNCED = ".gpudet-mirror.json"
"""In the mirror: gpudet's objects under the prefix as this mirror last left them (name: size and
signature), updated after each upload and removal."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpudet" / "out"


def what_failed(error: BaseException) -> str:
    return one_line(error) or type(error).__name__


class Mirror:
    """The local folder a run writes for an object-store --out, and its uploads."""

    def __init__(self, url: str):
        if storage.scheme(url) in ("http", "https"):
            raise ConfigError(f"--out {url}: gpudet writes to s3://, gs:// and az:// prefixes, not to web servers")
        self.url = url.rstrip("/")
        self.fs, self.path = storage.fs_of(self.url)
        where = f"{self.url} {storage.options().get('endpoint_url', '')}"  # one bucket name on two stores: two
        self.local = cache_root() / hashlib.sha256(where.encode()).hexdigest()[:16]
        self._sent: dict[str, list] = {}
        """Name under the prefix -> [size, signature] of what went up (SYNCED keeps it)."""
        self._summary_up = False
        self._lock = threading.Lock()
        self._held: int | None = None
        """The mirror's lock (hold_lock's descriptor), from pull() until release()."""

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

    def _local_files(self) -> dict[str, list]:
        """gpudet's files in the mirror but the summary: name -> [size, signature]. A part's name is
        its identity (written once, never changed); the other files are known by their content."""
        found = {}
        for name in (layout.SETTINGS, layout.ERRORS):
            path = self.local / name
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                found[name] = [len(data), hashlib.sha256(data).hexdigest()]
        for part in sorted((self.local / PARTS).glob("part-*.parquet")):
            if layout.PARQUET_PART.fullmatch(part.name) and part.is_file() and not part.is_symlink():
                size = part.stat().st_size
                found[f"{PARTS}/{part.name}"] = [size, str(size)]
        return found

    def _write_synced(self) -> None:
        (self.local / SYNCED).write_text(json.dumps(self._sent, sort_keys=True))

    def _last_synced(self) -> dict[str, list] | None:
        try:
            value = json.loads((self.local / SYNCED).read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def pull(self) -> None:
        """Before the run: the mirror made what the prefix holds, the prefix being the run's record.
        Where the prefix is as this mirror last left it, the mirror is as new or newer (uploads
        that failed, removals not yet made) and stays; otherwise another machine wrote the prefix
        since (or this machine never did): the mirror's files and shards the prefix lacks go, and
        its files come down."""
        self._hold()
        try:
            remote = self._remote_names()
            bucket = self.path.split("/", 1)[0]
            if not remote and not self.fs.exists(bucket):  # found now, not by the first upload
                raise OutputError(f"--out {self.url}: the bucket {bucket} does not exist, or these credentials "
                                  "cannot see it; create it, or check the endpoint and the credentials")
            self.local.mkdir(parents=True, exist_ok=True)
            synced = self._last_synced()
            kept = {k: v for k, v in remote.items() if k != layout.SUMMARY}
            if synced is not None and {k: v[0] for k, v in synced.items()} == kept:
                self._sent = synced
            else:
                local = self._local_files()
                for name in local:
                    if name not in remote:
                        (self.local / name).unlink()
                (self.local / layout.SUMMARY).unlink(missing_ok=True)
                remove_shards(self.local)  # another run's records: never merged into this one
                for name in remote:
                    if not name.startswith(PARTS) or local.get(name, [None])[0] != remote[name]:
                        (self.local / name).parent.mkdir(parents=True, exist_ok=True)
                        self.fs.get_file(self._remote(name), str(self.local / name))
                if remote:
                    log.info("the run so far at %s copied to %s", self.url, self.local)
                self._sent = {k: v for k, v in self._local_files().items() if k in kept}
                self._write_synced()
        except GpudetError:
            raise
        except Exception as e:  # noqa: BLE001 (the store, the network, the cache's disk: one line)
            raise OutputError(f"--out {self.url}: cannot read it into {self.local} ({what_failed(e)}); check the "
                              "bucket, the endpoint and the credentials (--storage-option, the AWS_/GOOGLE_/AZURE_ "
                              "variables)") from None
        self._summary_up = layout.SUMMARY in remote

    def _hold(self) -> None:
        """This machine's other commands on the prefix kept out, from before the pull until this
        run's last upload (or the process) ends: the mirror is one folder, and a second command's
        pull or uploads would mix two runs. One line, exit 2, naming the run that holds it."""
        if self._held is None:
            self.local.parent.mkdir(parents=True, exist_ok=True)
            self._held = hold_lock(self.local.parent / f"{self.local.name}.lock", self.url)

    def release(self) -> None:
        """The mirror's lock let go (syncing() does at its end)."""
        if self._held is not None:
            os.close(self._held)
            self._held = None

    def push(self, final: bool = False) -> None:
        """What changed in the mirror made so under the prefix: gpudet's objects the mirror no longer
        holds removed (--overwrite), new and changed files uploaded, each step recorded in SYNCED;
        final: then summary.json. Nothing changed, nothing is done (a refused run, say)."""
        with self._lock:
            local = self._local_files()
            changed = [name for name, sig in local.items() if self._sent.get(name) != sig]
            removed = [name for name in self._sent if name not in local]
            if (changed or removed) and self._summary_up:  # the old summary no longer tells this run
                self.fs.rm_file(self._remote(layout.SUMMARY))
                self._summary_up = False
            for name in removed:
                self.fs.rm_file(self._remote(name))
                del self._sent[name]
                self._write_synced()
            for name in changed:
                self.fs.put_file(str(self.local / name), self._remote(name))
                self._sent[name] = local[name]
                self._write_synced()
            if final and not self._summary_up and (self.local / layout.SUMMARY).is_file():
                self.fs.pipe_file(self._remote(layout.SUMMARY), self._summary())
                self._summary_up = True

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
                    log.warning("uploading to %s: %s; trying again", self.url, what_failed(e))

        thread = threading.Thread(target=loop, name="gpudet-upload", daemon=True)
        with signals_held():  # a stop signal goes to the main thread (errors.signals_held)
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
                if sys.exc_info()[0] is not None:
                    log.warning("uploading to %s: %s", self.url, what_failed(e))
            self.release()
        if failed is not None:  # the run ended: its results are here, not all of them there
            raise OutputError(f"--out {self.url}: uploading the results failed ({what_failed(failed)}); they are kept "
                              f"in {self.local}: run again with --resume to upload them") from None
        log.info("results uploaded to %s", self.url)
