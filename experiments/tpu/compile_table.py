"""Presets compiled by libtpu for TPU slices on a CPU machine: fits, peak GiB a chip, largest batch, FLOPs, roofline.

    python experiments/tpu/compile_table.py --out experiments/tpu/results.jsonl     # the committed table
    python experiments/tpu/compile_table.py --runs gpt2-small --slices v5e:2x4     # one cell
    python experiments/tpu/compile_table.py --runs llama3-8b --slices v5p:2x2x1 --remats full --num_slices 2  # DCN
    python experiments/tpu/compile_table.py --table experiments/tpu/results.jsonl  # RESULTS.md's table
    python experiments/tpu/compile_table.py --verify experiments/tpu/results.jsonl --runs gpt2-small  # the largest

Each (preset, slice, remat) is `transformer.training.topology.compile_run` (what `inspect --topology` runs): the
train step over a mesh of every chip on fsdp, bfloat16, scanned layers, attention=auto (splash), compiled at one
and two rows a chip; the largest batch is solved from the two. Text presets read the stdlib bytes with the
preset's vocabulary; ViT-B/16 reads 224 x 224 x 3 noise in an .npz of 1000 classes. Needs `pip install -e '.[tpu]'`.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from transformer import config as config_lib  # noqa: E402
from transformer.training import checks, topology  # noqa: E402

COMMON = ["model.dtype=bfloat16", "model.scan_layers=True", "model.attention=auto", "mesh.data=1", "mesh.fsdp=-1"]
RUNS = {  # name: (config, overrides)
    "gpt2-small": ("configs/gpt.py:gpt2-small", ["data.tokenizer=byte", "model.vocab_size=50304", "data.seq_len=1024"]),
    "gpt2-xl": ("configs/gpt.py:gpt2-xl", ["data.tokenizer=byte", "model.vocab_size=50304", "data.seq_len=1024"]),
    "llama3-8b": ("configs/gpt.py:llama3-8b", ["data.tokenizer=byte", "model.vocab_size=128256", "data.seq_len=8192",
                                               "model.max_len=8192"]),
    "qwen3-30b-a3b": ("configs/gpt.py:qwen3-30b-a3b", ["data.tokenizer=byte", "model.vocab_size=151936",
                                                       "data.seq_len=4096", "model.max_len=4096"]),
    "vit-b16": ("configs/vit.py:b16", ["model.image_size=224", "model.channels=3", "model.num_classes=1000",
                                       "model.scan_layers=False"]),  # its drop_path grows with depth: no scan
}
SLICES = ("v5e:2x4", "v5p:2x2x1", "v6e:2x4")
REMATS = ("none", "full")


def images_npz(folder: str) -> str:
    """16 random 224 x 224 x 3 images labelled up to 999: ViT-B/16's ImageNet shapes, no ImageNet."""
    path = os.path.join(folder, "imagenet_shapes.npz")
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 256, (16, 224, 224, 3), np.uint8), y=np.arange(16) * 66 % 1000)
    return path


def cell(name: str, slice_name: str, remat: str, folder: str, slices: int = 1, rows: int = 1) -> dict:
    spec, overrides = RUNS[name]
    chips = len(topology.devices(slice_name, slices))
    dcn = [f"mesh.data={slices}"] if slices > 1 else []  # the data axis across the slices, fsdp within each
    data = [f"data.source={images_npz(folder)}"] if spec.startswith("configs/vit") else []
    path, _, arg = spec.partition(":")
    config = config_lib.load(os.path.join(REPO, path) + ":" + arg,
                             [*COMMON, *overrides, *data, *dcn, f"model.remat={remat}",
                              f"data.batch_size={chips * rows}"])
    launch = checks.checked(config)
    start = time.perf_counter()
    r = topology.compile_run(launch.config, slice_name, launch.task, second=rows == 1, decode=False, slices=slices)
    t, rows = r.train, r.per_chip_rows
    return dict(run=name, slice=r.topology, chip=r.chip.kind, chips=chips, remat=remat, batch=t.batch,
                fits=bool(t.fits and t.peak <= r.chip.hbm_gib * topology.GiB), peak_gib=t.peak / topology.GiB,
                largest_rows_per_chip=None if r.largest is None else r.largest * rows // t.batch,
                largest_compiled=r.largest is not None,
                flops=t.flops, model_flops=r.model_flops, roofline_s=topology.roofline(t, r.chip),
                seconds=time.perf_counter() - start)


