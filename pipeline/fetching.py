"""storage.fetch in processes of their own, for URL sources.

An object fetched costs this process's interpreter a few steps with the GIL held (the request's
completion, its bytes handed over), and each step waits for the GIL while the loop's other threads
(DALI's feeding, the engine's launches, the postprocess, the writer) hold it. Measured on a
2-core machine against a local S3 server: one thread spinning in Python beside the fetches cut
them from 4,100 to 1,900 objects/s. In a process of its own, a fetcher's interpreter serves
fetches only; this one takes each batch's answer as one message (its bytes read from a socket
in one read that waits in the kernel for all of it), and its threads wait for it without
holding the GIL.

Each process runs `serve`: batches of URLs come in on a socket, each is fetched on a thread of
the process (storage.fetch: retries, obstore, the credentials checks), and its answer goes back,
URL -> bytes (views of the one buffer the answer came in) or storage.Unreadable;
CredentialsRefused and SourceError come back and are raised where the batch was asked for. A
process that ends (killed, out of memory) leaves its batches, and every later one, to this
process's own storage.fetch.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import struct
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from . import storage
from .errors import GpudetError, helper_started, one_line, start_helper

log = logging.getLogger("gpudet")

GONE = object()
"""A batch's answer when its process ended before giving one."""


BATCHES = 256
"""Batches one process fetches at once at most, each on a thread of its own (started as they are
needed): the reader that asks bounds how many it has in flight (run.storage_requests)."""


class FetchProcesses:
    """`processes` processes that fetch the batches asked of them; `fetch` as storage.fetch.
    prepare: a URL whose clients each process makes as it starts (storage.prepare), before any
    batch is asked for."""

    def __init__(self, processes: int, prepare: str | None = None):
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._children: list[_Child] = []
        self.broken = self.closed = False
        try:
            for _ in range(processes):
                self._children.append(_Child(prepare))
        except (OSError, ValueError) as e:  # no process to start (limits, memory, no interpreter path)
            for child in self._children:  # those started are let go
                child.close()
            self.broken = True
            log.warning("cannot start a process to fetch objects (%s); fetching them in this one", one_line(e, 200))

    @property
    def processes(self) -> int:
        return len(self._children)

    def fetch(self, urls: list[str]) -> dict[str, storage.Buffer | storage.Unreadable]:
        if not self.broken:
            with self._lock:
                key = next(self._keys)
                child = self._children[key % len(self._children)]
                answer = child.ask(key, urls)
            result, error = answer.result()
            if error is None:
                return result
            if error is not GONE:
                raise error
            if self.closed:  # the run is over: nobody takes this batch
                return {}
            if not self.broken:
                self.broken = True
                log.warning("a process fetching objects ended (%s); fetching the rest in this one", child.why())
        return storage.fetch(urls)

    def close(self) -> None:
        """Let the processes go: each ends once its socket closes (batches in flight are dropped),
        and is waited for on a thread of its own, so that none is left a zombie."""
        self.closed = True
        for child in self._children:
            child.close()


_early: list[FetchProcesses] = []


def start_early(processes: int, url: str) -> None:
    """Start the fetching processes a run's reader takes (`started`), each making `url`'s clients,
    while the caller sets up its detector: a process's interpreter, its imports and its clients
    take a few tenths of a second, which the run's first batches would wait for."""
    drop_early()
    _early.append(FetchProcesses(processes, prepare=url))


def started(processes: int) -> FetchProcesses:
    """The processes start_early started, handed over once where as many are asked for; else
    `processes` new ones."""
    early = _early.pop() if _early else None
    # broken: none could start, which it has said once; its fetches fall back to this process
    if early is not None and (early.processes == processes or early.broken):
        return early
    if early is not None:
        early.close()
    return FetchProcesses(processes)


def drop_early() -> None:
    """Let go of processes start_early started that no reader took."""
    while _early:
        _early.pop().close()


