"""Results of a sweep: its trials' records, a table of them, the best one, and plots
(`python -m transformer.report DIR` writes them). Reads DIR/trials/*/ (trial.json, metrics.jsonl) of the
trials DIR/sweep.json lists (every folder in DIR/trials for a sweep.json without the list) and writes
  DIR/results.csv   one row per trial: its overrides, status, last step, final and best
                    metrics, wall time and error
  DIR/results.md    the same table, the best trial named
  DIR/metric.png    the metric against each swept value
  DIR/curves.png    every trial's train and eval loss curves
It runs any time, during the sweep too (the sweep calls it as trials end); the metric that
picks the best trial defaults to the sweep's own (DIR/sweep.json).
"""

import csv
import glob
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from transformer.training import metrics as metrics_lib  # noqa: E402

METRICS = ("train/loss", "eval/loss")
ENDED = ("done", "stopped")

# A sweep's records ---------------------------------------------------------------------


def trial_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, "trials", name)


def trial_status(trial_dir: str) -> dict:
    """The trial's record (trial.json): status pending | running | paused | done | failed | stopped
    (by successive halving), overrides, error, wall_s (over all its launches), started and ended
    (the unix times of its last launch)."""
    path = os.path.join(trial_dir, "trial.json")
    if not os.path.exists(path):
        return {"status": "pending"}
    with open(path) as f:
        return json.load(f)


def records_of(trial_dir: str) -> list[dict]:
    """The trial's logged metrics (none before its first log)."""
    path = os.path.join(trial_dir, "metrics.jsonl")
    return metrics_lib.read(path) if os.path.exists(path) else []


def metric_at(trial_dir: str, metric: str, step: int) -> float | None:
    values = [r[metric] for r in records_of(trial_dir) if r["step"] == step and metric in r]
    return values[-1] if values else None


def read_settings(workdir: str) -> dict:
    """The sweep's settings (sweep.json), or the defaults."""
    path = os.path.join(workdir, "sweep.json")
    if not os.path.exists(path):
        return {"metric": "eval/loss", "mode": "min"}
    with open(path) as f:
        return json.load(f)


def trial_names(workdir: str) -> list[str]:
    """The sweep's trials, in name order: those its sweep.json lists, not other folders left in
    DIR/trials by an earlier get_sweep."""
    listed = read_settings(workdir).get("trials")
    if isinstance(listed, list):
        return sorted(listed)
    return sorted(os.path.basename(d) for d in glob.glob(trial_dir(workdir, "*")))


# Tables and plots ----------------------------------------------------------------------


def collect(workdir: str, metric: str = "eval/loss", mode: str = "min") -> list[dict]:
    """One row per trial of the sweep, in name order."""
    rows = []
    for name in trial_names(workdir):
        status = trial_status(trial_dir(workdir, name))
        records = records_of(trial_dir(workdir, name))
        row = {"trial": name, **status.get("overrides", {}), "status": status["status"],
               "steps": max((r["step"] for r in records), default=0)}
        for key in dict.fromkeys((*METRICS, metric)):
            values = [r[key] for r in records if key in r and math.isfinite(r[key])]
            better = mode if key == metric else "min" if "loss" in key else "max"
            row[f"final {key}"] = values[-1] if values else None
            row[f"best {key}"] = (min if better == "min" else max)(values) if values else None
        row["wall_s"] = round(status.get("wall_s", 0.0), 1)
        row["error"] = status.get("error", "")
        rows.append(row)
    return rows


def best(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The trial with the best `best {metric}` (lowest for mode 'min')."""
    scored = [r for r in rows if r.get(f"best {metric}") is not None]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda r: r[f"best {metric}"])


def swept_keys(rows: list[dict]) -> list[str]:
    """The override keys of all the rows, in order of first appearance."""
    keys = (k for r in rows for k in r)
    return list(dict.fromkeys(k for k in keys if "." in k and not k.startswith(("final ", "best "))))


def write(workdir: str, metric: str = "eval/loss", mode: str = "min") -> list[dict]:
    """Writes results.csv, results.md and the plots; returns the rows."""
    rows = collect(workdir, metric, mode)
    if not rows:
        return rows
    columns = list(dict.fromkeys(["trial", *swept_keys(rows), *(k for r in rows for k in r)]))
    with open(os.path.join(workdir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    top = best(rows, metric, mode)
    with open(os.path.join(workdir, "results.md"), "w") as f:
        f.write(markdown(rows, columns, top, metric, mode))
    plot_metric(rows, metric, mode, os.path.join(workdir, "metric.png"))
    plot_curves(workdir, rows, os.path.join(workdir, "curves.png"))
    return rows


def cell(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown(rows, columns, top, metric, mode) -> str:
    lines = [f"# Sweep results ({len(rows)} trials)", ""]
    if top:
        lines += [f"Best by {metric} ({mode}imised over each run's evals): **{top['trial']}** "
                  f"({cell(top[f'best {metric}'])})", ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)).replace("|", "/") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_metric(rows: list[dict], metric: str, mode: str, path: str) -> None:
    keys = swept_keys(rows) or ["trial"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(r[key], r[f"best {metric}"]) for r in rows
                  if r.get(key) is not None and r.get(f"best {metric}") is not None]
        numeric = all(isinstance(x, (int, float)) for x, _ in points)
        xs = [x if numeric else str(x) for x, _ in points]
        ax.scatter(xs, [y for _, y in points])
        if numeric and points and min(xs) > 0 and max(xs) / min(xs) >= 3:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(f"best {metric}")
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curves(workdir: str, rows: list[dict], path: str) -> None:
    histories = {row["trial"]: records_of(trial_dir(workdir, row["trial"])) for row in rows}
    fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 4), squeeze=False)
    for ax, key in zip(axes[0], METRICS):
        for trial, records in histories.items():
            points = [(r["step"], r[key]) for r in records if key in r]
            ax.plot([s for s, _ in points], [v for _, v in points], label=trial,
                    marker="." if key.startswith("eval") else None)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
