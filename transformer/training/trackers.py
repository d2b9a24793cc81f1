"""Where a run's metrics go besides WORKDIR/metrics.jsonl (always written: sweeps, reports and resumes read it):
`config.train.trackers`, a comma-separated list of

  tensorboard   TensorBoard events in WORKDIR/tb (the default)
  wandb         Weights & Biases (`pip install wandb`); WANDB_MODE=offline writes WORKDIR/wandb/ without a
                network (`wandb sync` uploads it later)
  trackio       Trackio (`pip install trackio`): a local-first SQLite store in TRACKIO_DIR (default
                ~/.cache/huggingface/trackio), its dashboard `trackio show`

Each gets the run's config once, every record the run writes (train/*, eval/*, the harness's scores), the
arrays as histograms and the figures the run draws (`MetricWriter.figure`). Runs are named after their
workdir, in the project `train.tracker_project`; the trials of a sweep share the group
`train.tracker_group` (the sweep sets it to its workdir's name). A resumed run goes on in the same wandb
and trackio run (their ids kept in WORKDIR/trackers.json). A tracker that cannot start (not installed, no
login) says so in one line and the run goes on with the others; one that fails later is dropped the same way.
"""

import json
import os
import re
import sys
import uuid

import numpy as np

NAMES = ("tensorboard", "wandb", "trackio")
IDS = "trackers.json"
NAMED = ("wandb", "trackio")  # the trackers whose runs have ids


def parse(text: str) -> list[str]:
    """'tensorboard,wandb' -> ['tensorboard', 'wandb'] (in a config file's arg, bracketed: '(tensorboard,wandb)');
    an unknown name is a ValueError naming the key."""
    names = [n for n in re.split(r"[\s,()\[\]'\"]+", text) if n]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"config.train.trackers={text!r}: unknown {', '.join(unknown)} (choose from "
                         f"{', '.join(NAMES)}, comma-separated; '' for metrics.jsonl alone)")
    return list(dict.fromkeys(names))


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


def project(config) -> str:
    return config.train.get("tracker_project", "transformer")


class TensorBoard:
    def __init__(self, workdir: str, config, run_id: str):
        self.writer = summary_writer(os.path.join(workdir, "tb"))

    def log(self, step: int, scalars: dict, histograms: dict) -> None:
        for key, value in scalars.items():
            if np.isfinite(value):
                self.writer.add_scalar(key, value, step)
        for key, values in histograms.items():
            self.writer.add_histogram(key, np.asarray(values, np.float64).ravel(), step)
        self.writer.flush()

    def figure(self, step: int, name: str, path: str) -> None:
        import matplotlib.image

        self.writer.add_image(name, matplotlib.image.imread(path)[..., :3], step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, workdir: str, config, run_id: str):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project(config), group=config.train.get("tracker_group") or None,
                              name=os.path.basename(os.path.abspath(workdir)), dir=workdir, id=run_id,
                              resume="allow", config=config.to_dict())

    def log(self, step: int, scalars: dict, histograms: dict) -> None:
        self.run.log({**scalars, **{k: self.wandb.Histogram(np.ravel(v)) for k, v in histograms.items()}}, step=step)

    def figure(self, step: int, name: str, path: str) -> None:
        self.run.log({name: self.wandb.Image(path)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, workdir: str, config, run_id: str):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project(config), group=config.train.get("tracker_group") or None,
                                name=f"{os.path.basename(os.path.abspath(workdir))}-{run_id}", resume="allow",
                                config=config.to_dict(), embed=False)

    def log(self, step: int, scalars: dict, histograms: dict) -> None:
        histograms = {k: self.trackio.Histogram(np.ravel(v)) for k, v in histograms.items()}
        self.run.log(metrics={**scalars, **histograms}, step=step)

    def figure(self, step: int, name: str, path: str) -> None:
        self.run.log(metrics={name: self.trackio.Image(path)}, step=step)

    def close(self) -> None:
        self.run.finish()


def describe(e: BaseException) -> str:
    """An exception in one short line: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


KINDS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}


def run_ids(workdir: str, names: list[str], resumed: bool) -> dict[str, str]:
    """Each tracker's run id: the one kept in WORKDIR/trackers.json for a resumed run, else a new one (kept)."""
    path = os.path.join(workdir, IDS)
    kept = {}
    if resumed and os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
    ids = {name: kept.get(name) or uuid.uuid4().hex[:8] for name in names if name in NAMED}
    if ids and ids != kept:
        with open(path, "w") as f:
            json.dump(ids, f)
    return ids


def start(config, workdir: str, resumed: bool, say=print) -> list:
    """The trackers of `config.train.trackers` that start; each that does not is said in one line."""
    names = parse(config.train.get("trackers", "tensorboard"))
    ids = run_ids(workdir, names, resumed)
    started = []
    for name in names:
        try:
            started.append(KINDS[name](workdir, config, ids.get(name, "")))
        except Exception as e:  # noqa: BLE001 (any failure of a tracker's start leaves the run to the others)
            say(f"config.train.trackers: {name} did not start ({describe(e)}); the run goes on without it")
    return started
