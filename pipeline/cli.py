"""Command line: `gpudet detect | bench | inspect | eval | export | export-coco | draw` (also `python -m pipeline ...`).

It parses and dispatches; exit codes and error messages are errors.py's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__
from .errors import EXIT_OK, EXIT_SOME_FAILED, ConfigError, OutputWriteError, catch_signals, \
    decoder_level, end_command, ensure_standard_streams, guarded, setup_logging, signals_held, stderr_into_log

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger("gpudet")

OUTPUT_FORMATS = ("jsonl", "parquet")
"""--format's choices: sinks.FORMATS, spelled here so that `--help` does not import numpy and orjson."""


def at_least(low: int):
    """argparse type: an integer >= low."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {low}")
        return value
    parse.__name__ = "integer"  # argparse names the type so in its message
    return parse


def score(text: str) -> float:
    """argparse type: a score in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value}: a score is in [0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="messages on stderr at this level and above (default WARNING)")
    common.add_argument("--log-json", action="store_true", help="log one JSON object per line on stderr")
    common.add_argument("--quiet", action="store_true", help="no progress bar and no summary; errors only")
    common.add_argument("--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
                        help="an option for the object store or web server of s3://, gs://, az:// or https:// "
                             "sources (endpoint_url=..., anon=true; repeatable; never logged)")

    parser = argparse.ArgumentParser(prog="gpudet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"gpudet {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    detect = commands.add_parser("detect", parents=[common], help="detect objects in every image of SOURCE",
                                 description="SOURCE is a .txt file list (one path or URL per line), a folder "
                                             "(searched recursively), a glob in quotes, one image file, or a "
                                             "URL (an image, or an s3://, gs:// or az:// prefix).")
    detect.add_argument("source", help="file list (.txt), folder, image file, glob or URL")
    detect.add_argument("--out", required=True, help="output folder (detections.jsonl or detections.parquet/, "
                                                     "errors.jsonl, summary.json), or an s3://, gs:// or az:// "
                                                     "prefix for Parquet")
    detect.add_argument("--format", dest="output_format", choices=OUTPUT_FORMATS,
                        help="how processed images are written: jsonl (default; with --resume, the format the "
                             "folder holds), or parquet (a folder of Parquet files, one row per image; needs pyarrow)")
    detect.add_argument("--config", help="YAML config file, or the name of one gpudet ships (retinaface_mnet025_e2e, "
                                         "...; default: the embedded RetinaFace config)")
    detect.add_argument("--model", help="ONNX model file (overrides model.path)")
    detect.add_argument("--device", help="auto | cpu | cuda | cuda:N (overrides run.device)")
    detect.add_argument("--batch-size", type=int, help="images per batch (overrides run.batch_size; default: the "
                                                       "config's)")
    detect.add_argument("--root", help="folder that relative paths in a file list resolve against "
                                       "(default: the list's folder)")
    detect.add_argument("--score-threshold", type=float, metavar="T",
                        help="keep detections scoring at least T (overrides postprocess.score_threshold; the embedded "
                             "RetinaFace config's is 0.9, its reference's; for mAP give 0.01)")
    detect.add_argument("--save-drawings", metavar="DIR",
                        help="also draw the detections onto each image into DIR once the run ends (as gpudet draw)")
    detect.add_argument("--classes", metavar="NAMES", help="keep only these classes, names or label numbers separated "
                                                           "by commas: person,car (overrides postprocess.classes)")
    detect.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set postprocess.score_threshold=0.5 (repeatable)")
    detect.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: only on a terminal)")
    detect.add_argument("--devices", help="several devices of this host, one worker each: 0,1 | all | "
                                          "cuda:0,cuda:2 | cpu,cpu (results merged into --out)")
    detect.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                        help="run on a Ray cluster (ADDRESS, e.g. ray://head:10001; none: a local one)")
    detect.add_argument("--workers", type=int, help="--ray: detector actors (default 2)")
    again = detect.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue a run in --out: skip images already in its detections or errors.jsonl")
    again.add_argument("--overwrite", action="store_true", help="start again, replacing results already in --out")
    detect.add_argument("--retry-failed", action="store_true",
                        help="with --resume: also process again the images errors.jsonl lists (after fixing them)")

    coco = argparse.ArgumentParser(add_help=False)
    coco.add_argument("detections", help="what gpudet detect wrote: detections.jsonl, detections.parquet or "
                                         "the output folder")
    coco.add_argument("--annotations", required=True, help="COCO annotation file (images, categories)")
    export = commands.add_parser("export-coco", parents=[common, coco],
                                 help="write a COCO results file mapped onto an annotation file's ids")
    export.add_argument("--out", required=True, help="COCO results JSON to write (new, or one export-coco wrote)")
    export_to = commands.add_parser("export", parents=[common], help="records as CSV (one row per detection) or "
                                                                     "YOLO label files (one per image)")
    export_to.add_argument("detections", help="what gpudet detect wrote: detections.jsonl, detections.parquet or "
                                              "the output folder")
    export_to.add_argument("--format", dest="export_format", choices=("csv", "yolo"), required=True,
                           help="csv: a file, one row per detection (an image with none: one row, its box empty); "
                                "yolo: a folder of <image stem>.txt, a line per detection: label cx cy w h score, "
                                "over the image's size")
    export_to.add_argument("--out", required=True, help="the CSV file, or the folder of label files, to write (new, "
                                                        "or one gpudet export wrote: never another's)")
    evaluate = commands.add_parser("eval", parents=[common, coco], help="COCO bbox metrics of gpudet detect's results")
    evaluate.add_argument("--out", help="also write the metrics as JSON here (a new file, or one eval wrote)")

    inspect = commands.add_parser("inspect", parents=[common], help="inputs, outputs, contract and Memcpy "
                                                                    "nodes of an ONNX model")
    inspect.add_argument("model", help="ONNX model file, or the name of one in gpudet's models/ (.onnx optional)")
    inspect.add_argument("--size", type=at_least(1), nargs=2, default=(640, 640), metavar=("HEIGHT", "WIDTH"),
                         help="input size for models whose size is dynamic (default 640 640)")
    inspect.add_argument("--json", action="store_true", help="print JSON")

    bench = commands.add_parser("bench", parents=[common], help="gpudet against the naive loop, the model alone "
                                                                "and DALI alone, in one run")
    bench.add_argument("source", help="images to measure on (make them with scripts/make_image_set.py)")
    bench.add_argument("--config", help="YAML config file or the name of one gpudet ships (as for detect)")
    bench.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    bench.add_argument("--batch-size", type=int, help="images per batch (overrides run.batch_size; default: the "
                                                      "config's)")
    bench.add_argument("--limit", type=at_least(1), default=1000, help="use the first N images (default 1000)")
    bench.add_argument("--iterations", type=at_least(1), default=20,
                       help="repeats of the model-only and DALI-only batch (default 20)")
    bench.add_argument("--passes", type=at_least(1), default=1, metavar="N",
                       help="time gpudet N times over the images and report the median pass (default 1)")
    bench.add_argument("--skip-naive", action="store_true", help="leave out the (slow) naive baseline")
    bench.add_argument("--naive-limit", type=at_least(1), default=300, metavar="N",
                       help="run the naive baseline on the first N images (default 300)")
    bench.add_argument("--latency", type=at_least(0), default=0, metavar="N",
                       help="also time N images one at a time (batch 1): p50/p99 from file to detections "
                            "(default 0: not timed)")
    bench.add_argument("--format", dest="output_format", choices=OUTPUT_FORMATS, default="jsonl",
                       help="how gpudet's passes write their records (as detect --format; default jsonl)")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config key (repeatable), as for detect")
    bench.add_argument("--json", help="also write the report here (a new file, or a report bench wrote)")

    draw = commands.add_parser("draw", parents=[common], help="draw detections onto the images")
    draw.add_argument("detections", help="what gpudet detect wrote: detections.jsonl, detections.parquet or "
                                         "the output folder")
    draw.add_argument("--out", required=True,
                      help="folder for the annotated images (named INDEX_NAME: 00000042_street.jpg)")
    draw.add_argument("--limit", type=at_least(1), help="only the first N images")
    draw.add_argument("--min-score", type=score, default=0.0,
                      help="draw detections scoring at least this (default 0: all)")
    draw.add_argument("--root", help="folder that relative paths in the records resolve against (default: the "
                                     "one detect ran in, from the output folder's summary.json)")
    draw.add_argument("--format", dest="image_format", choices=["jpg", "png", "webp"], default="jpg",
                      help="image format of the drawings (default jpg)")
    for command in commands.choices.values():  # main's error for a word no command knows shows its usage
        command.set_defaults(command_parser=command)
    return parser


