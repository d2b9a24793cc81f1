"""Hyperparameter sweeps. An experiment file builds its trials with the helpers here:

    from transformer import sweep

    def get_sweep():
        return sweep.grid({"optim.lr": [1e-3, 3e-3], "model.d_model": [128, 192]})

and `python -m transformer.sweep --experiment experiments/NAME.py --workdir runs/NAME` runs them
(__main__.py's docstring is the command's manual). The package:

  experiments.py  an experiment file read into its config and its named, checked trials; DIR/sweep.json
  launch.py       each trial as its own training process (local, or a Ray task), locked, its status recorded
  halving.py      successive halving: rungs, the better half, the trials run rung by rung
  results.py      the trials' records, the results table and plots (`python -m transformer.report`)
  __main__.py     the command: flags and main
"""

import itertools
import math

import numpy as np


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
