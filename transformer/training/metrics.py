"""Run metrics: JSON lines in WORKDIR/metrics.jsonl and TensorBoard events in WORKDIR/tb."""

import json
import math
import os

from tensorboardX import SummaryWriter


class MetricWriter:
    """Writes {'step': s, 'train/loss': ...} records; only the process that `enabled`."""

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if enabled:
            truncate_after(self.path, resume_step)
            self.tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in metrics.items():
            if math.isfinite(float(value)):
                self.tb.add_scalar(key, float(value), step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def truncate_after(path: str, step: int) -> None:
    """Drops records past `step`: a resumed run rewrites them."""
    if not os.path.exists(path):
        return
    records = read(path)
    with open(path, "w") as f:
        for r in records:
            if r["step"] <= step:
                f.write(json.dumps(r) + "\n")


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
