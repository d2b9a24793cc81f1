"""Run metrics: JSON lines in WORKDIR/metrics.jsonl (the scalars), and the trackers of config.train.trackers
(TensorBoard events in WORKDIR/tb by default; Weights & Biases, Trackio: training/trackers.py) with the scalars,
the arrays, such as the experts' loads, as histograms, and the run's figures.

A logged train metric is the mean of its values over the steps since the last log (`over_steps`), but a
count, named `..._since_last_log` (`train/replaced_images_since_last_log`), is their sum, and a loss term
(`train/loss`, `train/mlm_loss`, ...) is weighted by its items: the interval's summed per-item losses over
its items (masked tokens, target tokens, rows), as `eval/loss` is over the eval set's.
"""

import json
import os
import re

import numpy as np

from transformer.training import trackers as trackers_lib

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
    """Writes {'step': s, 'train/loss': ...} records to metrics.jsonl and the `trackers` (trackers.start's);
    only the process that is `enabled`. A tracker that fails is dropped, said in one line by `say`."""

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0, trackers=(), say=print):
        self.enabled, self.trackers, self.say = enabled, list(trackers) if enabled else [], say
        self.drawn = set()  # the figures given to the trackers
        self.path = os.path.join(workdir, "metrics.jsonl")
        if enabled:
            truncate_after(self.path, resume_step)

    def write(self, step: int, metrics: dict, histograms: dict | None = None) -> None:
        """Scalar `metrics` to all; `histograms` {name: array} to the trackers alone (the values' spread)."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step"}
        self._each(lambda t: t.log(int(step), scalars, histograms or {}))

    def figure(self, step: int, name: str, path: str) -> None:
        """A figure the run drew (a PNG at `path`) to the trackers, as `name`."""
        self._each(lambda t: t.figure(int(step), name, path))

    def figures(self, step: int, folder: str) -> None:
        """The PNGs in `folder` not given before to the trackers, each named after its folder and file less a
        trailing -STEP (samples/completions-400.png: 'samples/completions')."""
        if not (self.trackers and os.path.isdir(folder)):
            return
        for name in sorted(set(os.listdir(folder)) - self.drawn):
            if name.endswith(".png"):
                self.figure(step, f"{os.path.basename(folder)}/{re.sub(r'-[0-9]+$', '', name[:-4])}",
                            os.path.join(folder, name))
            self.drawn.add(name)

    def _each(self, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 (a tracker's failure leaves the run to the others)
                self.trackers.remove(tracker)
                name = type(tracker).__name__.lower()
                self.say(f"config.train.trackers: {name} failed ({trackers_lib.describe(e)}); "
                         "the run goes on without it")

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


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
