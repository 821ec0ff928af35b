"""Render docs/BENCHMARKS.md's tables and the README's speed table from the reports in docs/bench/.

Each report is a file a run wrote on the GPU machine (`gpudet bench --json`, bench_retinanet.json,
a run's summary.json), kept as it came back, with the commit of the tree that ran it ("tree").
No number in those tables is typed by hand: change a report, run this, commit both.

A number in the prose around them must be in a report too: every number in docs/BENCHMARKS.md
and in the README's speed section, outside the tables and code, appears (at the precision written,
or as a percentage) in a report its section names (a file of docs/bench/, or a folder of them) or
renders. Versions, dates, sizes (640x640), names with digits (H200, fp16) and single digits are
not measurements and are left alone.

    python scripts/render_benchmarks.py          # rewrite the tables between the markers
    python scripts/render_benchmarks.py --check  # exit 1 if the docs are not what the reports say
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "docs" / "bench"


def load(name: str) -> dict:
    return json.loads((BENCH / f"{name}.json").read_text())


def num(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def passes(report: dict, digits: int = 0) -> str:
    """A `gpudet bench` report's loop rate of each pass, comma-separated (its median alone where a
    report has no passes)."""
    return ", ".join(num(p, digits) for p in report.get("gpudet_passes_images_per_s",
                                                        [report["images_per_s"]["gpudet"]]))


def retinaface_table() -> str:
    rows = [("the default, `retinaface_mnet025.yaml`", "retinaface_default"),
            ("the default, again on a later tree (one pass)", "retinaface_default_2"),
            ("the default, again on a later tree", "retinaface_default_3"),
            ("the default, with the postprocess's Triton kernels", "retinaface_default_4"),
            ("the default, the kernels compiled while the rest sets up", "retinaface_default_5"),
            ("the default, the model's first run beside the imports (two passes)", "retinaface_default_6"),
            ("the default, the session opened on the engine's thread", "retinaface_default_7"),
            ("the default, after the fixes of two new-user trials", "retinaface_default_8"),
            ("the default with `postprocess.compile=true`", "retinaface_default_compiled"),
            ("`retinaface_mnet025_e2e.yaml` (NMS in the ONNX graph)", "retinaface_e2e"),
            ("before: its default (the end-to-end model)", "before_retinaface_default"),
            ("before: its fast config, `postprocess.compile=false`", "before_retinaface_heads_fp16")]
    lines = ["| config | tree | gpudet loop img/s (each pass) | setup | ORT alone | DALI alone | naive | GPU busy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, name in rows:
        r = load(name)
        rates, setup = r["images_per_s"], r["gpudet_setup_s"]
        took = f"{setup['since_start']:.1f} s from the command" if "since_start" in setup else \
            f"{setup['detector']:.1f} s building the detector"
        lines.append(f"| {label} | {r['tree']['commit']} | **{num(rates['gpudet'])}** ({passes(r)}) | {took} | "
                     f"{num(rates['model'])} | {num(rates['preprocess'])} | {num(rates.get('naive', 0), 1)} | "
                     f"{r['gpudet_stages_s']['gpu_utilisation_percent']:.0f}% |")
    r = load("retinaface_default")
    dates = sorted({load(name)["date"][:10] for _, name in rows})
    lines.append("")
    lines.append(f"3,796 JPEGs, batch 32, {r['machine']['gpus'][0]}, {r['machine']['cores']} cores; torch "
                 f"{r['machine']['torch']}, onnxruntime {r['machine']['onnxruntime']}, DALI {r['machine']['dali']}; "
                 f"{dates[0]} to {dates[-1]}. Command: `{shorten(r['command'])}` (`--config` per row; `--set` as the row "
                 "says). The naive loop: PIL, numpy, `session.run` one image at a time, ORT's default options, "
                 "the same model file (float16 for the default, float32 for the others), the first 300 images.")
    return "\n".join(lines)


DETECT_RUNS = ("detect_106288_default", "detect_106288_default_2", "detect_106288_default_3", "detect_106288_default_4",
               "detect_106288_default_5", "detect_106288_default_6", "detect_106288_default_7",
               "detect_106288_default_8")
"""The default command over 106,288 images, oldest first: the last is the README's."""