def cmd_detect(args: argparse.Namespace) -> int:
    from .config import load_config, option_overrides

    if args.devices is not None and args.ray is not None:
        raise ConfigError("--devices and --ray do not go together: Ray places one actor per GPU itself")
    if args.workers is not None and args.ray is None:
        raise ConfigError("--workers is the number of --ray actors; without --ray, use --devices for several "
                          "devices of this host")
    overrides = args.overrides + option_overrides(model=args.model, device=args.device, batch_size=args.batch_size,
                                                  cli=True) + detect_overrides(args)
    config = load_config(args.config, overrides, origin="--set")
    if args.devices is None and args.ray is None:  # --devices workers start their own (parallel._worker)
        with signals_held():
            from .session import started_early
        with started_early(config):  # the model's first GPU run beside the imports below
            return _detect(args, config)
    return _detect(args, config)


def detect_overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The `--set` overrides --score-threshold and --classes stand for, paired with the option as given."""
    overrides = []
    if args.score_threshold is not None:
        overrides.append((f"--score-threshold {args.score_threshold}",
                          f"postprocess.score_threshold={args.score_threshold!r}"))
    if args.classes is not None:
        names = [c.strip() for c in args.classes.split(",") if c.strip()]
        if not names:
            raise ConfigError(f"--classes {args.classes!r} names no class; give class names or label numbers "
                              "(leave --classes out for every class)")
        listed = ", ".join(name if name.isdigit() else json.dumps(name) for name in names)
        overrides.append((f"--classes {args.classes}", f"postprocess.classes=[{listed}]"))
    return overrides


def _detect(args: argparse.Namespace, config: Config) -> int:
    with signals_held():
        from .job import RunOptions, run_job
    from .folder import written_format
    from .storage import is_url

    mirror, out = None, args.out
    if is_url(args.out):  # an object-store prefix: the run writes a local mirror of it, uploaded as it goes
        from .mirror import Mirror

        if args.output_format not in (None, "parquet"):
            raise ConfigError(f"--out {args.out}: an object-store --out takes --format parquet (JSONL is appended "
                              "to and cut back on --resume, which objects cannot be); give a local --out for JSONL")
        mirror = Mirror(args.out)
        mirror.pull()
        out = mirror.local
    output_format = args.output_format or ("parquet" if mirror else None) or \
        (args.resume and written_format(out)) or "jsonl"
    options = RunOptions(out=out, root=args.root, progress=False if args.quiet else args.progress,
                         output_format=output_format, resume=args.resume, overwrite=args.overwrite,
                         retry_failed=args.retry_failed)
    if args.devices is not None:
        from .parallel import OnDevices, parse_devices

        executor = OnDevices(parse_devices(args.devices))
    elif args.ray is not None:
        from .distributed import OnRay

        executor = OnRay(args.ray or None, 2 if args.workers is None else args.workers,
                         devices=[config.run.device, "cpu"])
    else:
        from .runner import InProcess

        executor = InProcess([config.run.device])
    with mirror.syncing() if mirror else nullcontext():
        result = run_job(args.source, config, options, executor)
    s = result.summary
    if not s["interrupted"]:
        for failure in s["failures"]:
            log.error("%s; what was written is kept: run again with --resume", failure)
        if s["not_recorded"]:
            log.error("%s not recorded; what was written is kept: run again with --resume",
                      counted(s["not_recorded"], "image"))
    keys = ("images", "already_done", "already_failed", "processed", "failed", "detections", "images_per_s",
            "interrupted")
    log.info("run finished", extra={"summary": {k: s[k] for k in keys}})
    if s["interrupted"]:
        log.error("interrupted; results so far are complete; continue with --resume")
    if not args.quiet:
        say(summary_table(s))
        if mirror:
            say(f"        uploaded to {mirror.url} (the local mirror: {mirror.local})")
    if args.save_drawings and not s["interrupted"]:
        return max(result.exit_code, draw_into(s["results"], args.save_drawings, root=None, limit=None, min_score=0.0,
                                               image_format="jpg", quiet=args.quiet))
    return result.exit_code


def say(text: str) -> None:
    """Print to stdout. A reader that closed it (`| head`, `| true`), or stdout closed, is no
    failure of the run's: what cannot be printed is dropped."""
    try:
        print(text, flush=True)
    except (OSError, ValueError):  # Python's advice: stdout to devnull, so that the flush at exit fails no more
        with suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def counted(n: int, noun: str) -> str:
    """'1 detection', '3 detections'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


SUMMARY_TIMES = ("wall", "startup", "total", "setup", "loop")
"""summary.json's seconds that are not stages: from the command, its imports, this run, its setup,
the loop after it (the rate's)."""


def summary_table(s: dict) -> str:
    failed_before = f", {s['already_failed']} of them failed" if s.get("already_failed") else ""
    done = f" (+{s['already_done']} done before{failed_before})" if s["already_done"] else ""
    seconds = s["seconds"]
    found = counted(s["detections"], "detection")
    nothing_left = s["already_done"] == s["images"]
    ran = "nothing left to process" if nothing_left else \
        f"start {seconds['startup']:.2f}s + setup {seconds['setup']:.2f}s, then {s['images_per_s']} img/s on {s['device']}"
    lines = [f"gpudet: {s['processed']}/{s['images']} images{done}, {found}, {s['failed']} failed in "
             f"{seconds['wall']:.2f}s from the command ({ran})"]
    stages = [f"{k} {v:.2f}s" for k, v in seconds.items() if k not in SUMMARY_TIMES]
    if stages and not nothing_left:
        lines.append("        stages: " + ", ".join(stages))
    for w in s.get("workers", []):
        died = w.get("exit_codes", [])[:-1]  # the exit codes of processes restarted after them
        lines.append(f"        worker {w['worker']} on {w['device']}: {counted(w['processed'], 'image')}, "
                     f"{w['failed']} failed, {w['images_per_s'] or '-'} img/s, exit {w['exit_code']}"
                     + (f" (restarted after {', '.join(map(str, died))})" if died else ""))
    if s.get("skipped_not_images"):
        many = s["skipped_not_images"] != 1
        lines.append(f"        skipped: {counted(s['skipped_not_images'], 'file')} of the folder that "
                     f"{'are no images' if many else 'is no image'} (--log-level INFO names them)")
    if s["failed_by_reason"]:
        lines.append("        failed: " + ", ".join(f"{k} {v}" for k, v in sorted(s["failed_by_reason"].items())))
    lines.append(f"        results in {s['results']}" +
                 (f", errors in {s['out']}/errors.jsonl" if s["failed"] or s.get("already_failed") else ""))
    return "\n".join(lines)


def cmd_export_coco(args: argparse.Namespace) -> int:
    from .coco import load_annotations, read_detections, to_coco_results
    from .export import output_file, write_output

    out = output_file(args.out, "--out", "coco")
    matched: set[int] = set()
    results, unmatched = to_coco_results(read_detections(args.detections), load_annotations(args.annotations), matched)
    none_annotated(matched, unmatched, args)
    write_output(out, "--out", json.dumps(results, separators=(",", ":")))  # compact: how gpudet knows it again
    if unmatched:
        log.warning("%d images of %s are not in %s; skipped", unmatched, args.detections, args.annotations)
    if not args.quiet:
        say(f"gpudet: {counted(len(results), 'detection')} written to {args.out}" +
            (f" ({counted(unmatched, 'image')} not in the annotation file)" if unmatched else ""))
    return EXIT_OK


def none_annotated(matched: set[int], unmatched: int, args: argparse.Namespace) -> None:
    """Records, none of whose images the annotation file lists: the wrong file or folder, not a
    score of 0."""
    if unmatched and not matched:
        raise ConfigError(f"no image of {args.detections} ({counted(unmatched, 'image')}) is in {args.annotations} "
                          "(matched by file name); pass the annotation file of the images that run detected")
    if not unmatched and not matched:
        raise ConfigError(f"{args.detections} holds no record of a processed image (its run failed on every image, "
                          "or has not written any yet: see its errors.jsonl); nothing to score")


def cmd_eval(args: argparse.Namespace) -> int:
    from .coco import evaluate, load_annotations, read_detections, to_coco_results
    from .export import output_file, write_output

    out = output_file(args.out, "--out", "metrics") if args.out is not None else None
    gt = load_annotations(args.annotations, for_eval=True)
    matched: set[int] = set()
    results, unmatched = to_coco_results(read_detections(args.detections), gt, matched)
    none_annotated(matched, unmatched, args)
    if len(matched) < len(gt["images"]):
        log.warning("%d of the %d annotated images have no record in %s: they count as images where nothing was "
                    "found (evaluate a finished run, or an annotation file of the images it detected)",
                    len(gt["images"]) - len(matched), len(gt["images"]), args.detections)
    threshold = recorded_threshold(args.detections)
    if threshold is not None and threshold > LOW_SCORE:
        log.warning("the records were made at postprocess.score_threshold %g: mAP counts only detections above it, so "
                    "it reads low; for a comparable mAP detect with --set postprocess.score_threshold=0.01", threshold)
    metrics = evaluate(gt, results)
    per_class = metrics.pop("AP_per_class")
    if not args.quiet:
        annotated = counted(len(gt["images"]), "annotated image")
        made_at = "" if threshold is None else f", made at score_threshold {threshold:g}"
        say("\n".join([f"gpudet eval: {counted(len(results), 'detection')}{made_at} on {annotated}"
                        + (f" ({counted(unmatched, 'detected image')} not annotated)" if unmatched else "")]
                       + [f"  {name:<6} {value:.4f}" for name, value in metrics.items()]
                       + (["  AP per class (IoU 0.50:0.95):"] + [f"    {name:<16} {value:.4f}"
                                                                 for name, value in per_class.items()]
                          if len(per_class) > 1 else [])))
    if out:
        write_output(out, "--out", json.dumps({"metrics": metrics, "AP_per_class": per_class,
                                               "score_threshold": threshold, "detections": len(results),
                                               "unmatched_images": unmatched}, indent=2))
    return EXIT_OK


LOW_SCORE = 0.05
"""A score threshold at or under which records hold enough of the low-scoring detections for mAP
(COCO's own evaluations keep detections down to 0.05 or lower)."""


def recorded_threshold(detections: str) -> float | None:
    """The postprocess.score_threshold the run that wrote `detections` used (its settings.json),
    or None where no settings say."""
    from .layout import SETTINGS, marked_settings, records_folder

    settings = marked_settings(records_folder(Path(detections)) / SETTINGS) or {}
    value = settings.get("postprocess", {}).get("score_threshold") if isinstance(settings.get("postprocess"),
                                                                                   dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def cmd_draw(args: argparse.Namespace) -> int:
    return draw_into(args.detections, args.out, root=args.root, limit=args.limit, min_score=args.min_score,
                     image_format=args.image_format, quiet=args.quiet)


def draw_into(detections: str, out_dir: str, *, root: str | None, limit: int | None, min_score: float,
              image_format: str, quiet: bool) -> int:
    """gpudet draw (and detect --save-drawings): the records of `detections` drawn into out_dir;
    exit 3 where an image could not be drawn."""
    from .coco import read_detections
    from .draw import draw_records, recorded_root
    from .folder import make_folder

    out = Path(out_dir)
    records = read_detections(detections)
    make_folder(out)
    root = root if root is not None else recorded_root(detections)
    try:
        written, skipped = draw_records(records, out, root=root, limit=limit, min_score=min_score,
                                        image_format=image_format)
    except OSError as e:  # writing a drawing (reading an image is a skip): the disk full, a file size limit
        raise OutputWriteError(e.filename or out, e, "the drawings before it are written; make room, or give "
                                                     "--out a folder gpudet may write") from None
    for line in skipped:
        log.warning("not drawn: %s", line)
    if not quiet:
        say(f"gpudet: {counted(len(written), 'image')} drawn into {out_dir}" +
            (f"; {len(skipped)} skipped (listed above; --root if the paths are relative)" if skipped else ""))
    return EXIT_SOME_FAILED if skipped else EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .coco import read_detections
    from .export import output_file, write_csv, write_yolo

    out = output_file(args.out, "--out", "csv") if args.export_format == "csv" else Path(args.out)
    records = read_detections(args.detections)
    try:
        images, found = (write_csv if args.export_format == "csv" else write_yolo)(records, out)
    except OSError as e:
        raise OutputWriteError(e.filename or out, e, "give --out a path gpudet may write, or make room") from None
    if not args.quiet:
        say(f"gpudet: {counted(found, 'detection')} of {counted(images, 'image')} written to {out}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    with signals_held():
        from .modelinfo import format_info, inspect_model

    from .config import model_candidates

    # where --model looks (a bundled model by its name too); inspect_model names the file if none is
    names = [args.model] + ([f"{args.model}.onnx"] if not args.model.endswith(".onnx") else [])
    path = next((c for name in names for c in model_candidates(name) if c.is_file()), Path(args.model))
    info = inspect_model(path, size_hw=tuple(args.size))
    say(json.dumps(info, indent=2) if args.json else format_info(info))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from .config import load_config, option_overrides
    from .export import output_file, write_output

    overrides = args.overrides + option_overrides(device=args.device, batch_size=args.batch_size, cli=True)
    config = load_config(args.config, overrides, origin="--set")
    report_file = output_file(args.json, "--json", "bench") if args.json is not None else None
    with signals_held():
        from .session import started_early
    with started_early(config):  # the model's first GPU run beside the imports below
        with signals_held():
            from .bench import format_report, report_json, run_bench

        with stderr_into_log("library", decoder_level):  # the decoders' lines about bad files, at debug
            report = run_bench(args.source, config, limit=args.limit, iterations=args.iterations,
                               skip_naive=args.skip_naive, naive_limit=args.naive_limit, latency=args.latency,
                               passes=args.passes, output_format=args.output_format,
                               command=shlex.join(["gpudet", *args.argv]))
    say(format_report(report))
    if report_file:
        write_output(report_file, "--json", report_json(report))
    return EXIT_OK


def expanded_glob_hint(args: argparse.Namespace, unknown: list[str]) -> str:
    """What to do when the shell expanded an unquoted glob into several paths: a command takes one
    source."""
    paths = [a for a in unknown if not a.startswith("-")]
    if not hasattr(args, "source") or not paths or not all(os.path.lexists(p) for p in paths[:3]):
        return ""
    return (f" ({len(paths) + 1} paths, where {args.command} takes one source: the shell expanded an unquoted "
            f"glob; quote it, gpudet {args.command} 'photos/*.jpg', or give a folder or a file list)")


def without_storage_values(argv: list[str]) -> list[str]:
    """The command line with each --storage-option's value hidden (it may hold a credential)."""
    shown, hide = [], False
    for word in argv:
        if hide:
            word, hide = word.split("=", 1)[0] + "=...", False
        elif word == "--storage-option":
            hide = True
        elif word.startswith("--storage-option="):
            word = "--storage-option=" + word.split("=", 1)[1].split("=", 1)[0] + "=..."
        shown.append(word)
    return shown


def main(argv: list[str] | None = None) -> int:
    catch_signals()  # from the start: an interrupt during the imports ends as cleanly as one later
    ensure_standard_streams()  # before any file is opened: a closed stderr's number is never a record file's
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's usage, not gpudet's list of commands
        args.command_parser.error(f"unrecognized arguments: {shlex.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}"
                                  + expanded_glob_hint(args, unknown))
    args.argv = without_storage_values(list(sys.argv[1:] if argv is None else argv))  # as reports record it
    if args.storage_options:
        from .storage import set_options

        try:
            set_options(args.storage_options)
        except ConfigError as e:
            args.command_parser.error(str(e))
    setup_logging(args.log_level, args.log_json, args.quiet)
    commands = {"detect": cmd_detect, "export": cmd_export, "export-coco": cmd_export_coco, "eval": cmd_eval, "draw": cmd_draw,
                "inspect": cmd_inspect, "bench": cmd_bench}
    code = guarded(lambda: commands[args.command](with_records_here(with_paths(args))))
    return end_command(code, exit_process=argv is None)  # argv None: this process is the command


PATH_OPTIONS = {"out": "--out", "save_drawings": "--save-drawings", "model": "--model", "annotations": "--annotations",
                "json": "--json", "config": "--config", "root": "--root", "detections": "the records (DETECTIONS)"}


def with_paths(args: argparse.Namespace) -> argparse.Namespace:
    """`args`, where no path is given as an empty string: one that is (an unset shell variable)
    is a usage error, not the current folder."""
    for name, option in PATH_OPTIONS.items():
        if getattr(args, name, None) == "":
            option = "the model (MODEL)" if args.command == "inspect" and name == "model" else option
            raise ConfigError(f"{option} is empty (an unset shell variable?); give a path")
    return args


def with_records_here(args: argparse.Namespace) -> argparse.Namespace:
    """For a command that reads records (draw, eval, export, export-coco) given the object-store
    prefix a `detect --out s3://...` wrote: the prefix's run copied into its local mirror
    (mirror.py, as --resume reads it), which the command then reads."""
    detections = getattr(args, "detections", None)
    if args.command == "detect" or not isinstance(detections, str):
        return args
    from .storage import is_url, scheme

    if not is_url(detections):
        return args
    if scheme(detections) in ("http", "https"):
        raise ConfigError(f"{detections}: records are read from a local output folder or from the s3://, gs:// or "
                          "az:// prefix gpudet detect --out wrote; download that folder first")
    from . import layout
    from .mirror import Mirror

    mirror = Mirror(detections)
    try:
        mirror.pull()
    finally:
        mirror.release()
    if not any((mirror.local / name).exists() for name in (layout.SUMMARY, *layout.DETECTIONS.values())):
        raise ConfigError(f"{detections} holds no run of gpudet detect (no summary.json, no detections.parquet); "
                          "give the prefix that detect --out wrote")
    log.info("%s: its records read from the copy in %s", detections, mirror.local)
    args.detections = str(mirror.local)
    return args

