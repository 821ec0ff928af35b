"""What can go wrong, the exit code each maps to, and how gpudet logs: one place for all three.

    0    every image was processed
    3    the run finished, but some images failed (errors.jsonl says which and why)
    2    bad usage, config, source, model, device or output folder: the message names it
    4    the output could not be written (disk full, a file size limit, an I/O error): every record
         written before is complete; make room, then --resume
    1    internal error (a bug): a traceback is printed, please report it
    130  interrupted (Ctrl-C, SIGTERM, SIGHUP): what was written is complete; --resume continues.
         One that comes after a run's last record changes nothing (last_record_written)

A problem the user can fix raises a `GpudetError`, whose message names the file, key or value
and says what to do; `guarded` turns it into one line on stderr and its exit code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_SOME_FAILED, EXIT_OUTPUT, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

log = logging.getLogger("gpudet")


def one_line(cause: object, limit: int = 300) -> str:
    """An error's text on one line, whitespace runs as one space, at most `limit` characters (a
    library's message can span lines, or hold a whole file): what a one-line message quotes."""
    return " ".join(str(cause).split())[:limit]


class GpudetError(Exception):
    """A problem the user can fix; the message names what is wrong and what would fix it."""

    exit_code = EXIT_USAGE


class ConfigError(GpudetError, ValueError):
    """A configuration key, option or file that cannot be used."""


class SourceError(GpudetError, ValueError):
    """The source itself (list file, folder, glob) cannot be used."""


class ModelError(GpudetError, ValueError):
    """A model gpudet cannot run; lists what was found and what was expected."""


class DeviceError(GpudetError, RuntimeError):
    """The requested device cannot be used."""


class OutputError(GpudetError, ValueError):
    """The output folder cannot be used as asked (it holds results of another run, say)."""


class OutputWriteError(GpudetError, OSError):
    """Writing a result file failed: disk full, a file size limit, an I/O error."""

    exit_code = EXIT_OUTPUT

    RESUME = "every record written before is complete: make room, then run again with --resume"

    ACCESS = (errno.EACCES, errno.EPERM, errno.EROFS)
    """Not a full disk: a folder gpudet may not write (exit 2, like any --out it cannot use)."""

    def __init__(self, path, error: OSError, advice: str = RESUME):
        reason = {errno.ENOSPC: "the disk is full", errno.EFBIG: "the file size limit is reached (ulimit -f)",
                  errno.EDQUOT: "the disk quota is reached"}.get(error.errno, error.strerror or str(error))
        if error.errno in self.ACCESS:
            self.exit_code = EXIT_USAGE
            advice = "give gpudet write access to it, or write into another --out; what was written before stays"
        super().__init__(f"writing {path} failed: {reason}; {advice}")


class CredentialsRefused(GpudetError, PermissionError):
    """The object store refuses objects it served before in this run: the credentials expired or
    were revoked. The run stops (exit 2); what was recorded stays, for --resume."""


class GpuOutOfMemory(GpudetError, RuntimeError):
    """The model ran out of GPU memory even on one image, or retrying in halves is off."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if hasattr(record, "summary"):
            entry["summary"] = record.summary
        return json.dumps(entry)


class StderrHandler(logging.StreamHandler):
    """gpudet's log lines on a stream; a line that cannot be written (its reader gone: `2>&1 | head`)
    is dropped: a log line never stops or fails a run."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class DroppingWrites:
    """A text stream (stderr, for a progress bar) whose writes that fail (its reader gone, a closed
    descriptor) are dropped, and the ones after them not tried: progress never stops a run."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):  # ValueError: the file object is closed
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.broken = True

    def __getattr__(self, name: str):  # isatty, fileno, encoding: the stream's
        return getattr(self.stream, name)


def ensure_standard_streams() -> None:
    """Standard input, output and error open on something: one that was closed (`2>&-`, `>&-`) is
    opened on /dev/null first thing, so that no file gpudet opens takes its number (a log line
    would be written into the records), and what gpudet prints there is dropped."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # a process this one starts (a --devices worker) gets it too
    if sys.stdout is None:  # Python sets these to None when it starts with the descriptor closed
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process's own stream)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def setup_logging(level: str = "WARNING", as_json: bool = False, quiet: bool = False) -> None:
    """gpudet's messages on stderr, as text (`gpudet: LEVEL: message`) or one JSON object a line."""
    handler = StderrHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if as_json else logging.Formatter("gpudet: %(levelname)s: %(message)s"))
    root = logging.getLogger("gpudet")
    root.handlers[:] = [handler]
    root.setLevel("ERROR" if quiet and level == "WARNING" else level)
    root.propagate = False


