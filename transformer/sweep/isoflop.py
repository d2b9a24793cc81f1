"""An IsoFLOP sweep laid out: for each compute budget, each model size trained for the steps that spend it.

    from transformer.sweep import isoflop

    def get_sweep():
        return isoflop.grid(CONFIG, budgets=[1e11, 3e11], sizes=[{"model.d_model": 32}, {"model.d_model": 64}],
                            extra=lambda steps: {"optim.warmup_steps": max(1, steps // 20)})

A trial's compute is the model's own training FLOPs (models/flops.py: 3 x the forward pass, per example, x
data.batch_size) times its steps, so `train.steps` = budget / FLOPs per step, rounded (a trial's actual
compute is within half a step of its budget). `extra(steps)` adds overrides that follow the run's length
(the warmup, the eval interval). The fits over such a sweep: transformer/sweep/scaling_laws.py.
"""

import copy

from transformer import config as config_lib
from transformer.models import flops
from transformer.training import shapes


def config_of(config):
    """A ConfigDict, or the one a spec ('configs/gpt.py:tiny,...') loads."""
    return config_lib.load(config) if isinstance(config, str) else config


def step_flops(config, size: dict) -> float:
    """Training FLOPs of one step of `config` with the overrides `size` (the keys it leaves to the data filled in
    from the data, as the run will)."""
    config = copy.deepcopy(config)
    config_lib.apply_overrides(config, {k: str(v) for k, v in size.items()})
    return flops.training_flops(shapes.resolved(config))


def grid(config, budgets: list[float], sizes: list[dict], extra=None, min_steps: int = 1) -> list[dict]:
    """One trial per (budget, size): the size's overrides, `train.steps` that spend the budget, and `extra(steps)`
    where given. A size that would train fewer than `min_steps` steps at a budget is left out of it; a grid left
    with no trial at a budget is a ValueError naming it."""
    config = config_of(config)
    per_step = [step_flops(config, size) for size in sizes]
    trials = []
    for budget in budgets:
        row = [(size, round(budget / cost)) for size, cost in zip(sizes, per_step) if round(budget / cost) >= min_steps]
        if not row:
            raise ValueError(f"isoflop.grid: no size trains {min_steps} or more steps at budget {budget:.3g} "
                             "(raise the budget or add a smaller size)")
        trials += [{**size, "train.steps": steps, **(extra(steps) if extra else {})} for size, steps in row]
    return trials
