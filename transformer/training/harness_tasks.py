"""lm-evaluation-harness tasks on a run (the optional extra `eval`): the tasks checked before any scoring, run one
after another on a scorer and merged, a run's checkpoint scored on them (`python -m transformer.evaluate
--tasks`), and config.train.harness_tasks scored during training (`DuringTraining`). The model lm-eval calls is
`inference.harness.RunLM`.
"""

import json
import os
import re
import sys

import jax

from transformer import models, rundir, sharding
from transformer.data.text import tokenizers

BOOTSTRAP_ITERS = 100_000  # lm-eval's command's default: the standard errors its table prints


def as_limit(value: float | None) -> int | float | None:
    """A --limit as lm-eval takes it: None for all documents (None or 0), a count (>= 1) or a fraction."""
    if not value:
        return None
    return int(value) if value >= 1 else float(value)


def check_tasks(names: list[str], manager) -> None:
    """Every task known, its data at hand and its metrics computable (`dry_run`), before any scoring; else a
    ValueError in one line naming the first that is not."""
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--tasks: no task named {', '.join(unknown)} (a local task's folder goes to "
                         "--include_path; `lm_eval ls tasks` lists the built-in ones)")
    for name in names:
        try:
            loaded = manager.load([name])
        except Exception as e:  # datasets' errors vary by source: a missing file, no network, a gated set
            raise ValueError(f"--tasks: the data of task {name} cannot be had: {first_line(e)}") from None
        for line in user_code(name, manager) if jax.process_index() == 0 else []:
            print(line, file=sys.stderr)
        for task_name, task in loaded["tasks"].items():
            try:
                dry_run(task)
            except Exception as e:  # a task's YAML may name any metric, option or Python function
                raise ValueError(f"--tasks: task {task_name}'s metrics fail on its first document before any "
                                 f"scoring: {type(e).__name__}: {first_line(e)} (check its YAML's metric_list "
                                 "and process_results)") from None


def user_code(name: str, manager) -> list[str]:
    """A line where task `name`'s YAML (one not shipped with lm-eval) names Python of its folder (`!function`),
    which lm-eval imports and runs in this process."""
    import lm_eval

    entry = manager.task_index.get(name)
    path = getattr(entry, "yaml_path", None)
    if not path or os.path.abspath(path).startswith(os.path.dirname(os.path.abspath(lm_eval.__file__))):
        return []
    functions = sorted(set(re.findall(r"!function\s+([\w.]+)", open(path, encoding="utf-8").read())))
    if not functions:
        return []
    return [f"harness: task {name} ({path}) runs Python from its folder ({', '.join(functions)}: !function) in this "
            "process; name in --include_path only task folders whose code you trust"]


def dry_run(task) -> None:
    """A task's prompt, metrics and their aggregation on its first document with a stand-in answer (its target
    as the generation, log-likelihoods of 0): a YAML mistake fails here, not after the scoring."""
    doc = next(iter(task.eval_docs))
    task.doc_to_text(doc)
    kind = task.OUTPUT_TYPE
    if kind == "generate_until":
        target = task.doc_to_target(doc)
        if isinstance(target, int) and task.config.doc_to_choice is not None:
            target = task.doc_to_choice(doc)[target]
        results = [str(target[0] if isinstance(target, list) and target else target)]
    else:
        choices = task.doc_to_choice(doc) if kind == "multiple_choice" else [None]
        results = [0.0] if kind == "loglikelihood_rolling" else [(0.0, kind == "loglikelihood")] * len(choices)
    values = task.process_results(doc, results)
    for metric, aggregate in task.aggregation().items():
        if metric in values:
            aggregate([values[metric]])


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def metrics_of(results: dict) -> dict[str, float]:
    """lm-eval's results -> {'eval/harness/TASK/METRIC': value}, its filter dropped where it is 'none'."""
    flat = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and metric != "sample_len":
                name = metric if filter_name in ("", "none") else f"{metric}_{filter_name}"
                flat[f"eval/harness/{task}/{name}"] = float(value)
    return flat


