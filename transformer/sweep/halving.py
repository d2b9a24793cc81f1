"""Successive halving: every trial runs to the first rung (a step), the better half by the metric goes
on to the next rung, and so on; the last half runs to the end."""

import dataclasses
import math

from tqdm import tqdm

from transformer.sweep import experiments, launch, results


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


def run_halving(experiment: experiments.Experiment, workdir: str, parallel: int, launcher, rungs: list[int],
                metric: str, mode: str, on_change=None) -> dict[str, str]:
    """The trials run rung by rung, the better half by `metric` at each rung (`halve`) going on;
    returns {trial name: final status}."""
    survivors = dict(experiment.trials)
    for rung in rungs:
        launch.run_trials(dataclasses.replace(experiment, trials=survivors), workdir, parallel, launcher,
                          on_change, stop_at=rung)
        scores = {name: results.metric_at(results.trial_dir(workdir, name), metric, rung) for name in survivors}
        keep = halve(scores, mode)
        for name in survivors:
            if name not in keep and scores[name] is not None:
                _stop(results.trial_dir(workdir, name), f"stopped at step {rung}: {metric} {scores[name]:.4g} "
                      "in the worse half")
        tqdm.write(f"rung {rung}: {len(keep)} of {len(survivors)} trials go on")
        survivors = {name: overrides for name, overrides in survivors.items() if name in keep}
    launch.run_trials(dataclasses.replace(experiment, trials=survivors), workdir, parallel, launcher, on_change)
    return {name: results.trial_status(results.trial_dir(workdir, name))["status"] for name in experiment.trials}


def _stop(trial_dir: str, reason: str) -> None:
    launch.write_status(trial_dir, {**results.trial_status(trial_dir), "status": "stopped", "error": reason})
