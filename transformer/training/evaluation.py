"""Evaluating a run without training it (`python -m transformer.evaluate`).

    metrics = evaluation.evaluate_run("runs/bert-sst", step=200, overrides={"data.eval_path": "test.tsv"})

Restores one checkpoint's params (no optimizer state: a converted run's checkpoints/0 evaluates too),
builds the run's task and its jitted eval step on the mesh (no train step is compiled), and evaluates
the task's eval set: the run's own, or another one that `overrides` of config.data name. Each
evaluation is appended to WORKDIR/evals.jsonl as one JSON object,

    {"step": 200, "overrides": {"data.eval_path": "test.tsv"}, "eval/loss": 0.41, "eval/accuracy": 0.88, ...}

so metrics.jsonl stays the record of the training itself (a resumed run rewrites it from its step).
With overrides of config.data the task reads its data in a scratch directory that holds what the
run recorded (its tokenizer, labels.json, image statistics): the run's data record and store are
left as they are, and the new data is read with the run's tokenizer, label ids and normalisation.
"""

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from transformer import parallel, rundir, sharding
from transformer.data.images import normalisation
from transformer.data.text import lm_streams, tokenizers
from transformer.models import common
from transformer.training import checks, loop, tasks

SECTIONS = ("data", "mesh", "train", "model")  # what --config.SECTION.KEY=VALUE may change of a run read back


def define_overrides():
    """The --config.SECTION.KEY=VALUE flags of a command that reads a run (no config file: the run's
    config.json is the base), SECTION one of SECTIONS; the flag's value holds the overrides given."""
    from ml_collections import config_dict, config_flags

    return config_flags.DEFINE_config_dict(
        "config", config_dict.ConfigDict({s: {} for s in SECTIONS}),
        "Overrides of the run's config.json, e.g. --config.data.eval_path=test.tsv.",
        lock_config=False, accept_new_attributes=True)


def flat_overrides(given: dict, prefix: str = "") -> dict[str, str]:
    """{'data': {'eval_path': 'x'}} -> {'data.eval_path': 'x'}, the values as text (`config.apply_overrides`)."""
    flat = {}
    for key, value in given.items():
        if isinstance(value, dict):
            flat.update(flat_overrides(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value if isinstance(value, str) else repr(value)
    return flat


@dataclasses.dataclass
class Evaluation:
    """What `loop.evaluate` reads: the task, its jitted eval step, and the placement of its batches."""

    config: object
    task: object
    eval_step: object
    mesh: object
    rows: np.ndarray

    def place(self, local_batch: dict) -> dict:
        return parallel.global_batch(local_batch, self.mesh, self.rows, self.config.data.batch_size)


def evaluate_run(workdir: str, step: int | None = None, overrides: dict[str, str] | None = None,
                 devices=None, record: bool = True) -> tuple[int, dict]:
    """(the step, the eval metrics) of checkpoint `step` (default: the latest) of the run in `workdir`,
    its config changed by `overrides` (`RunDir.with_overrides`); appended to WORKDIR/evals.jsonl by
    process 0 where `record`."""
    run = rundir.open(workdir).with_overrides(overrides or {})
    latest, step = step is None, run.checkpoint_step(step)
    launch = checks.checked(run.config, resolve=False)
    config, task_name = launch.config, launch.task
    mesh, rows = loop.prepare(config, devices)
    with task_directory(run, overrides or {}) as task_dir:
        if jax.process_index() == 0:
            print(data_line(config, task_name, task_dir, task_dir != run.path), file=sys.stderr)
        task = tasks.build(config, task_dir, task_name, rows, step)
        model = run.model()
        rules = sharding.rules_of(config.mesh)
        shardings = run.param_shardings(mesh)
        eval_step = loop.make_eval_step(task, model, mesh, rules, shardings, common.auxiliary(config))
        evaluation = Evaluation(config, task, eval_step, mesh, rows)
        step, params = run.restore_latest(mesh) if latest else (step, run.restore_params(step, mesh))
        started = time.perf_counter()
        metrics = loop.evaluate(evaluation, params)
    if jax.process_index() == 0:
        print(f"evaluated {config.model.family} step {step} in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
        if record:
            with open(os.path.join(workdir, rundir.EVALS), "a") as f:
                f.write(json.dumps({"step": step, "overrides": dict(overrides or {}), **metrics}) + "\n")
    return step, metrics


def data_line(config, task: str, task_dir: str, other: bool) -> str:
    """The `data:` line of an evaluation: which data the task's eval set comes from (`other`: overrides of
    config.data name it), and where a text source is tokenized first."""
    d, given = config.data, " (given)" if other else ""
    if task in ("lm", "mlm"):
        sources = [d.source, *([d.eval_source] if d.get("eval_source") else [])]
        line = f"data: the eval split of {' and '.join(sources)}{given}"
        if lm_streams.store_indexes(d.source) is None and not lm_streams.is_store(
                os.path.join(task_dir, lm_streams.STORE_DIR)):
            where = "a scratch directory" if other else os.path.join(task_dir, lm_streams.STORE_DIR)
            line += (f": text this run has not tokenized, tokenized whole into {where} first "
                     "(--config.data.source=STORE evaluates a token store as it is)")
        return line
    if task == "image_classification":
        return f"data: the held-out images of {d.source}{given}"
    if d.get("eval_path"):
        return f"data: {d.eval_path}{given}"
    return "data: the embedded task's eval split (--config.data.eval_path=FILE evaluates another)"


@contextlib.contextmanager
def task_directory(run: rundir.RunDir, overrides: dict):
    """The directory the task reads and writes its data in: the workdir itself, or with overrides of
    config.data a temporary one holding the run's tokenizer, labels and image statistics."""
    if not any(k.startswith("data.") for k in overrides):
        yield run.path
        return
    with tempfile.TemporaryDirectory(prefix="evaluate-") as path:
        if os.path.isfile(os.path.join(run.path, tokenizers.CONFIG_FILE)):
            run.tokenizer(framed=False).save(path)
        names = rundir.read_labels(run.path)
        if names:  # the eval data's label (or class folder) names take the run's ids
            rundir.save_labels(path, names)
        saved = normalisation.saved_statistics(run.path)
        if saved is not None:
            normalisation.save_statistics(path, *saved, f"the run {run.path}")
        yield path
