"""A run that diverges: it stops before a checkpoint of non-finite parameters is written, and says where the
divergence began and which kept checkpoint to relaunch from.

A finite checkpoint taken after a divergence began is already ruined, so the start is looked for in the logged
train/loss of metrics.jsonl: a loss spike, a logged loss far above the running mean of those before it (more
than SPREADS times their mean absolute deviation and SHARE of the mean's size), begins a divergence; a later
loss back within that bound ends it. The message names every kept checkpoint with its loss and advises the
latest one before the spike:

    python -m transformer.train --workdir DIR --resume_step 200 --config.optim.lr=1e-4
"""

import math
import os
from typing import NoReturn

import numpy as np

from transformer.training import metrics as metrics_lib

WINDOW = 20     # the logged losses before a step that its running mean is taken over
LEAST = 5       # logged losses needed before a spike can be told
SPREADS = 6.0   # a spike is above the running mean by this many mean absolute deviations
SHARE = 0.25    # and by this share of the running mean's size


class NonFiniteLoss(RuntimeError):
    pass


def losses(workdir: str) -> list[tuple[int, float]]:
    """(step, train/loss) of each logged step in WORKDIR/metrics.jsonl (none where it has none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    return [(r["step"], r["train/loss"]) for r in metrics_lib.read(path) if "train/loss" in r]


def spike_start(history: list[tuple[int, float]]) -> tuple[int, float, float] | None:
    """(step, loss, running mean) of the spike that began the divergence still under way at the end of
    `history` ((step, loss) in step order), or None where the last losses are within their running bound."""
    normal, start = [], None
    for step, loss in history:
        recent = normal[-WINDOW:]
        mean = float(np.mean(recent)) if recent else 0.0
        bound = max(SPREADS * float(np.mean(np.abs(np.subtract(recent, mean)))) if recent else 0.0,
                    SHARE * abs(mean), 1e-6)
        if len(recent) >= LEAST and (not math.isfinite(loss) or loss > mean + bound):
            start = start or (step, loss, mean)
            continue
        normal.append(loss)
        start = None
    return start


def advice(workdir: str, kept: list[int]) -> str:
    """Where the divergence began, the kept checkpoints with their losses, and the one to relaunch from."""
    history = losses(workdir)
    logged = dict(history)
    spike = spike_start(history)
    named = ", ".join(f"{s}" + (f" (loss {logged[s]:.4g})" if s in logged else "") for s in kept)
    said = [f"kept checkpoints: {named}"] if kept else ["no checkpoint was written"]
    if spike is not None:
        said.insert(0, f"the loss spiked at step {spike[0]} ({spike[1]:.4g} against a running mean of "
                       f"{spike[2]:.4g}): the divergence began there")
    before = [s for s in kept if spike is None or s < spike[0]]
    if before:
        resume = "" if before[-1] == max(kept) else f" --resume_step {before[-1]}"
        said.append(f"relaunch from step {before[-1]} with a lower config.optim.lr (python -m transformer.train "
                    f"--workdir {workdir}{resume}), or check the data")
    else:
        said.append("no kept checkpoint precedes it: start again in a new --workdir with a lower config.optim.lr, "
                    "or check the data")
    return "; ".join(said)


def stop(what: str, workdir: str, kept: list[int]) -> NoReturn:
    """Raises NonFiniteLoss: `what` went non-finite ('non-finite loss at step 30'), nothing saved, and the
    `advice` of the run in `workdir`, whose checkpoints `kept` are."""
    raise NonFiniteLoss(f"{what}; stopped without saving: {advice(workdir, sorted(kept))}")


def check_finite(metrics: dict, step: int, workdir: str, kept: list[int]) -> None:
    """Stops before a checkpoint of non-finite parameters (the step's new param_norm) or loss is written."""
    bad = [k for k in ("loss", "param_norm") if k in metrics and not math.isfinite(float(metrics[k]))]
    if bad:
        stop(f"non-finite {' and '.join(bad)} at step {step}", workdir, kept)
