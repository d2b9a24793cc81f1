"""Hyperparameter sweeps: an experiment's trials, each run as its own training run.

An experiment file (experiments/NAME.py) names its config, either with its own
`get_config(arg)` (called with the file's `CONFIG_ARG`, '' where it sets none) or with
`CONFIG = 'configs/gpt.py:tiny'`, and lists its trials as override dicts from
`get_sweep()`, built with the helpers here:

    def get_sweep():
        return sweep.grid({"optim.lr": [1e-3, 3e-3], "model.d_model": [128, 192]})

    python -m transformer.sweep --experiment experiments/NAME.py --workdir runs/NAME [--parallel 2]

Every trial's overrides are applied to the config before anything runs, so an unknown key
or a bad value stops the sweep at once (`error: ...`, exit code 2, as for any bad file or
flag; exit code 1 means a trial did not finish). Each trial runs `python -m
transformer.train` (a local process, or a Ray task with `--backend ray`: see
transformer/launch.py, which runs them) in DIR/trials/NAME_OF_ITS_OVERRIDES, so it can be inspected, resumed
or generated from like any run. Running the same command again skips finished trials and
resumes the others from their checkpoints; a failed trial is recorded with its error
(DIR/trials/*/trial.json) and the others go on. DIR/sweep.json records the config and the
trials: results cover those trials only, and a workdir holding a sweep of another config is
refused. DIR/results.csv and .md are rewritten as trials end (`python -m transformer.report
DIR` rebuilds them any time). `--halving 200,400` stops the worse half of the trials at each
of those steps. Trials that train on an image folder read one index of it, which the sweep makes
in DIR/images before any trial starts.
"""

import copy
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import sys
from collections import Counter

import ml_collections
import numpy as np
from absl import flags
from tqdm import tqdm

from transformer import cli, config as config_lib, launch, report
from transformer.data import images
from transformer.training import checks

# Sweep expansion -----------------------------------------------------------------------


def grid(axes: dict[str, list]) -> list[dict]:
    """Every combination of the values: {'a': [1, 2], 'b': [3, 4]} -> 4 trials (the last key varies fastest)."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def zipped(axes: dict[str, list]) -> list[dict]:
    """The i-th value of every key together: {'a': [1, 2], 'b': [3, 4]} -> 2 trials."""
    lengths = {len(v) for v in axes.values()}
    if len(lengths) > 1:
        raise ValueError(f"zipped: the value lists differ in length: { {k: len(v) for k, v in axes.items()} }")
    return [dict(zip(axes, values)) for values in zip(*axes.values())]


def product(*sweeps: list[dict]) -> list[dict]:
    """Every trial of each sweep combined with every trial of the others."""
    return [dict(itertools.chain.from_iterable(t.items() for t in trials)) for trials in itertools.product(*sweeps)]


def uniform(low: float, high: float):
    return lambda rng: float(rng.uniform(low, high))


def log_uniform(low: float, high: float):
    return lambda rng: float(math.exp(rng.uniform(math.log(low), math.log(high))))


def choice(values: list):
    return lambda rng: values[int(rng.integers(len(values)))]


def random(count: int, axes: dict, seed: int = 0) -> list[dict]:
    """`count` trials, each key drawn from its distribution (uniform, log_uniform, choice); same seed, same trials."""
    rng = np.random.default_rng(seed)
    return [{key: draw(rng) for key, draw in axes.items()} for _ in range(count)]


# Experiments and trials ----------------------------------------------------------------


@dataclasses.dataclass
class Experiment:
    path: str
    config_spec: str
    trials: dict[str, dict]  # trial name -> overrides, in get_sweep's order
    steps: int  # the fewest train.steps of any trial
    configs: dict[str, ml_collections.ConfigDict] = dataclasses.field(default_factory=dict)  # trial name -> config


def load_experiment(path: str) -> Experiment:
    """Reads an experiment file: its config and its trials, each a non-empty dict whose overrides
    apply to the config. A problem is a one-line ValueError (FileNotFoundError) naming the file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"experiment file not found: {path}")
    module = _guarded(path, "running the file", lambda: _exec_file(path))
    config_spec, config = _base_config(path, module)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"{path}: define get_sweep() returning a list of override dicts")
    trials = _guarded(path, "get_sweep()", module.get_sweep)
    if not isinstance(trials, (list, tuple)):
        raise ValueError(f"{path}: get_sweep() returned a {type(trials).__name__}, not a list of override dicts "
                         "(e.g. sweep.grid({...}))")
    configs = [_trial_config(path, config, t, i, len(trials)) for i, t in enumerate(trials, 1)]
    names = trial_names(path, trials)
    return Experiment(path, config_spec, names, min(c.train.steps for c in configs), dict(zip(names, configs)))