def logging_settings() -> tuple[str, bool]:
    """setup_logging's arguments that give another process (a --devices worker) this one's logging:
    its level (--quiet already in it) and whether it logs JSON."""
    root = logging.getLogger("gpudet")
    return logging.getLevelName(root.getEffectiveLevel()), any(isinstance(h.formatter, JsonFormatter)
                                                               for h in root.handlers)


def structured_log() -> bool:
    """Whether gpudet's stderr is to hold only its own log: --log-json (one JSON object a line) or
    --quiet (errors only)."""
    return logging_settings()[1] or logging.getLogger("gpudet").getEffectiveLevel() > logging.WARNING


TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
"""ANSI escape sequences (colours) that libraries write to a terminal."""


@contextmanager
def stderr_into_log(source: str, level_of: Callable[[str], int]) -> Iterator[TextIO]:
    """What libraries write to this process's stderr (Ray's loggers and C++ core, the image
    decoders' complaints) read from a pipe and logged line by line as gpudet's, `source: line` at
    `level_of(line)`, so that --quiet and --log-json hold for them too; gpudet's own messages go to
    the real stderr meanwhile. Yields that real stderr (for a progress bar). A line a library
    writes just before the process aborts may not be read before it ends."""
    gpudet = logging.getLogger("gpudet")
    real = os.dup(2)
    stderr = os.fdopen(os.dup(real), "w", buffering=1)
    # A failed write (the reader of our stderr went away) must not print its report to fd 2: that is
    # the pipe this handler's reader drains, which would feed itself until it blocks. StderrHandler drops it.
    handler = StderrHandler(stderr)
    handler.setFormatter(gpudet.handlers[0].formatter if gpudet.handlers else logging.Formatter())
    handlers = gpudet.handlers[:]
    gpudet.handlers[:] = [handler]
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def forward() -> None:
        with os.fdopen(read, "r", errors="replace") as lines:
            for line in lines:
                line = TERMINAL_CODES.sub("", line).rstrip()  # a library's colours: noise in a log or a JSON line
                if line.strip():
                    gpudet.log(level_of(line), "%s: %s", source, line)

    reader = threading.Thread(target=forward, name=f"gpudet-{source}-stderr", daemon=True)
    reader.start()
    try:
        yield DroppingWrites(stderr)
    finally:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, gone, or None
            sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last writer in this process is gone: the reader ends
        os.close(real)
        reader.join(timeout=5)
        gpudet.handlers[:] = handlers
        handler.close()
        try:
            stderr.close()
        except OSError:  # what it still held cannot be written: its reader is gone
            pass


STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
"""What stops a run: Ctrl-C, a scheduler's SIGTERM, a closed terminal's or ssh session's SIGHUP."""

_interrupted = threading.Event()
_finished = threading.Event()
"""Set once a run has written its last record (last_record_written): interrupts are noted in _late."""
_late: list[int] = []


def _raise_keyboard_interrupt(signum, frame):
    if _finished.is_set():
        _late.append(signum)
        return
    _interrupted.set()
    raise KeyboardInterrupt


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back (blocked) while C libraries load (torch, DALI, ONNX Runtime): an
    interrupt in the middle of their initialisation can come out as an ImportError, or abort the
    process. One that comes meanwhile is delivered when the block ends, as KeyboardInterrupt.
    A thread started in the block holds them for its life: gpudet's background threads (and
    fsspec's) start so, because a signal the kernel hands to a thread that takes it raises
    KeyboardInterrupt in the main thread wherever that is, in the middle of an import too."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def catch_signals() -> None:
    """Ctrl-C, SIGTERM (a scheduler stopping the job) and SIGHUP (its terminal or ssh session
    closed) raise KeyboardInterrupt, and are noted: an interrupt inside a C extension's import can
    come out as another error (ImportError). A command starts here: no run's last record is
    written yet (last_record_written)."""
    _finished.clear()
    _late.clear()
    for stop in STOP_SIGNALS:
        signal.signal(stop, _raise_keyboard_interrupt)


def last_record_written() -> None:
    """A run has written its last record: from here until the command ends (end_command), Ctrl-C
    or SIGTERM is noted, not raised (catch_signals' handler), so that closing its files, writing
    summary.json and printing the summary go on, and the command keeps its exit code."""
    _finished.set()


def end_command(code: int, *, exit_process: bool) -> int:
    """The command is over: an interrupt noted since its run's last record is reported, and the
    note cleared for a next command in this process. exit_process (this process is the command):
    it ends here with `code`, its output flushed. Every file it wrote is closed; what is skipped is
    the libraries' teardown (seconds on a GPU), where an interrupt would still kill it."""
    if exit_process:
        _finished.set()  # an interrupt from here on changes nothing
    if _late and code != EXIT_INTERRUPTED:
        log.warning("%s came after the last record was written: the run was finished first",
                    signal.Signals(_late[0]).name)
    if exit_process:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or its reader gone
                pass
        logging.shutdown()
        os._exit(code)
    _late.clear()
    _finished.clear()
    return code


