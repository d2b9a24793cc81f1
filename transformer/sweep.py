"""Hyperparameter sweeps: an experiment's trials, each run as its own training run.

An experiment file (experiments/NAME.py) names its config, either with its own
`get_config(arg)` or with `CONFIG = 'configs/gpt.py:tiny'`, and lists its trials as override
dicts from `get_sweep()`, built with the helpers here:

    def get_sweep():
        return sweep.grid({"optim.lr": [1e-3, 3e-3], "model.d_model": [128, 192]})

    python -m transformer.sweep --experiment experiments/NAME.py --workdir runs/NAME [--parallel 2]

Each trial runs `python -m transformer.train` (a local process, or a Ray task with
`--backend ray`: see transformer/launch.py) in DIR/trials/NAME_OF_ITS_OVERRIDES, so it can be
inspected, resumed or generated from like any run. Running the same command again skips
finished trials and resumes the others from their checkpoints; a failed trial is recorded
with its error (DIR/trials/*/trial.json) and the others go on. DIR/results.csv and .md are
rewritten as trials end (`python -m transformer.report DIR` rebuilds them any time).
`--halving 200,400` stops the worse half of the trials at each of those steps.
"""

import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import time

import numpy as np
from tqdm import tqdm

from transformer.training import metrics as metrics_lib

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
    trials: list[dict]


def load_experiment(path: str) -> Experiment:
    """Reads an experiment file: its config and its trials (checked to be distinct, non-empty dicts)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"experiment file not found: {path}")
    spec = importlib.util.spec_from_file_location("_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "get_config"):
        config_spec = path + (f":{module.CONFIG_ARG}" if getattr(module, "CONFIG_ARG", "") else "")
    elif hasattr(module, "CONFIG"):
        config_spec = module.CONFIG
        if not os.path.exists(config_spec.partition(":")[0]):
            raise FileNotFoundError(f"{path}: CONFIG names {config_spec.partition(':')[0]}, which is not "
                                    "there (paths are relative to where the sweep is launched)")
    else:
        raise ValueError(f"{path}: define get_config(arg) or CONFIG = 'configs/FAMILY.py:ARG'")
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"{path}: define get_sweep() returning a list of override dicts")
    trials = list(module.get_sweep())
    names = [trial_name(t) for t in trials]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: get_sweep() lists the same trial twice")
    return Experiment(path, config_spec, trials)


def format_value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def trial_name(overrides: dict) -> str:
    """{'optim.lr': 0.001, 'model.d_model': 128} -> 'optim.lr=0.001,model.d_model=128' (safe as a folder name)."""
    if not overrides:
        return "default"
    text = ",".join(f"{k}={format_value(v)}" for k, v in overrides.items())
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def trial_status(trial_dir: str) -> dict:
    """The trial's record (trial.json): status pending | running | paused | done | failed | stopped
    (by successive halving), error, wall_s."""
    path = os.path.join(trial_dir, "trial.json")
    if not os.path.exists(path):
        return {"status": "pending"}
    with open(path) as f:
        return json.load(f)


def write_status(trial_dir: str, record: dict) -> None:
    with open(os.path.join(trial_dir, "trial.json.tmp"), "w") as f:
        json.dump(record, f, indent=2)
    os.replace(os.path.join(trial_dir, "trial.json.tmp"), os.path.join(trial_dir, "trial.json"))


def write_settings(workdir: str, experiment: Experiment, metric: str, mode: str) -> None:
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
        json.dump({"experiment": experiment.path, "config": experiment.config_spec, "metric": metric,
                   "mode": mode, "trials": len(experiment.trials)}, f, indent=2)


def read_settings(workdir: str) -> dict:
    """The sweep's settings (sweep.json), or the defaults."""
    path = os.path.join(workdir, "sweep.json")
    if not os.path.exists(path):
        return {"metric": "eval/loss", "mode": "min"}
    with open(path) as f:
        return json.load(f)


ENDED = ("done", "stopped")


