"""Command line: `gpudet detect ...` (also `python -m pipeline detect ...`).

Exit codes: 0 every image processed; 3 finished, some images failed (see errors.jsonl);
2 bad usage, config, source, model or device; 1 internal error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import traceback

from . import __version__

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_SOME_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpudet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"gpudet {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    detect = commands.add_parser("detect", help="detect objects in every image of SOURCE",
                                 description="SOURCE is a .txt file list (one path per line), a folder "
                                             "(searched recursively) or a glob in quotes.")
    detect.add_argument("source", help="file list (.txt), folder, image file or glob")
    detect.add_argument("--out", required=True, help="output folder (detections.jsonl, errors.jsonl, summary.json)")
    detect.add_argument("--config", help="YAML config (default: the embedded RetinaFace config)")
    detect.add_argument("--model", help="ONNX model file (overrides model.path)")
    detect.add_argument("--device", help="auto | cpu | cuda | cuda:N (overrides run.device)")
    detect.add_argument("--batch-size", type=int, help="images per batch (overrides run.batch_size)")
    detect.add_argument("--root", help="folder that relative paths in a file list resolve against "
                                       "(default: the list's folder)")
    detect.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set postprocess.score_threshold=0.5 (repeatable)")
    detect.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: only on a terminal)")
    again = detect.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue a run in --out: skip images already in detections.jsonl or errors.jsonl")
    again.add_argument("--overwrite", action="store_true", help="start again, replacing results already in --out")
    return parser


def cmd_detect(args: argparse.Namespace) -> int:
    from .config import load_config
    from .runner import run_detect

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={json.dumps(args.model)}")
    if args.device:
        overrides.append(f"run.device={args.device}")
    if args.batch_size is not None:
        overrides.append(f"run.batch_size={args.batch_size}")
    config = load_config(args.config, overrides)
    result = run_detect(args.source, args.out, config, root=args.root, progress=args.progress, resume=args.resume,
                        overwrite=args.overwrite)
    s = result.summary
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in s["seconds"].items() if k != "total")
    if s["interrupted"]:
        print("gpudet: interrupted; results so far are complete; continue with --resume", file=sys.stderr)
    done = f" (+{s['already_done']} done before)" if s["already_done"] else ""
    print(f"gpudet: {s['processed']}/{s['images']} images{done}, {s['detections']} detections, {s['failed']} failed "
          f"in {s['seconds']['total']:.2f}s ({s['images_per_s']} img/s on {s['device']})\n"
          f"        stages: {stages}\n"
          f"        results in {s['out']}/detections.jsonl" + (f", errors in {s['out']}/errors.jsonl" if s["failed"] else ""))
    return result.exit_code


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .config import ConfigError
    from .device import DeviceError
    from .engine import ModelError
    from .detector import GpuOutOfMemory
    from .runner import OutputExistsError
    from .source import SourceError

    # SIGTERM (a scheduler stopping the job) stops as cleanly as Ctrl-C: whole records, a summary.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        return {"detect": cmd_detect}[args.command](args)
    except (ConfigError, DeviceError, ModelError, SourceError, OutputExistsError, GpuOutOfMemory) as e:
        print(f"gpudet: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gpudet: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:
        traceback.print_exc()
        print("gpudet: internal error (exit 1); please report it with the traceback above", file=sys.stderr)
        return EXIT_INTERNAL