def guarded(run: Callable[[], int]) -> int:
    """Run a command, mapping what can go wrong to the documented exit codes."""
    catch_signals()
    try:
        return run()
    except GpudetError as e:
        log.error("%s", e)
        return e.exit_code
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    except Exception:
        if _interrupted.is_set():  # the interrupt, turned into another error on its way
            log.error("interrupted")
            return EXIT_INTERRUPTED
        traceback.print_exc()
        log.error("internal error (exit 1); please report it with the traceback above")
        return EXIT_INTERNAL


DECODER_NOISE = re.compile(
    r"libjpeg|libpng|_parser\]|_decoder\]|\bTIFF[A-Z]\w*:|OpenCV TIFF|"
    # OpenCV's image readers (imdecode_, grfmt_png.cpp, ...: what DALI's CPU decoders print) and libtiff's
    r"\bimdecode_|\bgrfmt_\w+\.cpp|\bloadsave\.cpp|OpenJPEG|Input file read error|Bogus \"StripByteCounts\"|"
    # libtiff writes its module's name apart from its message: under load a line may hold the message alone
    r"Read error (at scanline|on strip|at row)|"
    # libtiff's warnings end with a ".\n" written apart: alone on a line when another decoding thread writes between
    r"^\.$|"
    # libjpeg's messages about a file's data (its jerror.h), which it prints with no prefix
    r"Corrupt JPEG|Premature end of (JPEG|input) file|JPEG datastream|Invalid JPEG file structure|Not a JPEG file|"
    r"Unsupported JPEG|Empty JPEG image|Empty input file|JFIF revision|Unsupported marker|Invalid component ID|"
    r"Bogus (Huffman|marker|sampling|JPEG colorspace|DAC|DHT|DQT)|(Huffman|Quantization|Arithmetic) table|"
    r"Huffman code|Invalid SOS parameters|Inconsistent progression|Invalid progressive parameters|"
    r"Sampling factors too large|DCT coefficient out of range|Too many color components|"
    r"Maximum supported image dimension|Unknown Adobe color transform|more than one scan|Image too wide|"
    # nvImageCodec's decoder extensions (nvbmp, nvtiff, ...), which DALI's CPU backend uses too
    r"Code stream size is not big enough|Could not (decode|parse) \w+ (code stream|data)|Could not get image info")
"""What image decoders print about a bad file: libjpeg's, libpng's and libtiff's lines (OpenCV's
too), DALI's nvImageCodec parsers' and decoders' ([jpeg_parser], [png_parser], [..._decoder]) and its
decoder extensions' ("Code stream size is not big enough.", from nvbmp)."""


def decoder_level(line: str) -> int:
    """Debug for what image decoders print about a bad file, a warning for anything else."""
    return logging.DEBUG if DECODER_NOISE.search(line) else logging.WARNING


PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """End this process (SIGKILL) when its parent dies, as Linux's PR_SET_PDEATHSIG does; at once if
    the parent is already gone. A --devices worker so never outlives a parent killed with -9: what
    it wrote is whole lines (a torn last one is cut by --resume), and the folder's lock, which it
    holds too (InheritedFd), ends with it; nor does a process fetching objects (fetching.py)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the call above
        os._exit(EXIT_INTERRUPTED)


def start_helper(function: str, *args: object, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """A process of this interpreter that calls `function` ("pipeline.module.name") with `args`
    (JSON's types), and imports exactly this process's path (`-P`: not the working folder first),
    so this gpudet and these back-ends, whether a checkout, a wheel or a notebook's. It starts with
    the stop signals held: a Ctrl-C to the whole group in its first tenths of a second, before it
    has said how it takes one (`helper_started`), would print its interpreter's traceback.
    ValueError or OSError: none can start."""
    if not sys.executable:
        raise ValueError("this interpreter does not know its own path (sys.executable)")
    module, name = function.rsplit(".", 1)
    code = f"import json, sys; sys.path[:] = json.loads(sys.argv[1]); from {module} import {name}; " \
           f"{name}(*json.loads(sys.argv[2]))"
    with signals_held():
        return subprocess.Popen([sys.executable, "-P", "-c", code, json.dumps([str(p) for p in sys.path]),
                                 json.dumps(args)], pass_fds=pass_fds, stdin=subprocess.DEVNULL)


def helper_started(parent: int) -> None:
    """In a process start_helper started: Ctrl-C ignored (it reaches the whole group: the parent
    decides and ends this one), the stop signals taken back, and an end with the parent (die_with)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with(parent)
