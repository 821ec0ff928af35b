"""One process, one device: `gpudet detect` over a source into an output folder, resumable.

It drives `Detector.stream` (the data path) and writes what comes out through `OutputFolder`:
detections.jsonl (or detections.parquet/), errors.jsonl and summary.json. The --devices workers run this too, each on
its share of the images.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path

from .config import Config
from .errors import last_record_written, signals_held, stderr_into_log
from .results import ImageError, ImageRef
from .sinks import SHARDS, OutputFolder, RunResult
from .source import list_images
from .timing import StageClock, process_seconds


def run_detect(source: str, out_dir: str | Path, config: Config, *, root: str | None = None,
               progress: bool | None = None, output_format: str = "jsonl", resume: bool = False,
               overwrite: bool = False, retry_failed: bool = False) -> RunResult:
    """Detect on every image of `source`, streaming results into `out_dir` (output_format: "jsonl"
    or "parquet", sinks.FORMATS)."""
    with OutputFolder(out_dir, output_format=output_format, resume=resume, overwrite=overwrite,
                      retry_failed=retry_failed) as folder:
        refs = list_images(source, root=root)
        todo = folder.begin(refs, config.result_settings())
        if not todo:
            return recorded_already(folder, config, source=str(source), images=len(refs))
        return detect_into(folder, todo, config, source=str(source), images=len(refs), progress=progress)


def recorded_already(folder: OutputFolder, config: Config, *, source: str, images: int) -> RunResult:
    """A run with every image of its source recorded (--resume of a finished run): the records an
    earlier --devices or --ray run left in shards merged, and a summary of nothing processed. No
    detector is built and torch and DALI are not imported (on a GPU, the model's session that
    session.start_early opened beside the listing is let go when the command ends)."""
    started = datetime.now(timezone.utc)
    startup_s, t0 = process_seconds(), time.perf_counter()
    folder.started()
    merge_shards(folder)
    summary = folder.write_summary(
        source=source, images=images, todo=0, device=config.run.device,
        seconds={"wall": process_seconds(), "startup": startup_s, "total": time.perf_counter() - t0},
        loop_seconds=0.0, started=started, config=config.to_dict())
    return RunResult(summary, folder.tally.exit_code)


def detect_into(folder: OutputFolder, todo: list[ImageRef], config: Config, *, source: str, images: int,
                progress: bool | None) -> RunResult:
    """Build the detector and run it over `todo`, writing into `folder`. images: the source's count."""
    from tqdm import tqdm

    with signals_held():  # torch, DALI and Triton: imported by the runs that build a detector
        from .detector import Detector

    started = datetime.now(timezone.utc)
    startup_s = process_seconds()  # the command's start and imports, before this run's clock
    t0 = time.perf_counter()
    detector = Detector.from_config(config)
    setup_s = time.perf_counter() - t0
    clock = StageClock()
    show = sys.stderr.isatty() if progress is None else progress
    # What libraries print meanwhile goes through the log; the decoders' complaints about a bad file
    # (lines that name no file; errors.jsonl names it) at debug, not onto stderr: a JPEG cut short
    # prints a line per row it misses.
    with stderr_into_log("library", decoder_level) as stderr, folder.writing(), \
            tqdm(total=len(todo), unit="img", disable=not show, file=stderr, dynamic_ncols=True) as bar:
        def failed(errors: list[ImageError]) -> None:
            folder.fail(errors)
            bar.update(len(errors))

        try:
            for batch, found in detector.stream(todo, failed, clock=clock):  # the data path
                with clock("write"):  # sinks: one record per image
                    folder.record(batch, found, detector.labels)
                bar.update(len(batch.refs))
            with clock("write"):  # Parquet: the rows held since its last file
                folder.flush()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was written stays; --resume continues
            folder.tally.interrupted = True
        last_record_written()  # closing the files and the summary go on whatever comes
    merge_shards(folder)
    total_s = time.perf_counter() - t0
    summary = folder.write_summary(
        source=source, images=images, todo=len(todo), device=detector.device.describe(),
        # wall: from the command; startup: its imports, before this run; setup: building the detector
        seconds={"wall": process_seconds(), "startup": startup_s, "total": total_s, "setup": setup_s,
                 **clock.seconds},
        loop_seconds=total_s - setup_s,
        started=started, model=detector.describe(), config=detector.config.to_dict(),
        extra={"model_batch": detector.engine.run_batch or detector.batch_size})
    return RunResult(summary, folder.tally.exit_code)


def merge_shards(folder: OutputFolder) -> None:
    """Merge the records an earlier --devices or --ray run left in shards (begin counted them as
    done) into the folder's files; the shards go once this run was not interrupted."""
    if folder.shards:
        folder.merge()
        if not folder.tally.interrupted:
            folder.drop_shards()
    else:  # the shards folder of a --devices run stopped before its workers wrote: nothing to keep
        with suppress(OSError):
            (folder.path / SHARDS).rmdir()


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
    r"Maximum supported image dimension|Unknown Adobe color transform|more than one scan|Image too wide")
"""What image decoders print about a bad file: libjpeg's, libpng's and libtiff's lines (OpenCV's
too), DALI's nvImageCodec parsers' and decoders' ([jpeg_parser], [png_parser], [..._decoder])."""


def decoder_level(line: str) -> int:
    """Debug for what image decoders print about a bad file, a warning for anything else."""
    return logging.DEBUG if DECODER_NOISE.search(line) else logging.WARNING
