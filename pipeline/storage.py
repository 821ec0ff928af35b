"""Images in object storage and on web servers: s3://, gs://, az:// (abfs://) and http(s):// URLs,
read through fsspec and the back-end each scheme needs (s3fs, gcsfs, adlfs; aiohttp for HTTP: the
extras gpudet[s3], gpudet[gcs], gpudet[azure], gpudet[http]).

Credentials and endpoints are found as those libraries find them (AWS_* variables and
AWS_ENDPOINT_URL, profiles, instance roles, ...); `--storage-option KEY=VALUE` gives them the
options they take (endpoint_url=..., anon=true), never logged. The options reach --devices workers
and Ray actors through the GPUDET_STORAGE_OPTIONS variable.

A source's objects are fetched many at once: tens of requests in flight over the reading threads,
each thread's share of a batch at once. S3 objects go through obstore (Rust, its requests outside
the GIL: s3fs's own spend about a millisecond of the GIL each, which caps a process near a thousand
objects a second), with the endpoint, region and credentials s3fs resolved, so both find them
alike; what obstore cannot fetch (any failure but a missing or refused object) is fetched again
through s3fs, as every other scheme's objects are (fsspec's `cat`). A transient failure (a 5xx status,
throttling, a connection reset, a timeout) is tried again with backoff, TRIES times in all, then
the image is recorded `unreadable` with the error; a missing object is `missing` and a refused one
`forbidden` at once. A refusal of an object the store served before in this run is no object's
fault but the credentials' (expired, revoked): the run stops there, with one line, exit 2, and what
was recorded stays for --resume.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import posixpath
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from typing import TYPE_CHECKING

from . import lines
from .errors import ConfigError, CredentialsRefused, SourceError, one_line, signals_held

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc's from Python 3.12

log = logging.getLogger("gpudet")

SCHEMES = {"s3": "s3fs and obstore (pip install 'gpudet[s3]')", "gs": "gcsfs (pip install 'gpudet[gcs]')",
           "gcs": "gcsfs (pip install 'gpudet[gcs]')", "az": "adlfs (pip install 'gpudet[azure]')",
           "abfs": "adlfs (pip install 'gpudet[azure]')", "abfss": "adlfs (pip install 'gpudet[azure]')",
           "http": "aiohttp (pip install 'gpudet[http]')", "https": "aiohttp (pip install 'gpudet[http]')"}
"""The schemes gpudet reads, and what each needs."""
URL = re.compile(r"([a-z][a-z0-9+.-]*)://", re.IGNORECASE)
OPTIONS_VARIABLE = "GPUDET_STORAGE_OPTIONS"
TRIES = 5
BACKOFF_S = 0.2
"""The first retry's wait, on average; each next one twice as long. Each wait is drawn within
half of that either way, so that fetchers which failed together (a throttled store) do not all
try again together."""
FETCH_THREADS = 256
"""Requests one process has in flight at most on obstore's path (fast_fetch)."""


def scheme(text: str) -> str | None:
    """The URL scheme of `text` that gpudet reads (lower case), or None for a local path."""
    match = URL.match(text)
    return match.group(1).lower() if match and match.group(1).lower() in SCHEMES else None


def is_url(text: str) -> bool:
    return scheme(text) is not None


def named_path(text: str) -> str:
    """What names a record's image, for matching it to annotations and naming files after it: an
    http(s) URL's path without its query and fragment, percent-decoded (a presigned URL's
    signature, `%20` for a space); anything else as written (an object-store key may hold `?`)."""
    if scheme(text) in ("http", "https"):
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(text).path)
    return text


