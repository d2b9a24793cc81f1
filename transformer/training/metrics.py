"""Run metrics: JSON lines in WORKDIR/metrics.jsonl and TensorBoard events in WORKDIR/tb (the scalars in
both; arrays, such as the experts' loads, as TensorBoard histograms).

A logged train metric is the mean of its values over the steps since the last log (`over_steps`), but a
count, named `..._since_last_log` (`train/replaced_images_since_last_log`), is their sum, and a loss term
(`train/loss`, `train/mlm_loss`, ...) is weighted by its items: the interval's summed per-item losses over
its items (masked tokens, target tokens, rows), as `eval/loss` is over the eval set's.
"""

import json
import math
import os
import sys

import numpy as np


def summary_writer(logdir: str):
    """tensorboardX's SummaryWriter at `logdir`. tensorboardX's import tries `import torch` (seconds of every
    launch) only to accept torch tensors, which this module never gives it: unless torch is loaded already,
    that import is answered 'not installed'."""
    answered = "tensorboardX" not in sys.modules and "torch" not in sys.modules
    if answered:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if answered:
            del sys.modules["torch"]
    return SummaryWriter(logdir)


COUNT_SUFFIX = "_since_last_log"
ITEMS = "items/"  # a step's metric ITEMS + term: how many items the loss term's mean is over (not logged)


def over_steps(steps: list[dict]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """The train metrics of the steps since the last log ({'loss': value, 'items/loss': count} per step)
    as one record {'train/loss': ...}: means, sums of the counts (names ending in COUNT_SUFFIX), and for
    each loss term with its items the mean weighted by them (`loss` of several terms: the sum of the terms
    so weighted, plus the mean of any part no term names); and apart, the mean of each array-valued
    metric (the experts' loads [layers, E]), for histograms."""
    series = lambda key: np.array([m[key] for m in steps], np.float64)
    items = {k.removeprefix(ITEMS): series(k) for k in steps[0] if k.startswith(ITEMS)}

    def weighted(key: str) -> float:
        weights, total = items[key], items[key].sum()
        return float((series(key) * weights).sum() / total) if total > 0 else float(series(key).mean())

    def combined(key: str) -> float:
        if key in items:
            return weighted(key)
        if key == "loss" and items:
            unnamed = series("loss") - sum(series(term) for term in items)
            return float(unnamed.mean()) + sum(weighted(term) for term in items)
        return float(np.sum(series(key)) if key.endswith(COUNT_SUFFIX) else np.mean(series(key)))

    arrays = {f"train/{k}": np.mean([m[k] for m in steps], axis=0) for k in steps[0] if np.ndim(steps[0][k])}
    scalars = {f"train/{k}": combined(k) for k in steps[0] if np.ndim(steps[0][k]) == 0 and not k.startswith(ITEMS)}
    return scalars, arrays


class MetricWriter:
    """Writes {'step': s, 'train/loss': ...} records; only the process that `enabled`."""

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if enabled:
            truncate_after(self.path, resume_step)
            self.tb = summary_writer(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: dict, histograms: dict | None = None) -> None:
        """Scalar `metrics` to both; `histograms` {name: array} to TensorBoard alone (the values' spread)."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in metrics.items():
            if math.isfinite(float(value)):
                self.tb.add_scalar(key, float(value), step)
        for key, values in (histograms or {}).items():
            self.tb.add_histogram(key, np.asarray(values, np.float64).ravel(), step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def truncate_after(path: str, step: int) -> None:
    """Drops records past `step`: a resumed run rewrites them. The file is replaced whole, so a
    reader (a sweep watching the run) sees the old records or the new ones, never a part."""
    if not os.path.exists(path):
        return
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in read(path) if r["step"] <= step)
    os.replace(path + ".tmp", path)


def read(path: str) -> list[dict]:
    """The records. A last line that does not parse is left out: a write cut short (a killed run)
    or still under way; a bad line before it is a ValueError naming it."""
    with open(path) as f:
        lines = [(number, line) for number, line in enumerate(f.read().splitlines(), 1) if line.strip()]
    records = []
    for number, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != lines[-1][0]:
                raise ValueError(f"{path}, line {number}: not a JSON record: {line[:80]!r}") from None
    return records