def formula_ms(row: dict) -> float:
    """The formula's FLOPs of a row at its chip's bf16 peak, in ms."""
    chip = next(c for c in topology.CHIPS.values() if c.kind == row["chip"])
    return row["model_flops"] / chip.bf16_flops * 1e3


def format_table(rows: list[dict]) -> str:
    head = ("| preset | slice | remat | fits at 1 row a chip | peak GiB a chip | largest rows a chip | compiled "
            "TFLOPs a chip | formula TFLOPs a chip | roofline ms (1 row) | formula ms at peak (1 row) | compile s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | {r['slice']} | {r['remat']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        flops = "-" if r["flops"] is None else f"{r['flops'] / 1e12:.1f}"
        roof = "-" if r["roofline_s"] is None else f"{r['roofline_s'] * 1e3:,.0f}"
        largest = "-" if r["largest_rows_per_chip"] is None else \
            f"{r['largest_rows_per_chip']}{'' if r.get('largest_compiled') else '*'}"  # *: the line's guess alone
        lines.append(f"| {r['run']} | {r['slice']} | {r['remat']} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['peak_gib']:.2f} | {largest} | {flops} | {r['model_flops'] / 1e12:.1f} | "
                     f"{roof} | {formula_ms(r):,.1f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--slices", nargs="+", default=list(SLICES))
    p.add_argument("--remats", nargs="+", default=list(REMATS))
    p.add_argument("--num_slices", type=int, default=1, help="slices of each, joined by DCN (mesh.data across them)")
    p.add_argument("--out", help="append each cell's JSON line here")
    p.add_argument("--table", help="print the Markdown table of a JSON-lines file and stop")
    p.add_argument("--verify", help="a results file: compile its cells' largest rows a chip, and one more")
    args = p.parse_args()
    if args.verify:
        return verify(args)
    if args.table:
        rows = {(r["run"], r["slice"], r["remat"]): r for r in map(json.loads, open(args.table))}  # the last of each
        print(format_table(list(rows.values())))
        return
    with tempfile.TemporaryDirectory() as folder:
        for name in args.runs:
            for slice_name in args.slices:
                for remat in args.remats:
                    try:
                        row = cell(name, slice_name, remat, folder, args.num_slices)
                    except Exception as error:  # noqa: BLE001 (a cell that fails is a row of the table)
                        row = dict(run=name, slice=slice_name if args.num_slices == 1 else
                                   f"{args.num_slices} x {slice_name}", remat=remat,
                                   error=(str(error).strip().splitlines() or [type(error).__name__])[0])
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")


def verify(args) -> None:
    """The two-compile line's largest rows a chip of each chosen cell of `args.verify`, compiled: at it (it
    should fit) and one row a chip more (it should not); a JSON line each, then a table."""
    lines = ["| preset | slice | remat | largest rows a chip (two compiles) | compiled at it: peak GiB, fits | "
             "one row more: peak GiB, fits |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        for r in map(json.loads, open(args.verify)):
            if (r["run"], r["slice"], r["remat"]) not in {(n, s, m) for n in args.runs for s in args.slices
                                                          for m in args.remats} or not r.get("largest_rows_per_chip"):
                continue
            cells = [cell(r["run"], r["slice"], r["remat"], folder, rows=r["largest_rows_per_chip"] + more)
                     for more in (0, 1)]
            for c in cells:
                print(json.dumps(c), flush=True)
            hbm = next(c for c in topology.CHIPS.values() if c.kind == r["chip"]).hbm_gib
            said = [f"{c['peak_gib']:.2f} of {hbm:g}, {'fits' if c['fits'] else 'does not'}" for c in cells]
            lines.append(f"| {r['run']} | {r['slice']} | {r['remat']} | {r['largest_rows_per_chip']} | {said[0]} | "
                         f"{said[1]} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