def set_options(pairs: list[str]) -> None:
    """--storage-option KEY=VALUE (VALUE parsed as JSON where it can be: true, 3, "x"), for this
    process and the workers it starts (GPUDET_STORAGE_OPTIONS)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {pair.split('=')[0][:40]!r}: give KEY=VALUE, e.g. "
                              "--storage-option endpoint_url=http://127.0.0.1:9000")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    os.environ[OPTIONS_VARIABLE] = json.dumps(options)
    filesystem.cache_clear()


def options() -> dict:
    try:
        value = json.loads(os.environ.get(OPTIONS_VARIABLE, "{}"))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@lru_cache(maxsize=16)
def filesystem(protocol: str, settings: str):
    """The fsspec filesystem of a scheme with these options (JSON), made once per process."""
    import fsspec
    import fsspec.asyn

    kwargs = json.loads(settings)
    if protocol == "gs" and "endpoint_url" in kwargs:
        # gcsfs asks Google's control plane for each bucket's layout: where there is none (an
        # emulator, another endpoint) each try waits 60 s, and a failed one is tried again
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    if protocol == "s3":  # one request a try: fetch tries again itself, with backoff (botocore's retries
        # and s3fs's under it made an unreachable endpoint cost a minute before the run could stop)
        config = kwargs.setdefault("config_kwargs", {})
        if isinstance(config, dict):
            config.setdefault("retries", {"max_attempts": 1})
    with signals_held():  # fsspec's IO thread (s3fs's, gcsfs's, aiohttp's requests) holds them
        fsspec.asyn.get_loop()
    try:
        fs = fsspec.filesystem(protocol, **kwargs)
    except ImportError:
        raise SourceError(f"{protocol}:// URLs need {SCHEMES[protocol]}") from None
    except (TypeError, ValueError, KeyError) as e:  # s3fs: KeyError for key= and username= both given
        raise ConfigError(f"--storage-option: the {protocol} filesystem does not take these options "
                          f"({e.args[0] if isinstance(e, KeyError) and e.args else e})") from None
    if protocol == "s3":
        fs.retries = 1
    return fs


def fs_of(url: str):
    """(filesystem, its path for `url`)."""
    protocol = scheme(url)
    name = {"gcs": "gs", "abfss": "abfs"}.get(protocol, protocol)
    # --storage-option is for the object stores: aiohttp takes none of their keys (endpoint_url)
    fs = filesystem(name, json.dumps({} if protocol in ("http", "https") else options(), sort_keys=True))
    return fs, url if protocol in ("http", "https") else fs._strip_protocol(url)


def prepare(url: str) -> None:
    """What a fetch of `url` needs made, made now, without a request: its back-end imported, its
    filesystem and credentials found, obstore's store built (a few tenths of a second in a
    fresh process). A problem is left for the fetch to meet and record."""
    try:
        fs, path = fs_of(url)
        if type(fs).__name__ == "S3FileSystem":
            fast_store(fs, path.split("/", 1)[0])
    except Exception as e:  # noqa: BLE001 - the fetch meets it again, and records it
        log.debug("%s: not prepared ahead of its fetch: %s", url, e)


def url_of(fs, path: str, like: str) -> str:
    """The URL of an fsspec path, in the scheme the user wrote (`like`)."""
    if is_url(path):
        return path
    return f"{URL.match(like).group(1)}://{path}"


def list_url(source: str, image_extensions: frozenset[str]) -> list[str]:
    """The URLs a URL source names, sorted: a glob (`*`, `?`, `[`) its matches; a prefix (ending in
    `/`, or a folder of the store) the objects under it whose names are images' (by extension: a
    store cannot be sniffed cheaply); a `.txt` its lines (URLs, or paths relative to the list's
    folder); else the one object."""
    fs, path = fs_of(source)
    named = source.split("?", 1)[0] if scheme(source) in ("http", "https") else source  # a web URL's query: no pattern
    try:
        if any(c in named.split("://", 1)[1] for c in "*?["):
            return sorted(url_of(fs, p, source) for p in fs.glob(path) if not p.endswith("/"))
        if source.endswith("/") or (not named.lower().endswith(".txt") and fs.isdir(path)):
            found = fast_find(fs, path)
            if found is None:
                found = fs.find(path)
            return sorted(url_of(fs, p, source) for p in found
                          if os.path.splitext(p)[1].lower() in image_extensions)
        if named.lower().endswith(".txt"):
            return list_lines(fs.cat_file(path), named)
        if not fs.exists(path):  # one object, as a missing file is: exit 2 before the run
            raise FileNotFoundError(path)
        return [source]
    except FileNotFoundError:
        raise SourceError(f"source {source} does not exist; check the bucket and the path") from None
    except PermissionError as e:
        raise SourceError(f"source {source}: access refused ({e}); check the credentials") from None
    except Exception as e:  # noqa: BLE001 - the back-end's own (no credentials, no endpoint, an option it does not take)
        raise SourceError(f"source {source}: cannot list it ({one_line(e, 200)}); check the endpoint, the "
                          "credentials and the --storage-option values") from None


def list_lines(data: bytes, url: str) -> list[str]:
    """The lines of a file list stored at `url`, read by a local list's rules (lines.list_lines).
    A URL line is taken as written; `/x.jpg` resolves against the store's root (the bucket, the
    host), any other line against the list's folder, `./` and `..` folded."""
    root = re.match(r"[^:/]+://[^/]*", url).group(0)
    folder = url[len(root):].rsplit("/", 1)[0]
    urls = []
    for text in lines.list_lines(data):
        if is_url(text):
            urls.append(text)
            continue
        name, query, rest = text.partition("?")
        path = posixpath.normpath(name if name.startswith("/") else f"{folder}/{name}")
        urls.append(root + "/" + path.lstrip("/") + query + rest)
    return urls