def run_tasks(scorer, names: list[str], manager, num_fewshot: int | None = None,
              limit: float | None = None, stderr: bool = False, chat=None,
              finished=None) -> dict | None:
    """lm-eval's results of `names` on the scorer's model, one task after another, merged (process 0; the
    others serve its batches and get None); each task's results go to `finished(name, results)` as it ends, so
    that a later task's failure loses none before it. `stderr`: the standard errors lm-eval's own command
    prints (its bootstrap), else none (training's scores). With `chat`, prompts rendered by that chat format
    (few-shot examples as earlier turns). Requests cut on the left to the model's context are said in one line."""
    import lm_eval

    from transformer.inference import harness, scoring

    if jax.process_index() > 0:
        scorer.serve()
        return None
    scorer.cuts = scoring.Cuts()
    merged = {}
    try:
        for name in names:
            results = lm_eval.simple_evaluate(model=harness.RunLM(scorer=scorer, chat=chat), tasks=[name],
                                              num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                              log_samples=False, apply_chat_template=chat is not None,
                                              bootstrap_iters=BOOTSTRAP_ITERS if stderr else 0, verbosity="WARNING")
            if finished is not None:
                finished(name, results)
            for key, value in results.items():
                merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else merged.get(key, value)
    finally:
        scorer.close()
        if scorer.cuts.lost:  # said even where a task failed: of the requests scored before it
            print(scorer.cuts.said(scorer.max_len), file=sys.stderr)
    return merged


def evaluate_tasks(workdir: str, names: list[str], num_fewshot: int | None = None, limit: float | None = None,
                   include_path: str | None = None, step: int | None = None, overrides: dict | None = None,
                   batch_size: int = 8, record: bool = True,
                   apply_chat_template: bool = False) -> tuple[int, dict | None]:
    """(the step, lm-eval's results with its standard errors) of `names` on checkpoint `step` of the run in
    `workdir` (its prompts in the run's chat template where `apply_chat_template`); the task names, their data
    and metrics, the run's kind and chat template are checked before any model is loaded. Process 0 appends
    each task's metrics (`metrics_of`) to WORKDIR/evals.jsonl as the task finishes, where `record`."""
    from transformer.inference import harness, scoring  # lm-eval: the optional extra `eval`

    run = rundir.open(workdir)
    scoring.language_model_kind(run)
    chat = run.chat_format(required=True) if apply_chat_template else None
    manager = harness.task_manager(include_path)
    check_tasks(names, manager)
    step = run.checkpoint_step(step)
    scorer = scoring.Scorer.from_run(workdir, step, batch_size, overrides=overrides)

    def keep(name: str, results: dict) -> None:
        if record:
            line = {"step": step, "overrides": dict(overrides or {}),
                    "harness": {"tasks": [name], "num_fewshot": num_fewshot, "limit": limit,
                                "apply_chat_template": apply_chat_template}, **metrics_of(results)}
            with open(os.path.join(workdir, rundir.EVALS), "a") as f:
                f.write(json.dumps(line) + "\n")

    return step, run_tasks(scorer, names, manager, num_fewshot, limit, stderr=True, chat=chat, finished=keep)


class DuringTraining:
    """config.train.harness_tasks scored every harness_every steps (0: eval_every) and at the end, on the
    training's own params and mesh: `scores = hook(params)` -> {'eval/harness/TASK/METRIC': value} on
    process 0 ({} on the others, which compute with it). The tasks and their data are checked when made."""

    def __init__(self, config, workdir: str, model, mesh, params):
        from transformer.inference import harness, scoring

        c = config.train
        family = models.family(config.model.family)
        if family.generation not in scoring.KINDS or config.model.get("head", "lm") != "lm":
            raise ValueError(f"config.train.harness_tasks={c.harness_tasks!r}: a {family.name} model is not a "
                             "language model; set it to ''")
        self.names = [name.strip() for name in c.harness_tasks.split(",") if name.strip()]
        self.manager = harness.task_manager(c.harness_include_path or None)
        check_tasks(self.names, self.manager)
        self.every = c.harness_every or c.eval_every
        self.num_fewshot = None if c.harness_num_fewshot < 0 else int(c.harness_num_fewshot)
        self.limit = as_limit(c.harness_limit)
        shardings = jax.tree.map(lambda x: x.sharding, params)
        self.scorer = scoring.Scorer(model, params, tokenizers.load_tokenizer(workdir), mesh,
                                     sharding.rules_of(config.mesh), shardings, scoring.KINDS[family.generation],
                                     config.data.batch_size, bool(config.data.get("source_eos", False)))

    def due(self, step: int, end: int) -> bool:
        return step % self.every == 0 or step == end

    def __call__(self, params) -> dict[str, float]:

        self.scorer.params = params
        results = run_tasks(self.scorer, self.names, self.manager, self.num_fewshot, self.limit)
        return {} if results is None else metrics_of(results)