class _Child:
    """One fetching process, the socket to it and the batches it has not answered yet."""

    def __init__(self, prepare: str | None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = start_helper(f"{__name__}.serve", theirs.fileno(), os.getpid(), pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.socket = ours
        self.pending: dict[int, Future] = {}
        self.pending_lock = threading.Lock()
        self.answering = True
        """False once the reader has stopped: a batch asked for then is GONE at once."""
        self.reader = threading.Thread(target=self._read, name="gpudet-fetch-answers", daemon=True)
        self.reader.start()
        if prepare is not None:
            self.ask(None, [prepare])  # answered by none: the process makes the URL's clients

    def ask(self, key: int | None, urls: list[str]) -> Future:
        """The answer to `urls` (key None: storage.prepare them, no answer)."""
        future = Future()
        with self.pending_lock:
            if not self.answering:
                future.set_result((None, GONE))
                return future
            if key is not None:
                self.pending[key] = future
        try:
            send(self.socket, pickle.dumps((key, urls)))
        except OSError:  # the process ended: its reader answers GONE for what it holds
            with self.pending_lock:
                if self.pending.pop(key, None) is not None:
                    future.set_result((None, GONE))
        return future

    def _read(self) -> None:
        try:
            while True:
                head, data = receive(self.socket)
                key, sizes, errors, failure = pickle.loads(head)
                result, start = {}, 0
                for url, size in sizes:  # views of the one buffer the answer came in: no copy
                    result[url] = data[start:start + size]
                    start += size
                result.update(errors)
                with self.pending_lock:
                    future = self.pending.pop(key)
                future.set_result((result, failure) if failure is None else (None, failure))
        except (EOFError, OSError):
            pass
        except Exception as e:  # noqa: BLE001 - an answer it cannot read: the batches go to this process
            log.debug("a fetching process's answer could not be read: %s", e)
        finally:
            with self.pending_lock:
                self.answering = False
                pending, self.pending = self.pending, {}
                for future in pending.values():
                    future.set_result((None, GONE))

    def why(self) -> str:
        code = self.process.poll()
        return f"exit status {code}" if code is not None else "its socket closed"

    def close(self) -> None:
        try:
            self.socket.shutdown(socket.SHUT_RDWR)  # the process ends; the reader wakes
        except OSError:
            pass
        threading.Thread(target=self._reap, name="gpudet-fetch-reap", daemon=True).start()

    def _reap(self) -> None:
        """The process waited for (killed if it has not ended in a few seconds), the socket closed."""
        self.reader.join()
        self.socket.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


FRAME = struct.Struct("<QQ")
"""A message's frame: the sizes of its pickled head and of the raw bytes after it."""


SEND_BUFFERS = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16
"""The most buffers one sendmsg takes (Linux: 1,024)."""


def send(sock: socket.socket, head: bytes, parts: list[storage.Buffer] = ()) -> None:
    """A head, then `parts` one after another, each written from where it is (no copy of them
    joined first)."""
    views = [memoryview(part).cast("B") for part in parts]
    buffers = [memoryview(FRAME.pack(len(head), sum(v.nbytes for v in views)) + head), *views]
    while buffers:
        sent = sock.sendmsg(buffers[:SEND_BUFFERS])  # a batch may hold more objects than one call takes
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers.pop(0).nbytes
        if buffers:
            buffers[0] = buffers[0][sent:]


def receive(sock: socket.socket) -> tuple[bytes, memoryview]:
    """One message: its head, and its raw bytes as a view of one buffer, each read in one call
    that waits in the kernel for all of it (the GIL taken back once, not once per socket buffer)."""
    head_size, data_size = FRAME.unpack(exactly(sock, FRAME.size))
    return bytes(exactly(sock, head_size)), exactly(sock, data_size)


def exactly(sock: socket.socket, size: int) -> memoryview:
    buffer = memoryview(np.empty(size, np.uint8))  # not zero-filled first, with the GIL held
    got = 0
    while got < size:
        n = sock.recv_into(buffer[got:], size - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError
        got += n
    return buffer


def serve(fd: int, parent: int) -> None:
    """A fetching process's loop: each batch that comes in, fetched on a thread of its own, its
    answer sent back: a head (key, [(url, size)], {url: Unreadable}, error) and the fetched bytes
    one after another; a batch without a key, prepared for (storage.prepare), unanswered. Ends
    when the parent closes the socket or dies."""
    helper_started(parent)
    sock = socket.socket(fileno=fd)
    sending = threading.Lock()

    def answer(key: int, urls: list[str]) -> None:
        try:
            sizes, errors, parts = [], {}, []
            for url, value in storage.fetch(urls).items():
                if isinstance(value, storage.Unreadable):
                    errors[url] = value
                else:
                    sizes.append((url, memoryview(value).nbytes))
                    parts.append(value)
            head = pickle.dumps((key, sizes, errors, None))
        except GpudetError as e:  # CredentialsRefused, SourceError: raised in the parent
            head, parts = pickle.dumps((key, [], {}, e)), []
        except BaseException as e:  # noqa: BLE001 - every batch is answered: said in the parent, in one line
            failure = RuntimeError(f"fetching {len(urls)} objects: {type(e).__name__}: {one_line(e, 300)}")
            head, parts = pickle.dumps((key, [], {}, failure)), []
        with sending:
            try:
                send(sock, head, parts)
            except OSError:  # the parent is gone
                os._exit(0)

    pool = ThreadPoolExecutor(BATCHES, thread_name_prefix="gpudet-fetch")
    while True:
        try:
            head, _ = receive(sock)
        except (EOFError, OSError):
            os._exit(0)  # the parent is done: batches in flight are dropped
        key, urls = pickle.loads(head)
        if key is None:
            for url in urls:
                storage.prepare(url)
        else:
            pool.submit(answer, key, urls)