def fast_find(fs, path: str) -> list[str] | None:
    """The objects under an S3 prefix ("bucket/prefix/", s3fs's), listed by obstore (its pages
    parsed outside Python: 2.5x s3fs's rate over 20,000 objects), or None where s3fs lists them:
    not S3, no store, or a listing that failed (s3fs says why)."""
    if type(fs).__name__ != "S3FileSystem":
        return None
    bucket, _, prefix = path.rstrip("/").partition("/")
    store = fast_store(fs, bucket)
    if store is None:
        return None
    import obstore

    try:
        return [f"{bucket}/{meta['path']}" for page in obstore.list(store, prefix=prefix or None) for meta in page]
    except Exception:  # noqa: BLE001 - s3fs lists it again, and says what failed
        return None


class Unreadable(OSError):
    """An object that could not be fetched: `reason` (missing, forbidden, unreadable) and why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # pickled by a fetching process (fetching.py) with both arguments
        return Unreadable, (self.reason, str(self))


def transient(error: BaseException) -> bool:
    """A failure worth trying again: a 5xx or 429 status, throttling, a reset, a timeout. A missing
    or refused object never is; the words of a URL in the message (`:50319/`, `timeout.jpg`) are
    not the failure's."""
    if isinstance(error, (FileNotFoundError, PermissionError)):
        return False
    status = getattr(error, "status", None) or getattr(error, "code", None)
    if isinstance(status, int):
        return status >= 500 or status == 429
    return TRANSIENT_WORDS.search(URL_TEXT.sub(" ", f"{type(error).__name__} {error}")) is not None


TRANSIENT_WORDS = re.compile(r"timeout|timed out|reset|throttl|slowdown|connection|payload|\b(?:50[0234]|429)\b",
                             re.IGNORECASE)
URL_TEXT = re.compile(URL.pattern + r"\S*", re.IGNORECASE)
"""A URL as it stands in a message, to its next space."""


def classified(error: BaseException, tries: int = 1) -> Unreadable:
    """Why an object could not be fetched, after `tries` requests for it."""
    status = getattr(error, "status", None) or getattr(error, "code", None)
    if isinstance(error, FileNotFoundError) or status == 404:
        return Unreadable("missing", "no such object; check the URL")
    if isinstance(error, PermissionError) or status in (401, 403):
        return Unreadable("forbidden", f"access refused ({one_line(error, 160)}); check the credentials")
    after = f" after {tries} tries" if tries > 1 else ""
    return Unreadable("unreadable", f"cannot fetch it{after}: {one_line(error, 200)}")


READ_BEFORE: dict[int, str] = {}
"""Per filesystem (its id), the path of one object it served in this process."""


def check_credentials(fs, refused_url: str) -> None:
    """After a refusal: CredentialsRefused if an object this filesystem served before is refused
    now too (one HEAD request); else the refused objects are the objects' own matter."""
    known = READ_BEFORE.get(id(fs))
    if known is None:
        return
    try:
        fs.info(known)
    except PermissionError as e:
        raise CredentialsRefused(
            f"{refused_url}: the store refuses objects it served earlier in this run ({one_line(e, 120)}): "
            "the credentials expired or were revoked; renew them and run the same command with --resume (the "
            "records written so far are kept)") from None
    except OSError:  # the store unreachable for the moment: the transient path records that
        return


FAST: dict[tuple[int, str], object] = {}
"""Per s3fs filesystem (its id) and bucket, obstore's store for it, or None where there is none."""


