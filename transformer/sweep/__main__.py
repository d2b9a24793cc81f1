"""Hyperparameter sweeps: an experiment's trials, each run as its own training run.

An experiment file (experiments/NAME.py) names its config, either with its own
`get_config(arg)` (called with the file's `CONFIG_ARG`, '' where it sets none) or with
`CONFIG = 'configs/gpt.py:tiny'`, and lists its trials as override dicts from
`get_sweep()`, built with the helpers of `transformer.sweep`:

    def get_sweep():
        return sweep.grid({"optim.lr": [1e-3, 3e-3], "model.d_model": [128, 192]})

    python -m transformer.sweep --experiment experiments/NAME.py --workdir runs/NAME [--parallel 2]

Every trial's overrides are applied to the config before anything runs, so an unknown key
or a bad value stops the sweep at once (`error: ...`, exit code 2, as for any bad file or
flag; exit code 1 means a trial did not finish). Each trial runs `python -m
transformer.train` (a local process, or a Ray task with `--backend ray`: see
transformer/sweep/launch.py, which runs them) in DIR/trials/NAME_OF_ITS_OVERRIDES, so it can be inspected,
resumed or generated from like any run. Running the same command again skips finished trials and
resumes the others from their checkpoints; a failed trial is recorded with its error
(DIR/trials/*/trial.json) and the others go on. DIR/sweep.json records the config and the
trials: results cover those trials only, and a workdir holding a sweep of another config is
refused. DIR/results.csv and .md are rewritten as trials end (`python -m transformer.report
DIR` rebuilds them any time). `--halving 200,400` stops the worse half of the trials at each
of those steps. Trials that train on an image folder read one index of it, which the sweep makes
in DIR/images before any trial starts.
"""

import os
import sys

from absl import flags

from transformer import cli
from transformer.sweep import experiments, halving, launch, results


def define_flags() -> None:
    flags.DEFINE_string("experiment", None, "experiments/NAME.py (get_config or CONFIG, get_sweep)")
    flags.DEFINE_string("workdir", None, "the sweep's directory: trials/, results.csv/md, plots")
    flags.DEFINE_integer("parallel", 1, "trials at once (one GPU each where there are GPUs)")
    flags.DEFINE_enum("backend", "local", sorted(launch.BACKENDS), "where trials run: local processes or Ray tasks")
    flags.DEFINE_string("ray_address", "", "the Ray cluster (default: a local Ray instance)")
    flags.DEFINE_string("halving", "", "successive halving rungs, in steps (e.g. 200,400): at each, the worse half "
                        "of the trials by --metric stops")
    flags.DEFINE_string("metric", "eval/loss", "what picks the best trial (and halves the trials)")
    flags.DEFINE_enum("mode", "min", ["min", "max"], "whether the best --metric is the smallest or the largest")
    flags.mark_flags_as_required(["experiment", "workdir"])


def prepare(args) -> tuple[experiments.Experiment, list[int]]:
    """The experiment and the halving rungs, checked, and the workdir with its sweep.json."""
    if args.parallel < 1:
        raise ValueError(f"--parallel={args.parallel} must be at least 1")
    if args.ray_address and args.backend != "ray":
        raise ValueError("--ray_address needs --backend ray")
    experiment = experiments.load_experiment(args.experiment)
    rungs = halving.parse_rungs(args.halving, experiment.steps)
    os.makedirs(args.workdir, exist_ok=True)
    experiments.write_settings(args.workdir, experiment, args.metric, args.mode)
    return experiment, rungs


def main(argv) -> None:
    args = flags.FLAGS
    experiment, rungs = prepare(args)
    launcher = launch.Ray(args.ray_address) if args.backend == "ray" else launch.Local()
    parallel = launcher.slots(args.parallel)
    print(f"{len(experiment.trials)} trials of {experiment.config_spec} in {args.workdir}", file=sys.stderr)
    update = lambda: launch.write_report(args.workdir, args.metric, args.mode)
    experiments.share_image_indexes(experiment, args.workdir)
    try:
        if rungs:
            statuses = halving.run_halving(experiment, args.workdir, parallel, launcher, rungs, args.metric, args.mode,
                                           update)
        else:
            statuses = launch.run_trials(experiment, args.workdir, parallel, launcher, on_change=update)
    except KeyboardInterrupt:
        update()
        raise SystemExit("interrupted: the running trials saved checkpoints; run the same command to go on") from None
    finally:
        launcher.close()
    print(summary(statuses, update(), args), file=sys.stderr)
    sys.exit(0 if all(status in results.ENDED for status in statuses.values()) else 1)


def summary(statuses: dict[str, str], rows: list[dict], args) -> str:
    """One line: how many trials are done, stopped or not done, and the best."""
    top = results.best(rows, args.metric, args.mode)
    failed = [name for name, status in statuses.items() if status not in results.ENDED]
    stopped = sum(status == "stopped" for status in statuses.values())
    return (f"{len(statuses) - len(failed) - stopped} of {len(statuses)} trials done"
            + (f", {stopped} stopped early" if stopped else "")
            + (f"; not done: {', '.join(failed)}" if failed else "")
            + (f"; best: {top['trial']} ({args.metric} {top[f'best {args.metric}']:.4g})" if top else "")
            + f"; results in {args.workdir}/results.md")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