def run_halving(experiment: Experiment, workdir: str, parallel: int, launcher, rungs: list[int], metric: str,
                mode: str, on_change=None) -> dict[str, str]:
    """Successive halving: all trials run to the first rung (a step), the better half by `metric`
    at that step goes on to the next rung, and so on; the last half runs to the end."""
    survivors = list(experiment.trials)
    for rung in rungs:
        run_trials(dataclasses.replace(experiment, trials=survivors), workdir, parallel, launcher, on_change,
                   stop_at=rung)
        scores = {trial_name(t): metric_at(os.path.join(workdir, "trials", trial_name(t)), metric, rung)
                  for t in survivors}
        ranked = sorted((t for t in survivors if scores[trial_name(t)] is not None),
                        key=lambda t: scores[trial_name(t)], reverse=mode == "max")
        keep = ranked[:max(1, math.ceil(len(ranked) / 2))]
        for t in ranked[len(keep):]:
            trial_dir = os.path.join(workdir, "trials", trial_name(t))
            write_status(trial_dir, {**trial_status(trial_dir), "status": "stopped",
                                     "error": f"stopped at step {rung}: {metric} {scores[trial_name(t)]:.4g} "
                                              "in the worse half"})
        tqdm.write(f"rung {rung}: {len(keep)} of {len(survivors)} trials go on")
        survivors = keep
    run_trials(dataclasses.replace(experiment, trials=survivors), workdir, parallel, launcher, on_change)
    return {trial_name(t): trial_status(os.path.join(workdir, "trials", trial_name(t)))["status"]
            for t in experiment.trials}


def records_of(trial_dir: str) -> list[dict]:
    """The trial's logged metrics (none before its first log)."""
    path = os.path.join(trial_dir, "metrics.jsonl")
    return metrics_lib.read(path) if os.path.exists(path) else []


def metric_at(trial_dir: str, metric: str, step: int) -> float | None:
    values = [r[metric] for r in records_of(trial_dir) if r["step"] == step and metric in r]
    return values[-1] if values else None


# Local backend -------------------------------------------------------------------------


def trial_command(experiment: Experiment, overrides: dict, trial_dir: str) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    return [sys.executable, "-m", "transformer.train", "--config", experiment.config_spec,
            "--workdir", trial_dir, *flags]


@dataclasses.dataclass
class Running:
    name: str
    trial_dir: str
    process: object  # subprocess.Popen, or launch.RayTrial
    slot: int
    started: float
    bar: object


def run_trials(experiment: Experiment, workdir: str, parallel: int, launcher, on_change=None,
               stop_at: int = 0) -> dict[str, str]:
    """Runs the unfinished trials through `launcher` (see transformer.launch), `parallel` at a
    time, each up to step `stop_at` if given; returns {trial name: final status}."""
    pending, statuses = [], {}
    for overrides in experiment.trials:
        trial_dir = os.path.join(workdir, "trials", trial_name(overrides))
        os.makedirs(trial_dir, exist_ok=True)
        statuses[trial_name(overrides)] = trial_status(trial_dir)["status"]
        if statuses[trial_name(overrides)] not in ENDED:
            pending.append((overrides, trial_dir))
    extra = {"train.stop_at": stop_at} if stop_at else {}
    overall = tqdm(total=len(experiment.trials), initial=len(experiment.trials) - len(pending), desc="trials",
                   position=0, dynamic_ncols=True)
    running, free = [], list(range(parallel))
    try:
        while pending or running:
            while pending and free:
                running.append(_start(experiment, *pending.pop(0), free.pop(0), launcher, extra))
            time.sleep(1.0)
            for r in list(running):
                _show_progress(r)
                if r.process.poll() is not None:
                    statuses[r.name] = _finish(r)
                    running.remove(r)
                    free.append(r.slot)
                    overall.update(1)
                    if on_change:
                        on_change()
    finally:
        for r in running:
            r.process.terminate()
        for r in running:
            r.process.wait()
            _finish(r)
        overall.close()
    return statuses


def _start(experiment: Experiment, overrides: dict, trial_dir: str, slot: int, launcher, extra: dict) -> Running:
    name = os.path.basename(trial_dir)
    _wait_for_orphan(trial_dir)
    process = launcher.start(trial_command(experiment, {**overrides, **extra}, trial_dir),
                             os.path.join(trial_dir, "trial.log"), slot)
    write_status(trial_dir, {"status": "running", "overrides": overrides, "pid": getattr(process, "pid", None),
                             "wall_s": trial_status(trial_dir).get("wall_s", 0.0)})
    bar = tqdm(desc=f"{name}: starting", position=slot + 1, leave=False, dynamic_ncols=True, bar_format="{desc}")
    return Running(name, trial_dir, process, slot, time.time(), bar)


def _wait_for_orphan(trial_dir: str, timeout_s: float = 300.0) -> None:
    """Waits while a local process of a killed sweep still runs this trial (it is saving a checkpoint)."""
    pid, deadline = trial_status(trial_dir).get("pid"), time.time() + timeout_s
    while pid and time.time() < deadline and _alive(pid):
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _show_progress(r: Running) -> None:
    records = [x for x in records_of(r.trial_dir) if "train/loss" in x]
    if records:
        r.bar.set_description_str(f"{r.name}: step {records[-1]['step']}, loss {records[-1]['train/loss']:.4f}")