def fast_store(fs, bucket: str):
    """obstore's S3Store for `bucket` as s3fs's `fs` reaches it (its endpoint, region and
    credentials, however they were found), or None: not an S3 filesystem, obstore not installed,
    or a bucket the store failed on whole (s3fs fetches those alone)."""
    key = (id(fs), bucket)
    if key not in FAST:
        FAST[key] = None
        if type(fs).__name__ == "S3FileSystem":
            try:
                from obstore.store import S3Store
            except ImportError:
                return None
            FAST[key] = s3_store(S3Store, fs, bucket)
    return FAST[key]


def s3_store(S3Store, fs, bucket: str):
    from fsspec.asyn import sync

    client = sync(fs.loop, fs.set_session)
    endpoint, region = client.meta.endpoint_url, client.meta.region_name or "us-east-1"
    settings = {"region": region, "client_options": {"allow_http": endpoint.startswith("http://"),
                                                     "connect_timeout": "10s", "timeout": "60s"},
                "retry_config": {"max_retries": 0}}  # a failure goes to s3fs, which tries again with backoff
    if not re.match(r"https://s3[.-]([a-z0-9-]+\.)?amazonaws\.com", endpoint):  # AWS's own: obstore finds it by region
        settings["endpoint"] = endpoint
    if fs.anon:
        return S3Store(bucket, skip_signature=True, **settings)
    if fs.key and fs.secret:
        fixed = {"access_key_id": fs.key, "secret_access_key": fs.secret, "token": fs.token, "expires_at": None}
        return S3Store(bucket, credential_provider=lambda: fixed, **settings)
    found = sync(fs.loop, fs.session.get_credentials)  # AWS_* variables, profiles, instance roles, ...
    if found is None:
        return None

    def credentials():  # asked again before `expires_at`: a refreshed session token reaches the store
        frozen = sync(fs.loop, found.get_frozen_credentials)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.now(timezone.utc) + timedelta(minutes=5)}

    return S3Store(bucket, credential_provider=credentials, **settings)


def fast_fetch(fs, paths: list[str]) -> dict[str, Buffer | OSError]:
    """What obstore fetched of `paths` (s3fs's, "bucket/key"), all at once: its buffer (obstore's
    Bytes, read without a copy through the buffer protocol), or
    FileNotFoundError / PermissionError for a missing or refused object; the others are left out
    (s3fs fetches them), all of them where obstore is not installed. A bucket whose store has
    failed every request it made goes to s3fs alone.

    Each object is one blocking get on a thread of FETCHING (obstore lets go of the GIL while it
    waits), and its buffer is handed on as it is: fewer Python steps an object, each of which waits
    for the GIL, than coroutines awaited on an event loop a batch (docs/BENCHMARKS.md, "Images in
    object storage", has the measurement)."""
    try:
        import obstore
        from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError
    except ImportError:
        return {}

    stores = {bucket: fast_store(fs, bucket) for bucket in {p.split("/", 1)[0] for p in paths}}

    def one(path: str) -> Buffer | OSError | None:
        bucket, _, key = path.partition("/")
        try:
            return obstore.get(stores[bucket], key).bytes()  # its buffer, not copied
        except NotFoundError as e:
            return FileNotFoundError(str(e))
        except (PermissionDeniedError, UnauthenticatedError) as e:
            return PermissionError(str(e))
        except Exception:  # noqa: BLE001 - s3fs tries it again, and says what failed
            return None

    todo = [p for p in paths if stores[p.split("/", 1)[0]] is not None]
    got = dict(zip(todo, FETCHING.map(one, todo))) if todo else {}
    SERVED.update((id(fs), path.split("/", 1)[0]) for path, value in got.items() if value is not None)
    for bucket in stores:
        if (id(fs), bucket) not in SERVED:
            FAST[(id(fs), bucket)] = None
    return {path: value for path, value in got.items() if value is not None}


def _new_pool() -> None:
    global FETCHING
    FETCHING = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="gpudet-get")


FETCHING: ThreadPoolExecutor
"""The threads obstore's gets block on, shared by every batch a process fetches (started as
they are needed, up to FETCH_THREADS: requests in flight in one process). A forked child gets a
pool of its own: the parent's threads are not in it."""
_new_pool()
os.register_at_fork(after_in_child=_new_pool)


SERVED: set[tuple[int, str]] = set()
"""The stores in FAST that have answered a request."""