def _exec_file(path: str):
    spec = importlib.util.spec_from_file_location("_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _guarded(path: str, what: str, fn):
    """fn(), an exception from the experiment's own code turned into one line naming the file."""
    try:
        return fn()
    except Exception as e:
        raise ValueError(f"{path}: {what} raised {type(e).__name__}: {cli.one_line(e)[:300]}") from None


def _base_config(path: str, module) -> tuple[str, ml_collections.ConfigDict]:
    """The experiment's config spec (what its trials' --config get) and the config it loads."""
    if hasattr(module, "get_config"):
        arg = getattr(module, "CONFIG_ARG", "")
        spec, what, load = f"{path}:{arg}", f"get_config({arg!r})", lambda: module.get_config(arg)
    elif hasattr(module, "CONFIG"):
        spec, what, load = module.CONFIG, f"loading CONFIG {module.CONFIG}", lambda: config_lib.load(module.CONFIG)
        if not os.path.exists(spec.partition(":")[0]):
            raise FileNotFoundError(f"{path}: CONFIG names {spec.partition(':')[0]}, which is not "
                                    "there (paths are relative to where the sweep is launched)")
    else:
        raise ValueError(f"{path}: define get_config(arg) or CONFIG = 'configs/FAMILY.py:ARG'")
    config = _guarded(path, what, load)
    if not (isinstance(config, ml_collections.ConfigDict) and "steps" in config.get("train", {})):
        raise ValueError(f"{path}: {what} gave {type(config).__name__}, not a ConfigDict with train.steps")
    return spec, config


def _trial_config(path: str, config, overrides, index: int, count: int):
    """The config with the trial's overrides applied, as its run will load it, and checked as its
    run will check it (sizes that do not fit together fail here, not when the trial starts)."""
    if not (isinstance(overrides, dict) and overrides and all(isinstance(k, str) for k in overrides)):
        raise ValueError(f"{path}: trial {index} of {count} is {overrides!r:.100}, not a non-empty dict "
                         "{'section.key': value}")
    config = copy.deepcopy(config)
    try:
        config_lib.apply_overrides(config, {k: str(v) for k, v in overrides.items()})
        checks.validate(config)
    except cli.CONFIG_ERRORS as e:
        described = ",".join(f"{k}={format_value(v)}" for k, v in overrides.items())
        raise ValueError(f"{path}: trial {index} ({described:.120}): {cli.one_line(e)[:300]}") from None
    return config


MAX_NAME = 200  # characters of a trial's folder name (the filesystem allows 255 bytes)


def format_value(value) -> str:
    """A value as a trial's name spells it: a float in the shortest form that reads back exactly."""
    return float.__repr__(value) if isinstance(value, float) else str(value)


def trial_name(overrides: dict) -> str:
    """{'optim.lr': 0.001, 'model.d_model': 128} -> 'optim.lr=0.001,model.d_model=128' (safe as a
    folder name); a name longer than MAX_NAME is cut and ends in '~' and a hash of the overrides."""
    text = ",".join(f"{k}={format_value(v)}" for k, v in overrides.items())
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    return name if len(name) <= MAX_NAME else _hashed(name, overrides)


def _hashed(name: str, overrides: dict) -> str:
    digest = hashlib.sha1(_canonical(overrides).encode()).hexdigest()[:8]
    return f"{name[:MAX_NAME - 9]}~{digest}"


def _canonical(overrides: dict) -> str:
    return json.dumps(overrides, sort_keys=True, default=repr)


def trial_names(path: str, trials: list[dict]) -> dict[str, dict]:
    """{name: overrides}. Different trials that one name would spell (a folder name replaces
    '/' and spaces) are told apart by a hash of their overrides; the same trial twice is an error."""
    first = {}
    for i, t in enumerate(trials, 1):
        if first.setdefault(_canonical(t), i) != i:
            raise ValueError(f"{path}: get_sweep() lists the same trial twice (trials {first[_canonical(t)]} and "
                             f"{i}: {_canonical(t):.120})")
    counts = Counter(trial_name(t) for t in trials)
    return {trial_name(t) if counts[trial_name(t)] == 1 else _hashed(trial_name(t), t): t for t in trials}


def write_settings(workdir: str, experiment: Experiment, metric: str, mode: str) -> None:
    """Records the sweep in DIR/sweep.json (its trials by name); a ValueError where DIR holds a
    sweep of another config, whose finished trials would be taken for this one's."""
    recorded = report.read_settings(workdir).get("config")
    if recorded not in (None, experiment.config_spec):
        raise ValueError(f"{workdir} holds a sweep of {recorded} (its sweep.json), not of {experiment.config_spec}: "
                         "give a new --workdir")
    with open(os.path.join(workdir, "sweep.json.tmp"), "w") as f:
        json.dump({"experiment": experiment.path, "config": experiment.config_spec, "metric": metric,
                   "mode": mode, "trials": list(experiment.trials)}, f, indent=2)
    os.replace(os.path.join(workdir, "sweep.json.tmp"), os.path.join(workdir, "sweep.json"))


def parse_rungs(text: str, steps: int) -> list[int]:
    """'200,400' -> [200, 400]: increasing steps, each below the trials' train.steps."""
    problem = f"--halving={text!r}: give increasing steps from 1 to {steps - 1} (train.steps={steps}), e.g. 200,400"
    try:
        rungs = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(problem) from None
    if any(b <= a for a, b in zip([0, *rungs], [*rungs, steps])):
        raise ValueError(problem)
    return rungs


def halve(scores: dict[str, float | None], mode: str) -> list[str]:
    """The better half (rounded up) of the trials with a score, best first (lowest for mode 'min');
    a NaN score ranks last, and a trial without one (it failed) drops out."""
    ranked = sorted((name for name, score in scores.items() if score is not None),
                    key=lambda name: (math.isnan(scores[name]), scores[name] if mode == "min" else -scores[name]))
    return ranked[:math.ceil(len(ranked) / 2)]


def run_halving(experiment: Experiment, workdir: str, parallel: int, launcher, rungs: list[int], metric: str,
                mode: str, on_change=None) -> dict[str, str]:
    """Successive halving: all trials run to the first rung (a step), the better half by `metric`
    at that step (`halve`) goes on to the next rung, and so on; the last half runs to the end."""
    survivors = dict(experiment.trials)
    for rung in rungs:
        launch.run_trials(dataclasses.replace(experiment, trials=survivors), workdir, parallel, launcher,
                          on_change, stop_at=rung)
        scores = {name: report.metric_at(report.trial_dir(workdir, name), metric, rung) for name in survivors}
        keep = halve(scores, mode)
        for name in survivors:
            if name not in keep and scores[name] is not None:
                _stop(report.trial_dir(workdir, name), f"stopped at step {rung}: {metric} {scores[name]:.4g} "
                      "in the worse half")
        tqdm.write(f"rung {rung}: {len(keep)} of {len(survivors)} trials go on")
        survivors = {name: overrides for name, overrides in survivors.items() if name in keep}
    launch.run_trials(dataclasses.replace(experiment, trials=survivors), workdir, parallel, launcher, on_change)
    return {name: report.trial_status(report.trial_dir(workdir, name))["status"] for name in experiment.trials}


def share_image_indexes(experiment: Experiment, workdir: str) -> None:
    """Trials that train on an image folder read one index of it, made here (images.share_index), instead of
    each scanning the folder; trials whose folder settings differ share per setting."""
    groups = {}
    for name, config in experiment.configs.items():
        d = config.data
        if checks.validate(config) == "image_classification" and images.is_folder_of_files(d.source):
            key = (os.path.abspath(os.path.expanduser(d.source)), d.val_labels, d.test_fraction)
            groups.setdefault(key, (d, []))[1].append(report.trial_dir(workdir, name))
    for data, trial_dirs in groups.values():
        images.share_index(data, workdir, trial_dirs, show=True)


def _stop(trial_dir: str, reason: str) -> None:
    launch.write_status(trial_dir, {**report.trial_status(trial_dir), "status": "stopped", "error": reason})


# CLI -----------------------------------------------------------------------------------


def write_report(workdir: str, metric: str, mode: str) -> list[dict]:
    """report.write, returning its rows; a failure is one warning line and no rows, and the sweep goes on."""
    try:
        return report.write(workdir, metric, mode)
    except Exception as e:
        tqdm.write(f"warning: the results in {workdir} were not rewritten: {type(e).__name__}: "
                   f"{cli.one_line(e)[:300]}", file=sys.stderr)
        return []


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


def prepare(args) -> tuple[Experiment, list[int]]:
    """The experiment and the halving rungs, checked, and the workdir with its sweep.json."""
    if args.parallel < 1:
        raise ValueError(f"--parallel={args.parallel} must be at least 1")
    if args.ray_address and args.backend != "ray":
        raise ValueError("--ray_address needs --backend ray")
    experiment = load_experiment(args.experiment)
    rungs = parse_rungs(args.halving, experiment.steps)
    os.makedirs(args.workdir, exist_ok=True)
    write_settings(args.workdir, experiment, args.metric, args.mode)
    return experiment, rungs


def main(argv) -> None:
    args = flags.FLAGS
    experiment, rungs = prepare(args)
    launcher = launch.Ray(args.ray_address) if args.backend == "ray" else launch.Local()
    parallel = launcher.slots(args.parallel)
    print(f"{len(experiment.trials)} trials of {experiment.config_spec} in {args.workdir}", file=sys.stderr)
    update = lambda: write_report(args.workdir, args.metric, args.mode)
    share_image_indexes(experiment, args.workdir)
    try:
        if rungs:
            statuses = run_halving(experiment, args.workdir, parallel, launcher, rungs, args.metric, args.mode, update)
        else:
            statuses = launch.run_trials(experiment, args.workdir, parallel, launcher, on_change=update)
    except KeyboardInterrupt:
        update()
        raise SystemExit("interrupted: the running trials saved checkpoints; run the same command to go on")
    finally:
        launcher.close()
    print(summary(statuses, update(), args), file=sys.stderr)
    sys.exit(0 if all(status in report.ENDED for status in statuses.values()) else 1)


def summary(statuses: dict[str, str], rows: list[dict], args) -> str:
    """One line: how many trials are done, stopped or not done, and the best."""
    top = report.best(rows, args.metric, args.mode)
    failed = [name for name, status in statuses.items() if status not in report.ENDED]
    stopped = sum(status == "stopped" for status in statuses.values())
    return (f"{len(statuses) - len(failed) - stopped} of {len(statuses)} trials done"
            + (f", {stopped} stopped early" if stopped else "")
            + (f"; not done: {', '.join(failed)}" if failed else "")
            + (f"; best: {top['trial']} ({args.metric} {top[f'best {args.metric}']:.4g})" if top else "")
            + f"; results in {args.workdir}/results.md")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
