"""Rebuild a sweep's table and plots from its trials.

The table holds each trial's overrides, status, final and best metrics, the best one named; the plots
show the metric against each swept value and every trial's loss curves.

    python -m transformer.report DIR [--metric eval/loss] [--mode min]
    python -m transformer.report DIR --scaling [--target_flops 1e21]

writes DIR/results.csv, DIR/results.md, DIR/metric.png and DIR/curves.png (transformer/sweep/results.py);
it runs any time, during the sweep too. The metric that picks the best trial defaults to the sweep's own.
With --scaling, over an IsoFLOP sweep (transformer/sweep/isoflop.py lays one out) it also fits the scaling
laws (transformer/sweep/scaling_laws.py): each budget's minimum, the exponents of N_opt ~ C^a and D_opt ~ C^b
with their uncertainty, the compute-optimal N and D at --target_flops (default 10 x the largest budget), in
DIR/scaling.md, DIR/isoflops.png and DIR/power_laws.png.
"""

import os

from absl import flags

from transformer import cli
from transformer.sweep import results


def main(argv) -> None:
    if len(argv) != 2:
        raise ValueError("usage: python -m transformer.report SWEEP_DIR [--metric M] [--mode min|max]")
    workdir, f = argv[1], flags.FLAGS
    if not os.path.isdir(os.path.join(workdir, "trials")):
        raise ValueError(f"{workdir} holds no trials/ (not a sweep directory)")
    saved = results.read_settings(workdir)
    metric, mode = f.metric or saved["metric"], f.mode or saved["mode"]
    rows = results.write(workdir, metric, mode)
    print(open(os.path.join(workdir, "results.md")).read())
    print(f"{len(rows)} trials; wrote results.csv, results.md, metric.png, curves.png in {workdir}")
    if f.scaling:
        from transformer.sweep import scaling_laws

        print(scaling_laws.write(workdir, metric, f.target_flops))
        print(f"wrote scaling.md, isoflops.png, power_laws.png in {workdir}")


if __name__ == "__main__":
    flags.DEFINE_string("metric", None, "default: the sweep's (sweep.json), else eval/loss")
    flags.DEFINE_enum("mode", None, ["min", "max"], "default: the sweep's, else min")
    flags.DEFINE_bool("scaling", False, "also fit scaling laws over the sweep's budgets (an IsoFLOP sweep)")
    flags.DEFINE_float("target_flops", 0.0, "--scaling: the budget to predict N and D for (0: 10 x the largest)")
    cli.run(main, positional=1)