def cat_literal(fs, paths: list[str]) -> dict[str, bytes | BaseException]:
    """Each path's bytes or error, all at once, each path taken as written. fsspec's `cat` reads
    `?`, `*` and `[` as a glob (a presigned URL's query, a key with brackets): it lists before it
    reads, one path at a time, and a bracket's match may be another object."""
    from fsspec.asyn import AsyncFileSystem, sync

    if isinstance(fs, AsyncFileSystem):
        async def all_of() -> list:
            return await asyncio.gather(*(fs._cat_file(p) for p in paths), return_exceptions=True)

        return dict(zip(paths, sync(fs.loop, all_of)))
    got: dict[str, bytes | BaseException] = {}
    for path in paths:
        try:
            got[path] = fs.cat_file(path)
        except Exception as e:  # noqa: BLE001 - classified by the caller
            got[path] = e
    return got


def fetch(urls: list[str]) -> dict[str, Buffer | Unreadable]:
    """Each URL's bytes (bytes, or obstore's bytes-like buffer), fetched concurrently, or why it
    could not be (Unreadable); transient failures tried again with backoff. CredentialsRefused
    where the store stops honouring the credentials mid-run (check_credentials)."""
    results: dict[str, Buffer | Unreadable] = {}
    by_fs: dict[int, tuple] = {}
    for url in urls:
        fs, path = fs_of(url)
        by_fs.setdefault(id(fs), (fs, {}))[1][path] = url
    for fs, paths in by_fs.values():
        todo, wait = list(paths), BACKOFF_S
        if type(fs).__name__ == "S3FileSystem":
            for path, value in fast_fetch(fs, todo).items():
                if not isinstance(value, OSError):
                    results[paths[path]] = value
                    READ_BEFORE.setdefault(id(fs), path)
                else:
                    results[paths[path]] = classified(value)
            todo = [path for path in todo if paths[path] not in results]
        for attempt in range(TRIES if todo else 0):
            try:
                got = cat_literal(fs, todo)
            except Exception as e:  # the whole call failed (the endpoint unreachable): each path's error
                got = dict.fromkeys(todo, e)
            again = []
            for path in todo:
                value = got.get(path)
                if isinstance(value, bytes):
                    results[paths[path]] = value
                    READ_BEFORE.setdefault(id(fs), path)
                elif value is not None and transient(value) and attempt + 1 < TRIES:
                    again.append(path)
                else:
                    error = value if value is not None else OSError("no reply")
                    results[paths[path]] = classified(error, tries=attempt + 1)
            if not again:
                break
            time.sleep(wait * random.uniform(0.5, 1.5))
            todo, wait = again, wait * 2
        refused = [url for url in paths.values() if getattr(results.get(url), "reason", None) == "forbidden"]
        if refused:
            check_credentials(fs, refused[0])
        if id(fs) not in READ_BEFORE:
            check_reachable(fs, [results[url] for url in paths.values()])
    return results


FAILED_FIRST: dict[int, int] = {}
"""Per filesystem (its id) that has served nothing yet, how many objects in a row it refused or
could not serve."""
FAILED_FIRST_LIMIT = 8


def check_reachable(fs, answers: list[bytes | Unreadable]) -> None:
    """Before a filesystem has served anything: SourceError once FAILED_FIRST_LIMIT objects in a
    row were refused or unreadable (the credentials, the endpoint or the network, not the
    objects): one line and exit 2 rather than every image of the list recorded as failed."""
    failed = [a for a in answers if isinstance(a, Unreadable) and a.reason in ("forbidden", "unreadable")]
    if len(failed) < len(answers):
        FAILED_FIRST.pop(id(fs), None)
        return
    FAILED_FIRST[id(fs)] = FAILED_FIRST.get(id(fs), 0) + len(failed)
    if FAILED_FIRST[id(fs)] >= FAILED_FIRST_LIMIT:
        what = ("refused every object asked for" if all(a.reason == "forbidden" for a in failed)
                else "served none of the objects asked for")
        raise SourceError(f"the store {what} ({FAILED_FIRST[id(fs)]} in a row, the last: {one_line(failed[-1], 160)}); "
                          "check the endpoint, the credentials and the --storage-option values, then run the same "
                          "command with --resume (the records written so far are kept)")


def read_url(url: str) -> bytes:
    """One object's bytes (Unreadable if it cannot be fetched)."""
    value = fetch([url])[url]
    if isinstance(value, Unreadable):
        raise value
    return bytes(value)