def detect_table() -> str:
    lines = ["| tree | images | wall clock from the command | of it: imports | setup | then | detections |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    dates = sorted({load(name)["started"][:10] for name in DETECT_RUNS})
    for name in DETECT_RUNS:
        s = load(name)
        seconds = s["seconds"]
        lines.append(f"| {s['tree']['commit']} | {num(s['processed'])} | **{seconds['wall']:.1f} s** | "
                     f"{seconds['startup']:.1f} s | {seconds['setup']:.1f} s | {num(s['images_per_s'])} img/s | "
                     f"{num(s['detections'])} |")
    return "\n".join(lines + [
        "", f"`gpudet detect LIST --out DIR --overwrite` (the default config, no other option), the 3,796 JPEGs "
        f"listed 28 times, {s['device']}, {dates[0]} to {dates[-1]}; each row right after that tree's `gpudet bench` in "
        "the same machine session (`scripts/gpu_check.sh retinaface`), but 4024a8d's, right after "
        "`scripts/gpu_check.sh retinanet`."])


RETINANET = "retinanet_compile_ahead"
"""bench_retinanet.py's report that the RetinaNet table and the README's row show."""
RETINANET_AGAIN = "retinanet_compile_ahead_2"
"""The same command, the same tree, later in the same machine session."""
RETINANET_EARLIER = "retinanet_kernels"
"""The same command on the tree that brought the postprocess's Triton kernels."""

RETINANET_BENCH_RUNS = (  # (label, report): `gpudet bench` on bench_retinanet.py's model files
    ("before", "before_retinanet_gpudet_bench"), ("now", "retinanet_gpudet_bench"),
    ("`preprocess.hw_decoder_load=0.9` (the default)", "retinanet_bench_hw_decoder_0.9"),
    ("`preprocess.hw_decoder_load=1.0`", "retinanet_bench_hw_decoder_1.0"),
    ("`preprocess.hw_decoder_load=0.5`", "retinanet_bench_hw_decoder_0.5"),
    ("`run.prefetch_batches=1`", "retinanet_bench_prefetch_1"),
    ("`preprocess.hw_decoder_load=1.0`, again", "retinanet_bench_hw_decoder_1.0_2"))


def retinanet_table() -> str:
    r = load(RETINANET)
    lines = ["| what | img/s | detections per image on the host | setup | wall clock |", "| --- | --- | --- | --- | --- |"]
    for name, row in r["results"].items():
        lines.append(f"| {name} | **{num(row['images_per_s'], 1)}** | {row.get('detections_per_image', '')} | "
                     f"{row.get('setup_s', '')}{' s' if 'setup_s' in row else ''} | "
                     f"{row.get('wall_s', '')}{' s' if 'wall_s' in row else ''} |")
    lines += ["", "Ratios, from this run: " + "; ".join(f"{k} **{v:.3f}x**" for k, v in r["ratios"].items()) + "."]
    for name, when in ((RETINANET_AGAIN, "The same command again, later in the same machine session"),
                       (RETINANET_EARLIER, "The same command at an earlier tree")):
        other = load(name)
        lines += ["", f"{when} (tree {other['tree']['commit']}, {other['date'][:10]}): gpudet "
                  f"{num(other['results']['gpudet']['images_per_s'], 1)} img/s; "
                  + "; ".join(f"{k} {other['ratios'][k]:.3f}x" for k in ("gpudet / ort alone", "gpudet / pytorch strong",
                                                                        "gpudet / pytorch usual")) + "."]
    lines += [
              "", f"{r['images']} JPEGs, batch {r['batch_size']}, {r['size_hw'][0]}x{r['size_hw'][1]}, fp16, "
              f"{r['machine']['gpus'][0]}, {r['machine']['cores']} cores; torch {r['machine']['torch']}, onnxruntime "
              f"{r['machine']['onnxruntime']}, DALI {r['machine']['dali']}; tree {r['tree']['commit']}; {r['date'][:10]}. "
              f"Command: `{shorten(r['command'])}`. The seeded load (class bias shifted by {r['class_bias_shift']}) "
              f"asked about {r['detections_per_image_asked']} detections per image on the first 8 images; over the "
              "2,000 it gave the counts above."]
    lines += ["", "| `gpudet bench`, `postprocess.compile=false` | tree | detections per image | gpudet img/s (passes) | "
              "ORT alone | gpudet / ORT alone | DALI alone | GPU busy |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, name in RETINANET_BENCH_RUNS:
        r = load(name)
        rates = r["images_per_s"]
        lines.append(f"| {label} | {r['tree']['commit']} | {r.get('detections_per_image', 'not reported')} | "
                     f"{num(rates['gpudet'], 1)} ({passes(r, 1)}) | "
                     f"{num(rates['model'], 1)} | {rates['gpudet'] / rates['model']:.2f}x | {num(rates['preprocess'])} | "
                     f"{r['gpudet_stages_s']['gpu_utilisation_percent']:.0f}% |")
    r = load(RETINANET_BENCH_RUNS[-1][1])
    lines += ["", f"Command: `{shorten(r['command'])}` (`--set` as the row says), 2,000 images; the first two rows "
              "on the seeded-load file of the run before the padding fix (its load: 12 per image through gpudet), "
              f"the others on the file of the run above ({r['date'][:10]})."]
    return "\n".join(lines)


RAY_RUNS = (  # (label, report, where the Ray rate starts), each machine session's runs together
    ("one process", "ray_one_process", ""), ("`--ray --workers 1`, Ray batches of 32", "ray_workers_1_batch32", "first row"),
    ("one process", "ray_one_process_2", ""), ("`--ray --workers 1`, Ray batches of 512", "ray_workers_1", "first row"),
    ("one process", "ray_one_process_3", ""), ("`--ray --workers 1`, Ray batches of 512", "ray_workers_1_2", "first row"),
    ("one process", "ray_one_process_4", ""), ("`--ray --workers 1`, Ray batches of 512", "ray_workers_1_3", "first image"),
    ("`--ray --workers 1`, Ray batches of 2,048", "ray_workers_1_batch2048", "first image"),
    ("`--ray --workers 1`, Ray batches of 2,048", "ray_workers_1_batch2048_2", "first image"),
    ("`--ray --workers 1`, Ray batches of 4,096", "ray_workers_1_batch4096", "first image"),
    ("one process", "ray_one_process_5", ""), ("`--ray --workers 1`, Ray batches of 4,096 (the default)",
                                               "ray_workers_1_4", "first image"),
    ("one process", "ray_106288_one_process", ""),
    ("`--ray --workers 1`, one call at a time per actor", "ray_106288_workers_1", "first image"),
    ("one process, `--format parquet`", "ray_106288_one_process_parquet", ""),
    ("`--ray --workers 1 --format parquet`, one call at a time per actor", "ray_106288_workers_1_parquet",
     "first image"),
    ("one process", "ray_106288_one_process_2", ""),
    ("`--ray --workers 1`, two calls at once per actor (the default)", "ray_106288_workers_1_2", "first image"),
    ("one process, `--format parquet`", "ray_106288_one_process_parquet_2", ""),
    ("`--ray --workers 1 --format parquet`, two calls at once per actor", "ray_106288_workers_1_parquet_2",
     "first image"),
    ("one process", "ray_106288_one_process_3", ""), ("`--ray --workers 1`", "ray_106288_workers_1_3", "first image"),
    ("one process", "ray_106288_one_process_4", ""), ("`--ray --workers 1`", "ray_106288_workers_1_4", "first image"),
    ("one process, `--format parquet`", "ray_106288_one_process_parquet_3", ""),
    ("`--ray --workers 1 --format parquet`", "ray_106288_workers_1_parquet_3", "first image"),
    ("`--ray --workers 1`", "ray_106288_workers_1_5", "first image"), ("one process", "ray_106288_one_process_5", ""),
    ("`--ray --workers 1`", "ray_106288_workers_1_6", "first image"), ("one process", "ray_106288_one_process_6", ""),
    ("`--ray --workers 1`", "ray_106288_workers_1_7", "first image"), ("one process", "ray_106288_one_process_7", ""),
    ("one process", "ray_106288_one_process_8", ""), ("`--ray --workers 1`", "ray_106288_workers_1_8", "first image"),
    ("one process", "ray_106288_one_process_9", ""), ("`--ray --workers 1`", "ray_106288_workers_1_9", "first image"),
    ("one process", "ray_106288_one_process_10", ""), ("`--ray --workers 1`", "ray_106288_workers_1_10", "first image"),
    ("one process", "ray_106288_one_process_11", ""), ("`--ray --workers 1`", "ray_106288_workers_1_11", "first image"),
    ("one process", "ray_106288_one_process_12", ""), ("`--ray --workers 1`", "ray_106288_workers_1_12", "first image"),
    ("one process", "ray_106288_one_process_13", ""), ("`--ray --workers 1`", "ray_106288_workers_1_13", "first image"),
    ("one process", "ray_106288_one_process_14", ""), ("`--ray --workers 1`", "ray_106288_workers_1_14", "first image"),
    ("`--ray --workers 1`", "ray_106288_workers_1_15", "first image"), ("one process", "ray_106288_one_process_15", ""),
    ("one process", "ray_106288_one_process_16", ""), ("`--ray --workers 1`", "ray_106288_workers_1_16", "first image"),
    ("one process", "ray_106288_one_process_17", ""), ("`--ray --workers 1`", "ray_106288_workers_1_17", "first image"),
    ("one process", "ray_106288_one_process_18", ""), ("`--ray --workers 1`", "ray_106288_workers_1_18", "first image"))

RAY_PAIRS = (("ray_106288_workers_1_3", "ray_106288_one_process_3"), ("ray_106288_workers_1_4", "ray_106288_one_process_4"),
             ("ray_106288_workers_1_5", "ray_106288_one_process_5"), ("ray_106288_workers_1_6", "ray_106288_one_process_6"),
             ("ray_106288_workers_1_7", "ray_106288_one_process_7"))
"""A machine session's five JSONL pairs: each Ray run and the one-process run next to it."""
RAY_PAIRS_LATER = (("ray_106288_workers_1_8", "ray_106288_one_process_8"),
                   ("ray_106288_workers_1_9", "ray_106288_one_process_9"))
"""A later machine session's two pairs, on a later tree."""
RAY_PAIRS_LATEST = (("ray_106288_workers_1_10", "ray_106288_one_process_10"),
                    ("ray_106288_workers_1_11", "ray_106288_one_process_11"))

RAY_PAIRS_D7ECEF5 = (("ray_106288_workers_1_12", "ray_106288_one_process_12"),
                     ("ray_106288_workers_1_13", "ray_106288_one_process_13"))

RAY_PAIRS_53CA254 = tuple((f"ray_106288_workers_1_{k}", f"ray_106288_one_process_{k}") for k in range(14, 19))
"""Each Ray run with the one-process run next to it (omp_threads.json has their order)."""
"""The latest machine session's two pairs, on a later tree again."""


def pair_ratios(pairs: tuple[tuple[str, str], ...]) -> list[float]:
    """Each Ray run's rate over the one-process run's beside it."""
    return [load(ray)["images_per_s"] / load(one)["images_per_s"] for ray, one in pairs]


def ray_table() -> str:
    lines = ["| run | tree | images | rate once running | from | wall clock |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, name, start in RAY_RUNS:
        s = load(name)
        wall = s["seconds"].get("wall", s["seconds"]["total"])
        lines.append(f"| {label} | {s['tree']['commit']} | {num(s['processed'])} | **{num(s['images_per_s'])}** img/s | "
                     f"{start or 'after setup'} | {wall:.1f} s |")
    lines += ["", "The 3,796 JPEGs listed 4 times (15,184) or 28 times (106,288), the default config, a local Ray "
              "cluster on the same machine "
              "(one GPU actor); rows grouped by tree, one process first. One process: images/s after "
              "its setup, wall clock from the command. Ray: images/s from the first row back (\"first row\", which "
              "comes a whole Ray batch after the actor started) or from the first image an actor took (\"first "
              "image\"), to the last row; wall clock from the start of the run (Ray's start included, the "
              "imports not)."]
    ratios = pair_ratios(RAY_PAIRS)
    lines += ["", f"Tree {load(RAY_PAIRS[0][0])['tree']['commit']}'s JSONL pairs, Ray's rate over the one process's next "
              f"to it: {', '.join(f'{x:.3f}' for x in ratios)}; median **{statistics.median(ratios):.3f}x**."]
    later = (RAY_PAIRS_LATER, RAY_PAIRS_LATEST, RAY_PAIRS_D7ECEF5, RAY_PAIRS_53CA254)
    for pairs in later:
        lines += ["", f"Tree {load(pairs[0][0])['tree']['commit']}'s pairs, the same way: "
                  f"{', '.join(f'{x:.3f}' for x in pair_ratios(pairs))}."]
    every = pair_ratios(RAY_PAIRS + sum(later, ()))
    lines += ["", f"All {len(every)} JSONL pairs of the {len(later) + 1} trees, pooled: median "
              f"**{statistics.median(every):.3f}x**, from {min(every):.3f} to {max(every):.3f}."]
    return "\n".join(lines)


def omp_table() -> str:
    r = load("omp_threads")
    lines = ["| run | `OMP_NUM_THREADS` | images/s |", "| --- | --- | --- |"]
    for run in r["runs"]:
        lines.append(f"| {run['kind']} | {run['OMP_NUM_THREADS'] or 'not set'} | {num(run['images_per_s'])} |")
    return "\n".join(lines + ["", f"{r['what']}. {r['machine']}, tree {r['tree']}, {r['date']}."])


def formats_table() -> str:
    lines = ["| model, load | tree | JSONL: img/s (writing) | Parquet: img/s (writing) | Parquet / JSONL |",
             "| --- | --- | --- | --- | --- |"]

    def line(label: str, tree: str, jsonl: tuple[float, float], parquet: tuple[float, float]) -> str:
        return (f"| {label} | {tree} | {num(jsonl[0])} ({jsonl[1]:.2f} s) | {num(parquet[0])} ({parquet[1]:.2f} s) | "
                f"{parquet[0] / jsonl[0]:.2f}x |")

    for report in map(load, ("retinanet_formats", "retinanet_formats_2", "retinanet_formats_3", "retinanet_formats_4",
                             RETINANET_EARLIER, RETINANET, RETINANET_AGAIN)):
        rn = report["results"]
        for label, name in (("RetinaNet, the zero-load bound", "gpudet, zero-load bound (no detection survives)"),
                            ("RetinaNet, the seeded load", "gpudet"),
                            ("RetinaNet, the heavy-NMS bound", "gpudet, heavy-NMS bound (score 0: 300 per image)")):
            j, q = rn[name], rn[f"{name}, --format parquet"]
            lines.append(line(f"{label}: {j['detections_per_image']:g} per image", report["tree"]["commit"],
                              (j["images_per_s"], j["stages_s"]["write"]), (q["images_per_s"], q["stages_s"]["write"])))
    for suffix in ("", "_2", "_3"):
        j, q = load(f"ray_106288_one_process{suffix}"), load(f"ray_106288_one_process_parquet{suffix}")
        lines.append(line(f"RetinaFace, the default: {j['detections'] / j['processed']:.2f} per image, "
                          f"{num(j['processed'])} images", j["tree"]["commit"], (j["images_per_s"], j["seconds"]["write"]),
                          (q["images_per_s"], q["seconds"]["write"])))
    lines += ["", f"RetinaNet: `{shorten(report['command'])}` (2,000 images, batch 16, 800x800, fp16 heads; one detector "
              "per load, one pass in each format, side by side). RetinaFace: `gpudet detect` over the 106,288 images "
              "(scripts/gpu_check.sh ray), images/s after setup. Writing: the seconds the loop spent in "
              "`OutputFolder.record` (building and writing the records) and, from f217617, the last Parquet file's write."]
    return "\n".join(lines)


EXPERT_RUNS = ("retinanet_expert", "h100/retinanet_expert", "h100/retinanet_expert_2")
"""bench_retinanet.py with the PyTorch expert baseline, newest first: every row on the H200, then two
runs one after the other on an H100."""
EXPERT = "pytorch expert (GPU decode, CUDA graph, batched postprocess on its own stream)"


def crossover(r: dict) -> float:
    """The job size (images) from which gpudet finishes first: each row's setup from its process's
    start, then its median rate."""
    ours, theirs = r["results"]["gpudet"], r["results"][EXPERT]
    return (ours["setup_s"] - theirs["setup_s"]) / (1 / theirs["images_per_s"] - 1 / ours["images_per_s"])


def expert_table() -> str:
    lines = ["| run | row | img/s, median (passes) | detections per image on the host | setup, from the process's "
             "start | gpudet / row |", "| --- | --- | --- | --- | --- | --- |"]
    runs = [load(name) for name in EXPERT_RUNS]
    for k, r in enumerate(runs, 1):
        ours = r["results"]["gpudet"]["images_per_s"]
        for label, row in r["results"].items():
            if "passes" not in row and not label.startswith("naive"):
                continue  # torch eager's model-only rate: the RetinaNet table's
            passes = ", ".join(num(p, 1) for p in row["passes"]) if "passes" in row else f"{row['images']} images, one pass"
            setup = f"{row['setup_s']:.1f} s" if "setup_s" in row else ""
            lines.append(f"| {k} | {label} | **{num(row['images_per_s'], 1)}** ({passes}) | "
                         f"{row.get('detections_per_image', '')} | {setup} | {ours / row['images_per_s']:.2f}x |")
    lines += ["", "The job size from which gpudet finishes first (setup plus images at the median rate): "
              + ", ".join(f"{num(round(crossover(r), -3))} images in run {k}" for k, r in enumerate(runs, 1)) + "."]
    for k, r in enumerate(runs, 1):
        m = r["machine"]
        lines += ["", f"Run {k}: {r['images']} of the crops, batch {r['batch_size']}, {r['size_hw'][0]}x"
                  f"{r['size_hw'][1]}, fp16, {r['passes']} passes per row, each row in a fresh process; "
                  f"{m['gpus'][0]}, {m['cores']} cores; torch {m['torch']}, onnxruntime {m['onnxruntime']}, DALI "
                  f"{m['dali']}; tree {tree_of(r)}; {r['date'][:10]}. Command: `{shorten(r['command'])}`."]
    return "\n".join(lines)


def tree_of(r: dict) -> str:
    """The commit a report names: its "tree", else the one the machine's checkout recorded."""
    return r["tree"]["commit"] if "tree" in r else r["gpudet"]["commit"][:7]


RETINAFACE_NEWEST = "retinaface_default_8"
"""The newest `gpudet bench` of the default config: the README's RetinaFace row."""


def speed_table() -> str:
    default = load(RETINAFACE_NEWEST)
    detect, ex = load(DETECT_RUNS[-1]), load(EXPERT_RUNS[0])
    ex_gpudet = ex["results"]["gpudet"]
    crops = default["images"]  # make_image_set.py's JPEGs (jpg.txt), which every row reads
    return "\n".join([
        "| what, on one GPU (H200 unless named) | gpudet | against |", "| --- | --- | --- |",
        f"| `gpudet detect` (the default), {num(detect['processed'])} images: the {num(crops)} crops below, listed "
        f"{detect['processed'] // crops} times | {detect['seconds']['wall']:.1f} s from the "
        f"command, {num(detect['images_per_s'])} img/s once set up | |",
        f"| RetinaFace, the default config, batch 32, over {num(crops)} JPEG crops of the sample photos (480-1024 px) | "
        f"{num(default['images_per_s']['gpudet'])} img/s | "
        f"its parts alone in the same run: DALI {num(default['images_per_s']['preprocess'])} img/s, ORT "
        f"{num(default['images_per_s']['model'])}; {default['ratios']['gpudet / naive']:.0f}x the naive loop (the same "
        "fp16 model, batch 1, PIL and numpy) |",
        f"| RetinaNet R50-FPN fp16 800x800, batch 16, {ex_gpudet['detections_per_image']} detections per image, over "
        f"{num(ex['images'])} of those crops ({ex['machine']['gpus'][0].replace('NVIDIA ', '')}) | "
        f"{num(ex_gpudet['images_per_s'])} img/s | "
        f"{ex['ratios']['gpudet / ort alone']:.2f}x ORT alone, {ex['ratios']['gpudet / pytorch expert']:.2f}x the "
        f"PyTorch expert pipeline (which finishes first on jobs under ~{num(round(crossover(ex), -3))} images: its setup "
        f"is shorter), {ex['ratios']['gpudet / pytorch usual']:.1f}x the usual PyTorch pipeline, "
        f"{ex['ratios']['gpudet / naive']:.0f}x the naive loop (fp32, batch 1) |"])


def threads_table() -> str:
    r = load("retinaface_threads_decoder")
    lines = ["| `--set` | gpudet loop img/s (each pass) | DALI alone | ORT alone | GPU busy |", "| --- | --- | --- | --- | --- |"]
    for run in r["runs"]:
        rates = run["images_per_s"]
        lines.append(f"| {run['set'].replace('--set ', '') or 'none (the default)'} | "
                     f"{passes(run)} | {num(rates['preprocess'])} | "
                     f"{num(rates['model'])} | {run['gpu_utilisation_percent']:.0f}% |")
    return "\n".join(lines + ["", f"{r['what']}; {r['machine']['gpus'][0]}, tree {r['tree']['commit']}, "
                               f"{r['runs'][0]['date'][:10]}. Command: `{shorten(r['runs'][0]['command'])}`, "
                               "`--set` as the row says."])


def cpu_table() -> str:
    rows = [("before: the CPU session unoptimized, batch 32", "cpu/coco240_before"),
            ("now: the optimized session, batch 8 (`run.cpu_batch_size`)", "cpu/coco240_now")]
    lines = ["| tree | gpudet loop img/s (each pass) | model alone | DALI alone | naive | gpudet / naive | "
             "240 images from the command |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, name in rows:
        r = load(name)
        rates = r["images_per_s"]
        lines.append(f"| {label} ({r['gpudet']['commit'][:7]}) | **{num(rates['gpudet'], 1)}** ({passes(r, 1)}) | "
                     f"{num(rates['model'], 1)} | {num(rates['preprocess'], 1)} | {num(rates['naive'], 1)} | "
                     f"**{r['ratios']['gpudet / naive']:.2f}x** | {r['job_wall_s']:.2f} s |")
    r = load(rows[-1][1])
    m = r["machine"]
    fastest = max(load(name)["images_per_s"]["naive"] for _, name in rows)
    lines += ["", f"The naive loop's rate moved between the two runs. Against the faster of its two runs, this "
              f"tree's loop is {r['images_per_s']['gpudet'] / fastest:.2f}x.",
              "", f"240 distinct COCO-sized JPEGs (`make_image_set.py --kind coco`, "
              f"{r['megapixels_per_image']:.2f} MP each), the default config, {m['cpu']}, {m['cores']} cores, no GPU; "
              f"torch {m['torch']}, onnxruntime {m['onnxruntime']}, DALI {m['dali']}; {r['date'][:10]}. Naive: "
              f"{r['naive']['images']} images, batch {r['naive']['batch']}, {r['naive']['precision']}, PIL and numpy, "
              f"one `session.run` each. Command: `{shorten(r['command'])}` (`scripts/cpu_check.sh`)."]
    return "\n".join(lines)


S3_RUNS = (("a batch's share per reading thread (32 requests in flight)", "s3/aef1a51"),
           ("2 fetching processes, 4 batches of 32 in flight", "s3/e19444f"),
           ("the same", "s3/97bd201"),
           ("the same, the server with `--buffer-size 0 --no-modtime --no-checksum`", "s3/97bd201_rclone_flags"),
           ("the same, the postprocess on a stream of its own", "s3/823931d"),
           ("the same, objects fetched by blocking gets on threads (and the reverted NMS change)", "s3/e97c6b7"),
           ("three trees in turn each round: the same", "s3/h100_e69c394"),
           ("URL batches taken 4 times further ahead than those in flight", "s3/h100_ab76a21", "s3/h100_e69c394"),
           ("the same, a batch's objects sent from where they are (sendmsg)", "s3/h100_64a5472"),
           ("two trees in turn each round: the same", "s3/h100_0367ed8", "s3/h100_65ac081"),
           ("the fetching processes started while the detector is built", "s3/h100_65ac081"),
           ("two trees in turn each round, a fresh server each time: the same", "s3/h100_ef77043"),
           ("the same, the listing beside the imports (`job.listed`)", "s3/h100_be6168e"),
           ("the same, listed by a process of its own (`listing.ListedApart`), the server listed before the runs",
            "s3/h100_3626c6a"))
"""`gpu_check.sh s3` runs, oldest first: (how that tree read the objects, its folder of summaries[, the
folder whose disk run of the same round its S3 runs are compared with, where it ran none])."""


def s3_table() -> str:
    lines = ["| tree, how it reads objects | round | from | wall clock from the command | of it: start | setup | then "
             "| detections | S3 / disk, rate (wall clock) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def row(label: str, k: str, where: str, s: dict, disk: dict | None) -> str:
        ratio = (f"**{s['images_per_s'] / disk['images_per_s']:.2f}x** "
                 f"({disk['seconds']['wall'] / s['seconds']['wall']:.2f}x)") if disk else ""
        commit = s["tree"]["commit"] if "tree" in s else s["code"]["commit"][:7]
        seconds = s["seconds"]
        return (f"| {label} ({commit}) | {k} | {where} | {seconds['wall']:.1f} s | {seconds['startup']:.1f} s | "
                f"{seconds['setup']:.1f} s | {num(s['images_per_s'])} img/s | {num(s['detections'])} |  {ratio} |")

    for label, folder, *other in S3_RUNS:
        disk_folder = other[0] if other else folder
        names = sorted(p.stem.removeprefix("detect_coco_s3_").removesuffix("_summary")
                       for p in (BENCH / folder).glob("detect_coco_s3_*_summary.json"))
        for k in [n for n in names if n.isdigit()]:
            disk, s3 = load(f"{disk_folder}/detect_coco_disk_{k}_summary"), load(f"{folder}/detect_coco_s3_{k}_summary")
            if disk_folder == folder:  # a disk row of its own, else compared with the other tree's
                lines.append(row(label, k, "local disk", disk, None))
            lines.append(row(label, k, "S3", s3, disk))
        for extra in [n for n in names if not n.isdigit()]:  # S3_SETS: one more S3 run each, against round 1's disk
            # run_a_b_1_run_c_2: run.a_b=1, run.c=2 (gpu_check's name of S3_SETS=run.a_b=1,run.c=2); another
            # name as it is
            pairs = [p.rsplit("_", 1) for p in ("_" + extra).split("_run_")[1:]] if extra.startswith("run_") else []
            named = ", ".join(f"`run.{key}={value}`" for key, value in pairs) if pairs else f"`{extra}`"
            lines.append(row(label, "+1", f"S3, {named}",
                             load(f"{folder}/detect_coco_s3_{extra}_summary"),
                             load(f"{folder}/detect_coco_disk_1_summary")))
    s = load(f"{S3_RUNS[-1][1]}/detect_coco_s3_1_summary")
    return "\n".join(lines + ["", f"The default `gpudet detect` over {num(s['images'])} distinct COCO-sized JPEGs "
                               "(`make_image_set.py --kind coco`), from the local disk (a file list) and from "
                               "`rclone serve s3` on the same machine serving the same folder (`s3://coco/`, "
                               "`--storage-option endpoint_url=...`), in turn; the aef1a51 run on an H200, the "
                               f"others on an H100; 16 cores; up to {s['started'][:10]}. Command: `scripts/gpu_check.sh "
                               "s3` (`S3_SETS=KEY=VALUE,...`: the +1 rows, each against its tree's first disk run); "
                               "trees in turn ran the same `gpudet detect` commands from their own folders, the "
                               "`again` row (65ac081) a third time after round 1. Up to be6168e each run met a "
                               "server that had not listed the folder yet; from 3626c6a on, the script lists it "
                               "twice first (`s3_listing.txt`), as a store that is up has."])


YOLO_RUNS = (("YOLO11n, kernel by kernel", "h100/yolo11n_seeded"),
             ("YOLO11n, one CUDA graph (`run.cuda_graph: auto`)", "yolo/yolo11n_e19444f"),
             ("YOLO11n, the same with `run.prefer_nhwc=true`", "yolo/yolo11n_nhwc_e19444f"),
             ("YOLO11n, a CUDA graph, NMS steps as one Triton kernel (reverted)", "yolo/yolo11n_97bd201"),
             ("YOLO11m, the same tree", "yolo/yolo11m_97bd201"),
             ("YOLO11n, the postprocess on the legacy default stream, round 1", "yolo/h200_ab/yolo11n_afd0a33_1"),
             ("YOLO11n, the postprocess on a stream of its own at a higher priority, round 1",
              "yolo/h200_ab/yolo11n_2c69ec2_1"),
             ("YOLO11n, the same, each NMS step one Triton kernel, round 1", "yolo/h200_ab/yolo11n_823931d_1"),
             ("YOLO11n, the legacy default stream, round 2", "yolo/h200_ab/yolo11n_afd0a33_2"),
             ("YOLO11n, a stream of its own, round 2", "yolo/h200_ab/yolo11n_2c69ec2_2"),
             ("YOLO11n, the same, each NMS step one kernel, round 2", "yolo/h200_ab/yolo11n_823931d_2"),
             ("YOLO11m, the same tree", "yolo/yolo11m_823931d_h200"),
             ("YOLO11n, the same tree", "yolo/h100_823931d/yolo11n_default"),
             ("YOLO11n, the same with `run.pipeline_depth=3`", "yolo/h100_823931d/yolo11n_depth3"),
             ("YOLO11n, the same with `postprocess.pre_nms_top_k=1024`", "yolo/h100_823931d/yolo11n_topk1024"),
             ("YOLO11n, the same with `postprocess.pre_nms_top_k=256` (drops candidates)",
              "yolo/h100_823931d/yolo11n_topk256"),
             ("YOLO11n, the same tree, again", "yolo/h100_823931d/yolo11n_again"),
             ("YOLO11n, NMS only up to each image's last valid candidate (reverted)",
              "yolo/h100_e97c6b7/yolo11n_default"),
             ("YOLO11n, the same, again", "yolo/h100_e97c6b7/yolo11n_again"))
"""`gpu_check.sh yolo` runs and `gpudet bench` runs beside them: (the export and how it ran, its report)."""


def gpu_name(report: dict) -> str:
    return report["machine"]["gpus"][0].removeprefix("NVIDIA ").split(" ")[0]


def yolo_table() -> str:
    lines = ["| export, how it ran | tree | GPU | gpudet loop img/s (passes) | ORT alone | DALI alone | gpudet / ORT "
             "alone | detections per image | the loop waited on the postprocess | GPU busy | host: fixed Python |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, name in YOLO_RUNS:
        r = load(name)
        rates, stages = r["images_per_s"], r["gpudet_stages_s"]
        lines.append(f"| {label} | {r['tree']['commit']} | {gpu_name(r)} | **{num(rates['gpudet'], 1)}** "
                     f"({passes(r, 1)}) | {num(rates['model'], 1)} | "
                     f"{num(rates['preprocess'], 1)} | **{rates['gpudet'] / rates['model']:.2f}x** | "
                     f"{r['detections_per_image']} | {stages['postprocess']:.2f} s | "
                     f"{stages['gpu_utilisation_percent']:.0f}% | {r['machine']['python_loop_ms']:.1f} ms |")
    r = load(YOLO_RUNS[-1][1])
    m = r["machine"]
    return "\n".join(lines + ["", f"{r['images']} crops, batch {r['batch_size']}, 640x640, fp32 exports with random "
                               f"weights seeded by `scripts/seed_yolo.py`, the `yolo_coco` preset; {m['cores']} cores; "
                               f"torch {m['torch']}, onnxruntime {m['onnxruntime']}, DALI {m['dali']}; up to "
                               f"{r['date'][:10]}. The rows of one tree ran one after the other on one machine; the "
                               "H200 rows ran the three trees in turn, twice. Host: the time a fixed piece of Python "
                               "took on one core before the run (`gpudet bench`'s machine check). Command: "
                               "`YOLO_MODELS=... bash scripts/gpu_check.sh yolo`, then `gpudet bench LIST --config "
                               "yolo_coco --set model.path=... [--set ...]`."])


STREAM_RUNS = (("afd0a33", "the legacy default stream"), ("2c69ec2", "a stream of its own, higher priority"),
               ("823931d", "the same, each NMS step one Triton kernel"))
"""The default config on the crops: the trees of the YOLO table's H200 rows, in turn, twice."""


def streams_table() -> str:
    lines = ["| tree: the postprocess on | round | gpudet loop img/s (passes) | ORT alone | DALI alone | GPU busy | "
             "host: fixed Python |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for round_ in (1, 2):
        for commit, label in STREAM_RUNS:
            r = load(f"h200_ab_streams/crops_{commit}_{round_}")
            rates = r["images_per_s"]
            lines.append(f"| {commit}: {label} | {round_} | **{num(rates['gpudet'])}** "
                         f"({passes(r)}) | {num(rates['model'])} | "
                         f"{num(rates['preprocess'])} | {r['gpudet_stages_s']['gpu_utilisation_percent']:.0f}% | "
                         f"{r['machine']['python_loop_ms']:.1f} ms |")
    return "\n".join(lines + ["", f"The default config (RetinaFace) over the {r['images']} crops, {gpu_name(r)}, "
                               f"{r['date'][:10]}. Command: `AB=\"before=DIR post=DIR\" ROUNDS=2 DETECT_ROUNDS=0 "
                               "bash scripts/gpu_check.sh ab`."])


COCO_BATCHES = (("32 (the default)", "coco20k/batch32_e19444f"), ("64", "coco20k/batch64_e19444f"),
                ("32, round 1", "coco20k/h100_3626c6a/batch32_1"), ("64, round 1", "coco20k/h100_3626c6a/batch64_1"),
                ("32, round 2", "coco20k/h100_3626c6a/batch32_2"), ("64, round 2", "coco20k/h100_3626c6a/batch64_2"),
                ("64 (H200)", "coco20k/h200_ee5e01b/b64_now"),
                ("64, `preprocess.host_share=0.25` (H200)", "coco20k/h200_ee5e01b/b64_h25"),
                ("64, `preprocess.host_share=0.4` (H200)", "coco20k/h200_ee5e01b/b64_h40"),
                ("64 (H200)", "coco20k/h200_ee5e01b/b64_now_2"),
                ("64, `preprocess.host_share=0.25` (H200)", "coco20k/h200_ee5e01b/b64_h25_2"),
                ("32 (H200)", "coco20k/h200_ee5e01b/b32_now"),
                ("32, round 1", "coco20k/h100_45be7ef/batch32_1"), ("`run.num_threads=8`, round 1", "coco20k/h100_45be7ef/threads8_1"),
                ("64, round 1", "coco20k/h100_45be7ef/batch64_1"),
                ("32, round 2", "coco20k/h100_45be7ef/batch32_2"), ("`run.num_threads=8`, round 2", "coco20k/h100_45be7ef/threads8_2"),
                ("64, round 2", "coco20k/h100_45be7ef/batch64_2"),
                *((f"32, GIL switch interval {label}, round {r}", f"coco20k/h100_73be5e1/{name}_{r}")
                  for r in (1, 2) for label, name in (("0.5 ms", "switch05"), ("5 ms (Python's)", "switch0"),
                                                      ("0.1 ms", "switch01"),
                                                      ("0.5 ms, `run.pipeline_depth=3`", "depth3"))))
"""(`run.batch_size`, the report): e19444f's one after the other, 3626c6a's in turn twice (`gpu_check.sh batches`);
ee5e01b's in the order listed, on an H200, the host decoding a share of the batches' JPEGs whole in some; 45be7ef's
in turn twice (`gpu_check.sh sweep`); 73be5e1's in turn twice, the switch interval its `run.switch_interval_ms`
(not kept)."""


def batch_table() -> str:
    lines = ["| `run.batch_size` | tree | gpudet loop img/s (passes) | DALI alone | ORT alone | loop / DALI alone | "
             "setup from the command | the loop waited on DALI / the postprocess | GPU busy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, name in COCO_BATCHES:
        r = load(name)
        rates, stages = r["images_per_s"], r["gpudet_stages_s"]
        lines.append(f"| {label} | {r['tree']['commit']} | **{num(rates['gpudet'])}** ({passes(r)}) | "
                     f"{num(rates['preprocess'])} | "
                     f"{num(rates['model'])} | **{rates['gpudet'] / rates['preprocess']:.2f}x** | "
                     f"{r['gpudet_setup_s']['since_start']:.1f} s | {stages['preprocess']:.2f} s / "
                     f"{stages['postprocess']:.2f} s | {stages['gpu_utilisation_percent']:.0f}% |")
    r, last = load(COCO_BATCHES[0][1]), load(COCO_BATCHES[-1][1])
    return "\n".join(lines + ["", f"The default config over {num(r['images'])} distinct COCO-sized JPEGs; e19444f's "
                               "one after the other in one session, 3626c6a's in turn, twice, in another, on an "
                               f"{r['machine']['gpus'][0]}; ee5e01b's in the order listed in a third, on an "
                               f"{load('coco20k/h200_ee5e01b/b32_now')['machine']['gpus'][0]}; 45be7ef's in turn, twice, "
                               f"in a fourth, and 73be5e1's in turn, twice, in a fifth, on an "
                               f"{last['machine']['gpus'][0]}; "
                               f"{' and '.join(sorted({r['date'][:10], last['date'][:10]}))}. "
                               "Command: `gpudet bench coco/list.txt --device cuda --limit 20000 --skip-naive --set "
                               "run.batch_size=N` (`ROUNDS=2 bash scripts/gpu_check.sh batches`), with `--set "
                               "preprocess.host_share=S` where the row says; 45be7ef's: `SETS=\"- run.num_threads=8 "
                               "run.batch_size=64\" ROUNDS=2 bash scripts/gpu_check.sh sweep`; 73be5e1's: `SETS=\"- "
                               "run.switch_interval_ms=0 run.switch_interval_ms=0.1 run.pipeline_depth=3\" ROUNDS=1 "
                               "bash scripts/gpu_check.sh sweep`, twice."])


BATCH_SETS = (("crops", "crops"), ("12 MP photos", "photos"))
"""(the set, its reports' prefix): `BATCH_SET=crops|photos ROUNDS=1 bash scripts/gpu_check.sh batches` at edeba90."""


def batch_sets_table() -> str:
    lines = ["| images | `run.batch_size` | gpudet loop img/s (passes) | DALI alone | ORT alone | "
             "the loop waited on DALI | GPU busy |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, prefix in BATCH_SETS:
        for size in (32, 64):
            r = load(f"batch_sets/h100_edeba90/{prefix}_batch{size}_1")
            rates, stages = r["images_per_s"], r["gpudet_stages_s"]
            lines.append(f"| {num(r['images'])} {label} | {size} | **{num(rates['gpudet'])}** ({passes(r)}) | "
                         f"{num(rates['preprocess'])} | "
                         f"{num(rates['model'])} | {stages['preprocess']:.2f} s | "
                         f"{stages['gpu_utilisation_percent']:.0f}% |")
    return "\n".join(lines + ["", f"The default config at each batch size, one after the other; {gpu_name(r)}; tree "
                               f"{r['tree']['commit']}; {r['date'][:10]}. Command: `gpudet bench LIST --device cuda "
                               "--limit N --skip-naive --set run.batch_size=B` (`BATCH_SET=crops ROUNDS=1 bash "
                               "scripts/gpu_check.sh batches`, then `BATCH_SET=photos PHOTOS=800`)."])


PARTS = (("batch 32, 20,000 images", "parts/h100_edeba90/batch32_20000"),
         ("batch 64, 10,000 images", "parts/h100_edeba90/batch64_10000"),
         ("batch 32, 20,000 images", "parts/h100_45be7ef/batch32_20000"),
         ("batch 64, 20,000 images", "parts/h100_45be7ef/batch64_20000"),
         ("batch 32, 20,000 images, the model without its LeakyReLU (a probe)", "parts/h100_45be7ef/noact_batch32_20000"),
         ("batch 32, 20,000 images, GIL switch interval 0.5 ms", "parts/h100_73be5e1/batch32_20000"))
"""(the column, the report): scripts/loop_parts.py over the COCO-sized JPEGs (`gpu_check.sh parts`), three sessions
on an H100 at edeba90, 45be7ef and 73be5e1; 45be7ef's batch 32 and 64 with py-spy."""
WAITS = (("on DALI", "Preprocessor.result"), ("on the postprocess", "Detector._finished"))
"""py-spy rows: the share of the loop's thread's samples whose deepest gpudet frame is that one (the call it
waits in), among the places its summary keeps (its most sampled four)."""
PY_SPY_RATE = 200
"""loop_parts.PY_SPY_RATE: the ticks per second of a report's py-spy summary."""
PART_ROWS = (("dali", "DALI alone (decode, letterbox, normalize)"),
             ("dali+model", "DALI, then the model on each batch (no postprocess)"),
             ("dali|model", "DALI alone, the model running back to back beside it"),
             ("model beside", "the model beside it, meanwhile"),
             ("model alone", "the model alone, on one batch"),
             ("stream_bytes", "`Detector.stream` over the files' bytes in memory"),
             ("stream_files", "the same over the files"),
             ("records", "the records loop of `gpudet bench`, its GPU sampler's stop included (a lower bound)"))


def parts_table() -> str:
    reports = [(label, load(name)) for label, name in PARTS]
    lines = ["| img/s | " + " | ".join(f"{label} ({r['tree']['commit']})" for label, r in reports) + " |",
             "| --- |" + " --- |" * len(reports)]

    def cell(r: dict, key: str) -> str:
        if key == "model alone":
            return num(r["model_alone_images_per_s"])
        rates = r["model_beside_dali_images_per_s"] if key == "model beside" else r["images_per_s"][key]
        text = ", ".join(num(v) for v in rates)
        return f"**{text}**" if key in ("dali", "dali|model", "records") else text

    lines += [f"| {label} | " + " | ".join(cell(r, key) for _, r in reports) + " |" for key, label in PART_ROWS]

    def share(beside: list[float], alone: float) -> str:
        return f"{statistics.mean(beside) / alone:.0%}"

    lines.append("| DALI beside the model, of DALI alone | " + " | ".join(
        share(r["images_per_s"]["dali|model"], statistics.mean(r["images_per_s"]["dali"])) for _, r in reports) + " |")
    lines.append("| the model beside DALI, of the model alone | " + " | ".join(
        share(r["model_beside_dali_images_per_s"], r["model_alone_images_per_s"]) for _, r in reports) + " |")
    lines.append("| the records loop, of DALI alone (at least) | " + " | ".join(
        share(r["images_per_s"]["records"], statistics.mean(r["images_per_s"]["dali"])) for _, r in reports) + " |")

    def summary(r: dict, sampled: str) -> dict | None:  # sampled: "all" (every thread) or "gil"
        return r.get("py_spy", {}).get(sampled, {}).get("summary")

    def waiting(r: dict, frame: str) -> str:
        if (s := summary(r, "all")) is None:
            return "-"
        where = s["threads"]["MainThread"]["where"]
        return f"{sum(part for place, part in where if place.startswith(frame + ' ')):.0%}"

    def gil_held(r: dict) -> str:
        return "-" if (s := summary(r, "gil")) is None else f"{s['share_of_ticks']:.0%}"

    lines += [f"| py-spy: the loop's thread waiting {label} | " + " | ".join(waiting(r, frame) for _, r in reports) +
              " |" for label, frame in WAITS]
    lines.append("| py-spy: the GIL held | " + " | ".join(gil_held(r) for _, r in reports) + " |")
    r, r2 = reports[0][1], next(r for _, r in reports if summary(r, "all"))
    m = r["machine"]
    return "\n".join(lines + ["", f"Distinct COCO-sized JPEGs (`make_image_set.py --kind coco`), the default config at "
                               "each batch size; each part once to warm up, then twice (both rates); "
                               f"{m['gpus'][0]}, {m['cores']} cores; torch {m['torch']}, onnxruntime "
                               f"{m['onnxruntime']}, DALI {m['dali']}; three sessions (the tree beside each column); "
                               f"{r['date'][:10]}. py-spy sampled the records loop for "
                               f"{r2['py_spy']['all']['summary']['ticks'] // PY_SPY_RATE} s at {PY_SPY_RATE} Hz, "
                               "every thread, then the GIL's holders. Command: `python scripts/loop_parts.py "
                               "coco/list.txt --out DIR --limit N --set run.batch_size=B --py-spy BIN` "
                               "(`PARTS_SET=run.batch_size=B LIMIT=N PY_SPY=BIN bash scripts/gpu_check.sh parts`)."])


COCO_100K = (("87a4187", "before"), ("73be5e1", "now"))
"""(the tree, the reports' name): `gpudet detect` over 100,000 distinct COCO-sized JPEGs, in turn twice
(`DETECT_COUNT=100000 ROUNDS=0 BEFORE=DIR bash scripts/gpu_check.sh ab`)."""


def coco_100k_table() -> str:
    lines = ["| tree | round | wall clock from the shell | gpudet's start + setup | the loop | images | detections |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for round_ in (1, 2):
        for tree, name in COCO_100K:
            r = load(f"coco100k/h100_73be5e1/detect_{name}_{round_}")
            t = r["seconds"]
            lines.append(f"| {tree} | {round_} | **{r['wall_clock_from_the_shell_s']:.1f} s** | "
                         f"{t['startup']:.1f} s + {t['setup']:.1f} s | **{num(r['images_per_s'])} img/s** | "
                         f"{num(r['processed'])} | {num(r['detections'])} |")
    return "\n".join(lines + ["", f"The default config, `gpudet detect LIST --out DIR --overwrite` from the shell; "
                               f"the two trees in turn, twice, on one {r['device'].split('(')[1].rstrip(')')}; "
                               f"{r['started'][:10]}. Command: `DETECT_COUNT=100000 ROUNDS=0 BEFORE=DIR bash "
                               "scripts/gpu_check.sh ab`."])


PROFILE = "profile/coco_8000"
"""scripts/profile_loop.py over COCO-sized JPEGs: where the GPU idles in the default loop."""


def profile_table() -> str:
    r = load(PROFILE)
    gaps, idle = r["idle_gaps"], r["during_idle_ms"]
    lines = ["| over the loop | |", "| --- | --- |",
             f"| images, loop time (under the profiler) | {num(r['images'])}, {r['loop_s']:.2f} s |",
             f"| GPU busy, any stream | **{r['gpu_busy_percent']:.1f}%** |",
             f"| idle gaps of at least {gaps['at_least_us']:.0f} us | {num(gaps['count'])}, {gaps['seconds']:.2f} s in "
             f"all; median {gaps['median_us']:.1f} us, longest {num(gaps['longest_us'])} us |"]
    lines += ["", "| during the idle gaps, a host thread in | ms |", "| --- | --- |"]
    lines += [f"| {what} | {ms:.1f} |" for what, ms in list(idle.items())[:12]]
    lines += ["", "| GPU time by kernel or copy (the largest) | ms |", "| --- | --- |"]
    lines += [f"| {what.replace('|', '/')} | {ms:.1f} |" for what, ms in list(r["gpu_time_by_name_ms"].items())[:8]]
    m = r["machine"]
    return "\n".join(lines + ["", f"{num(r['images'])} distinct COCO-sized JPEGs (`make_image_set.py --kind coco`), "
                               f"the {r['config']} config, after a warm-up pass; {m['gpus'][0]}, {m['cores']} cores; "
                               f"torch {m['torch']}, onnxruntime {m['onnxruntime']}, DALI {m['dali']}; tree "
                               f"{r['tree']['commit']}; {r['date']}. Command: `{shorten(r['command'])}` "
                               "(`scripts/gpu_check.sh profile`)."])


def shorten(command: str) -> str:
    return re.sub(r"--json \S+|/\S*/(?=\S+\.(txt|py))", "", command).replace("  ", " ").strip()


SECTIONS = {"retinaface": retinaface_table, "detect": detect_table, "retinanet": retinanet_table,
            "ray": ray_table, "formats": formats_table, "threads": threads_table,
            "omp": omp_table, "cpu": cpu_table, "expert": expert_table, "s3": s3_table,
            "profile": profile_table, "yolo": yolo_table, "batches": batch_table, "streams": streams_table,
            "batch_sets": batch_sets_table, "parts": parts_table, "coco_100k": coco_100k_table}


ALL_SECTIONS = SECTIONS | {"speed": speed_table}


def render(text: str, sections: dict) -> str:
    """The text with each section's table rendered between its markers; a section whose markers
    are missing is an error, not a section skipped."""
    for name, make in sections.items():
        text, found = re.subn(rf"(<!-- rendered: {name} -->\n)(?:(?!<!-- ).)*?(<!-- end -->)",
                              lambda m: m.group(1) + make() + "\n" + m.group(2), text, flags=re.S)
        if found != 1:
            raise SystemExit(f"render_benchmarks: the markers of section {name!r} are missing or repeated")
    return text


NOT_MEASURED = [r"```.*?```", r"`[^`\n]*`", r"<!-- rendered: \w+ -->.*?<!-- end -->", r"\]\([^)]*\)",
                r"\b\d{4}-\d{2}-\d{2}\b", r"\b\d+(?:\.\d+){2,}\b", r"\b\d+x\d+\b", r"[\w./-]+\.(?:json|txt|py|yaml|md)\b",
                r"\b[\w-]*[A-Za-z_][\w-]*\d\w*\b(?<!\dx)|\b\d+[A-Za-z_]\w*\b(?<!\dx)"]
"""Code, rendered tables, links, dates, versions, sizes, names with digits (H200, fp16, R50-FPN):
no measurements. A ratio keeps its number (1.22x)."""
NUMBER = re.compile(r"(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")


def report_numbers(node, into: set[float]) -> None:
    """Every number of a report: its values, the numbers inside its strings, its lists' lengths."""
    if isinstance(node, bool) or node is None:
        return
    if isinstance(node, (int, float)):
        into.add(float(node))
    elif isinstance(node, str):
        into.update(float(m.group(0).replace(",", "")) for m in NUMBER.finditer(node))
    else:
        if isinstance(node, list):
            into.add(float(len(node)))
        for value in (node.values() if isinstance(node, dict) else node):
            report_numbers(value, into)


def named_reports(section: str) -> set[Path]:
    """The reports a section names: files of docs/bench/ (by path or name), folders of them, and
    those its rendered tables load."""
    found = set()
    for match in re.finditer(r"([\w./-]+\.(?:json|txt))\b", section):
        found.update(BENCH.rglob(Path(match.group(1)).name))
    for match in re.finditer(r"docs/bench/([\w/]+)/", section):
        found.update(p for p in (BENCH / match.group(1)).rglob("*") if p.suffix in (".json", ".txt"))
    for name in re.findall(r"<!-- rendered: (\w+) -->", section):
        loaded = []
        original = globals()["load"]
        globals()["load"] = lambda report: (loaded.append(report), original(report))[1]
        try:
            ALL_SECTIONS[name]()
        finally:
            globals()["load"] = original
        found.update(BENCH / f"{report}.json" for report in loaded)
    return found


def section_numbers(section: str) -> set[float]:
    """The numbers of the reports a section names."""
    values: set[float] = set()
    for path in named_reports(section):
        content = path.read_text()
        report_numbers(json.loads(content) if path.suffix == ".json" else content, values)
    return values


def unbacked(text: str) -> list[str]:
    """The numbers of `text`'s prose that no report of their section holds: "heading: number"."""
    missing = []
    for section in re.split(r"\n(?=#)", text):
        values = section_numbers(section)
        prose = section
        for pattern in NOT_MEASURED:
            prose = re.sub(pattern, " ", prose, flags=re.S)
        for match in NUMBER.finditer(prose):
            written = match.group(0)
            if len(written) == 1:
                continue
            number, digits = float(written.replace(",", "")), len(written.partition(".")[2])
            if not any(round(v, digits) == number or round(v * 100, digits) == number for v in values):
                missing.append(f"{section.splitlines()[0][:60]}: {written}")
    return missing


def speed_section(readme: str) -> str:
    return readme[readme.index("## Speed"):].split("\n## ", 1)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the docs match the reports")
    check = parser.parse_args().check
    stale = []
    for path, sections in ((ROOT / "docs" / "BENCHMARKS.md", SECTIONS), (ROOT / "README.md", {"speed": speed_table})):
        text = path.read_text()
        new = render(text, sections)
        if new != text:
            stale.append(path.name)
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"not what docs/bench/ says: {', '.join(stale)}; run python scripts/render_benchmarks.py", file=sys.stderr)
        return 1
    missing = unbacked((ROOT / "docs" / "BENCHMARKS.md").read_text()) + \
        unbacked(speed_section((ROOT / "README.md").read_text()))
    if missing:
        print("numbers in the prose that no report beside them holds (name the report in the section, or drop "
              "the claim):\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
