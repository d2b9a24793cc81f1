"""The tiny mixture of experts' train step under each dispatch (model.moe_dispatch: dropless, capacity, dense)
against the dense tiny GPT's, on this machine's default device (the CPU here).

    python experiments/moe_dispatch_cpu.py [--rounds 7] [--steps 4] [--out experiments/moe_vs_dense/dispatch.md]

The trials are moe_vs_dense.py's (configs/gpt.py:tiny, a dense mlp of 768, against tiny with 8 experts of 384, 2
per token: 1.003 x the forward FLOPs). Each is compiled as a run compiles it (`transformer.bench.measure.Ours`),
warmed up, then timed in interleaved rounds (every trial once a round, so a busy moment of a shared machine
falls on all of them); a trial's step time is the median of its rounds' mean step times. Writes the table to
--out, with the device, the date and the spread.
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
from moe_vs_dense import CONFIG, DENSE, MOE  # noqa: E402

from transformer import config as config_lib  # noqa: E402
from transformer.bench import measure  # noqa: E402
from transformer.training import checks, shapes  # noqa: E402

TRIALS = {"dense tiny": DENSE, **{f"tiny-moe, {d}": {**MOE, "model.moe_dispatch": d}
                                  for d in ("dropless", "capacity", "dense")}}
EXACT = {"dropless": True, "capacity": False, "dense": True}  # capacity drops the slots past an expert's places


def build(overrides: dict, workdir: str) -> measure.Ours:
    config = shapes.resolved(config_lib.load(os.path.join(ROOT, CONFIG), [f"{k}={v}" for k, v in overrides.items()]))
    return measure.Ours.build(measure.cached_text(config, checks.validate(config)), workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="timed steps a round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    parser.add_argument("--out", default=os.path.join(ROOT, "experiments/moe_vs_dense/dispatch.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: build(overrides, os.path.join(tmp, str(i))) for i, (name, overrides) in enumerate(TRIALS.items())}
        for ours in runs.values():
            ours.steps(args.warmup)
        times = {name: [] for name in runs}
        for r in range(args.rounds):
            for name, ours in runs.items():
                times[name].append(ours.steps(args.steps))
            print(f"round {r + 1}: " + ", ".join(f"{n} {1e3 * t[-1]:.1f} ms" for n, t in times.items()), flush=True)
    write(args, times)


def write(args, times: dict) -> None:
    dense = statistics.median(times["dense tiny"])
    device = jax.devices()[0]
    lines = [f"# The tiny MoE's train step by dispatch, against the dense tiny ({device.platform}: "
             f"{device.device_kind}, {os.cpu_count()} cores)", "",
             f"Made by `python experiments/moe_dispatch_cpu.py --rounds {args.rounds} --steps {args.steps}` on "
             f"{datetime.date.today()}: the median over {args.rounds} interleaved rounds of each trial's mean time "
             f"over {args.steps} steps (after {args.warmup} warm-up steps); batch 16 x 128 tokens.", "",
             "| trial | exact | step, ms (median) | min..max of the rounds, ms | x the dense tiny |",
             "|---|---|---|---|---|"]
    for name, t in times.items():
        dispatch = name.partition(", ")[2]
        exact = "yes" if not dispatch or EXACT[dispatch] else "no (drops past capacity)"
        lines.append(f"| {name} | {exact} | {1e3 * statistics.median(t):.1f} | {1e3 * min(t):.1f}..{1e3 * max(t):.1f} "
                     f"| {statistics.median(t) / dense:.2f} |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