def _finish(r: Running) -> str:
    """Records how the trial ended: done (all its steps), failed (with its error), or paused
    (interrupted, or at a rung of successive halving)."""
    trial_dir = r.trial_dir
    previous = trial_status(trial_dir)
    ok = r.process.returncode == 0
    record = {"status": "done" if ok and reached_end(trial_dir) else "failed" if not ok else "paused",
              "overrides": previous["overrides"], "wall_s": previous.get("wall_s", 0.0) + time.time() - r.started}
    if not ok:
        record["error"] = _last_error(os.path.join(trial_dir, "trial.log"), r.process.returncode)
        tqdm.write(f"trial {r.name} failed: {record['error']}")
    write_status(trial_dir, record)
    r.bar.close()
    return record["status"]


def reached_end(trial_dir: str) -> bool:
    """Whether the run logged its last step (config.train.steps)."""
    records = records_of(trial_dir)
    if not records:
        return False
    with open(os.path.join(trial_dir, "config.json")) as f:
        steps = json.load(f)["train"]["steps"]
    return any(r["step"] >= steps for r in records)


def _last_error(log_path: str, returncode: int) -> str:
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f.read().splitlines()[-200:] if line.strip()]
    errors = [line for line in lines if line.startswith("error") or "Error" in line]
    return (errors or lines or [f"exit code {returncode}"])[-1][:500]


# CLI -----------------------------------------------------------------------------------


def main() -> None:
    import argparse

    from transformer import launch, report

    p = argparse.ArgumentParser(description="Run an experiment's sweep of trials.")
    p.add_argument("--experiment", required=True, help="experiments/NAME.py (get_config or CONFIG, get_sweep)")
    p.add_argument("--workdir", required=True, help="the sweep's directory: trials/, results.csv/md, plots")
    p.add_argument("--parallel", type=int, default=1, help="trials at once (one GPU each where there are GPUs)")
    p.add_argument("--backend", default="local", choices=sorted(launch.BACKENDS),
                   help="where trials run: local processes or Ray tasks")
    p.add_argument("--ray_address", default="", help="the Ray cluster (default: a local Ray instance)")
    p.add_argument("--halving", default="", help="successive halving rungs, in steps (e.g. 200,400): at each, "
                   "the worse half of the trials by --metric stops")
    p.add_argument("--metric", default="eval/loss", help="what picks the best trial (and halves the trials)")
    p.add_argument("--mode", default="min", choices=("min", "max"))
    args = p.parse_args()
    try:
        experiment = load_experiment(args.experiment)
    except (ValueError, FileNotFoundError, SyntaxError) as e:
        raise SystemExit(f"error: {e}") from None
    if args.parallel < 1:
        raise SystemExit(f"error: --parallel={args.parallel} must be at least 1")
    try:
        rungs = [int(r) for r in args.halving.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"error: --halving={args.halving!r}: give increasing steps, e.g. 200,400") from None
    if rungs != sorted(set(rungs)) or any(r <= 0 for r in rungs):
        raise SystemExit(f"error: --halving={args.halving!r}: give increasing positive steps, e.g. 200,400")
    os.makedirs(args.workdir, exist_ok=True)
    write_settings(args.workdir, experiment, args.metric, args.mode)
    print(f"{len(experiment.trials)} trials of {experiment.config_spec} in {args.workdir}", file=sys.stderr)
    update = lambda: report.write(args.workdir, args.metric, args.mode)
    if args.ray_address and args.backend != "ray":
        raise SystemExit("error: --ray_address needs --backend ray")
    launcher = launch.Ray(args.ray_address) if args.backend == "ray" else launch.Local()
    try:
        if rungs:
            statuses = run_halving(experiment, args.workdir, args.parallel, launcher, rungs, args.metric,
                                   args.mode, update)
        else:
            statuses = run_trials(experiment, args.workdir, args.parallel, launcher, on_change=update)
    except KeyboardInterrupt:
        update()
        raise SystemExit("interrupted: the running trials saved checkpoints; run the same command to go on")
    finally:
        launcher.close()
    rows = update()
    top = report.best(rows, args.metric, args.mode)
    failed = [name for name, status in statuses.items() if status not in ENDED]
    stopped = sum(status == "stopped" for status in statuses.values())
    print(f"{len(statuses) - len(failed) - stopped} of {len(statuses)} trials done"
          + (f", {stopped} stopped early" if stopped else "")
          + (f"; not done: {', '.join(failed)}" if failed else "")
          + (f"; best: {top['trial']} ({args.metric} {top[f'best {args.metric}']:.4g})"
             if top else "") + f"; results in {args.workdir}/results.md", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
