"""Long context: compiled memory and step time of GPT tiny's train step, per length and attention.

  python experiments/long_context/bench.py [--lengths 1024,2048,...] [--settings dense,blockwise,window1024]
      [--extend_to 1048576] [--fit_gib 20] [--time_gib 12] [--max_step_s 120]

GPT tiny at batch 1 (`configs/gpt.py:tiny-long`: rotary positions, byte vocabulary) with
data.seq_len = model.max_len = L, in three settings: dense (`model.attention=dense`),
blockwise (full causal), window1024 (blockwise, `model.window=1024`); eval_fraction 0.1 past
256K, so that the eval split holds a window. Each (setting, L) builds the training run's own
jitted step (`loop.setup`, as `transformer.bench` does: optimizer, donated state) and compiles
it; XLA's `memory_analysis()` gives the step's temporaries and total (arguments + outputs +
temporaries - aliased: the donated train state counted once; params, optimizer state, grads,
activations). Where the total is under `--time_gib` and the step is not estimated over
`--max_step_s` (the last measured step of the setting scaled by (L / L_last)^2, linearly for
the window), it runs 2 warm-up steps and reports the median of the timed ones and tokens/s.
After the sweep each setting's length keeps doubling, compile only, until the total passes
`--fit_gib` or `--extend_to`: the longest L that fits.
Rows go to results.json as they come; the markdown table is printed at the end
(`--table` prints it from results.json alone).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from transformer import config as config_lib  # noqa: E402
from transformer.bench.measure import Ours  # noqa: E402

SETTINGS = {"dense": ["model.attention=dense"], "blockwise": [], "window1024": ["model.window=1024"]}
GIB = 2**30


def config_for(setting: str, length: int, extra: tuple = ()):
    overrides = [*extra, f"data.seq_len={length}", f"model.max_len={length}", "data.eval_batches=1",
                 f"data.eval_fraction={0.02 if length <= 2**18 else 0.1}", *SETTINGS[setting]]
    return config_lib.load(os.path.join(REPO, "configs/gpt.py:tiny-long"), overrides)


def measure(setting: str, length: int, time_it: bool, steps: int, time_gib: float, extra: tuple = ()) -> dict:
    """Compiles the train step (memory); times it when `time_it` and it fits in `time_gib`, fewer steps when slow."""
    row = {"setting": setting, "L": length, "load_1min": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as workdir:
        ours = Ours.build(config_for(setting, length, extra), workdir)
        m = ours.compiled.memory_analysis()
        row.update(compile_s=round(ours.compile_s, 1), temp_bytes=m.temp_size_in_bytes,
                   argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                   alias_bytes=m.alias_size_in_bytes,
                   total_bytes=m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
        if time_it and row["total_bytes"] > time_gib * GIB:
            row["skipped"] = f"> {time_gib:g} GiB"
        elif time_it:
            warm = ours.steps(1)
            if warm[0] < 60:
                warm += ours.steps(1)
                times = ours.steps(steps if warm[-1] < 5 else 3 if warm[-1] < 30 else 1)
            else:
                times = warm[-1:]
            step_s = statistics.median(times)
            row.update(warmup_s=[round(t, 3) for t in warm], step_times_s=[round(t, 3) for t in times],
                       step_s=step_s, tokens_per_s=length / step_s, loss=ours.loss)
        del ours
    row["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10)
    return row


def show(row: dict) -> None:
    timed = f"step {row['step_s']:8.2f} s  {row['tokens_per_s']:9,.0f} tok/s" if "step_s" in row else \
        f"not timed ({row.get('skipped', '')})"
    print(f"{row['setting']:10s} L={row['L']:>9,}  temp {row['temp_bytes'] / GIB:8.2f} GiB  total "
          f"{row['total_bytes'] / GIB:8.2f} GiB  compile {row['compile_s']:5.1f} s  {timed}  "
          f"(load {row['load_1min']:.1f}, rss {row['max_rss_mib']:,} MiB)", flush=True)


def save(path: str, rows: list[dict], args) -> None:
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, "cpus": os.cpu_count(), "args": vars(args), "rows": rows,
                   "longest_fitting": longest_fitting(rows, args.fit_gib)}, f, indent=1)


def longest_fitting(rows: list[dict], gib: float) -> dict:
    """Per setting: the longest L whose compiled total fits in `gib` (every shorter one measured fits too)."""
    best = {}
    for setting in dict.fromkeys(r["setting"] for r in rows):
        fits = None
        for r in sorted((r for r in rows if r["setting"] == setting), key=lambda r: r["L"]):
            if r["total_bytes"] > gib * GIB:
                break
            fits = r["L"]
        best[setting] = fits
    return best


def markdown(rows: list[dict], fit_gib: float) -> str:
    lines = ["| setting | L | temp (GiB) | total (GiB) | compile (s) | step (s) | tokens/s | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = f"{r['step_s']:.2f}" if "step_s" in r else f"- ({r.get('skipped', '')})"
        tok = f"{r['tokens_per_s']:,.0f}" if "step_s" in r else "-"
        lines.append(f"| {r['setting']} | {r['L']:,} | {r['temp_bytes'] / GIB:.2f} | {r['total_bytes'] / GIB:.2f} | "
                     f"{r['compile_s']:.1f} | {step} | {tok} | {r['load_1min']:.1f} |")
    lines += ["", f"Longest L (power of two) whose compiled step fits in {fit_gib:g} GiB:", ""]
    lines += [f"- {s}: {f'{L:,}' if L else 'none'}" for s, L in longest_fitting(rows, fit_gib).items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--extend_to", type=int, default=2**20, help="double each setting's L, compile only, "
                        "up to this while it fits in --fit_gib (0: no extension)")
    parser.add_argument("--fit_gib", type=float, default=20.0)
    parser.add_argument("--time_gib", type=float, default=12.0, help="time only steps compiled under this")
    parser.add_argument("--max_step_s", type=float, default=120.0, help="time only steps estimated under this")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (3 or 1 when a step is slow)")
    parser.add_argument("--extra", default="", help="more config overrides for every setting, comma-separated "
                        "(e.g. model.remat=full)")
    parser.add_argument("--no_time", action="store_true", help="compile only")
    parser.add_argument("--results", default=os.path.join(HERE, "results.json"))
    parser.add_argument("--table", action="store_true", help="print the markdown table of --results and exit")
    args = parser.parse_args()
    if args.table:
        with open(args.results) as f:
            return print(markdown(json.load(f)["rows"], args.fit_gib))
    print(f"jax {jax.__version__} | {os.cpu_count()} cpus | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          flush=True)
    rows = []
    for setting in args.settings.split(","):
        last, swept = None, [int(x) for x in args.lengths.split(",")]
        lengths = list(swept)
        while lengths:
            length = lengths.pop(0)
            power = 1 if setting.startswith("window") else 2
            estimate = last["step_s"] * (length / last["L"]) ** power if last else 0.0
            skip = "--no_time" if args.no_time else "extension: compile only" if length not in swept else \
                "a step took > 60 s before" if last and max(last["warmup_s"]) > 60 else \
                f"est. {estimate:.0f} s" if estimate > args.max_step_s else None
            row = measure(setting, length, skip is None, args.steps, args.time_gib,
                          tuple(filter(None, args.extra.split(","))))
            if skip and "skipped" not in row:
                row["skipped"] = skip
            last = row if "step_s" in row else last
            rows.append(row)
            show(row)
            save(args.results, rows, args)
            if not lengths and row["total_bytes"] <= args.fit_gib * GIB and length * 2 <= args.extend_to:
                lengths.append(length * 2)
    print("\n" + markdown(rows, args.fit_gib), flush=True)


if __name__ == "__main__":
    main()
