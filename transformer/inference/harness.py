"""A run directory as an lm-evaluation-harness model (`lm-eval`, the optional extra `eval`): any harness task
on any language-model run, scored by `inference.scoring`.

    python -m transformer.evaluate --workdir RUN --tasks TASK[,TASK] [--num_fewshot K] [--limit N] \
        [--include_path DIR]                  # the table, and the metrics appended to RUN/evals.jsonl
    python -m transformer.inference.harness --model transformer --model_args workdir=RUN --tasks TASK
                                              # lm-eval's own command line, this model registered

    import lm_eval
    from transformer.inference import harness
    lm_eval.simple_evaluate(model=harness.RunLM("runs/gpt-tiny"), tasks=["arc_easy"])
    lm_eval.simple_evaluate(model="transformer", model_args="workdir=runs/gpt-tiny", tasks=["arc_easy"])

The harness owns the tasks, prompts and metrics; the model owns tokenization (lm-eval's rules: a
context's trailing space moves to its continuation, an empty context is the prefix token) and the
scoring. Generation is greedy (the harness's tasks ask for it); a request's `until` strings cut the text.
Local tasks (a YAML file and JSON-lines data in a folder, `--include_path`) work offline.

A chat run (fine-tuned with the sft task, or converted with a chat template) takes lm-eval's
`apply_chat_template` (`evaluate --apply_chat_template`): each prompt is rendered by the run's chat format
(data/text/chat_templates.py), its markers as their ids and the task's text never parsed into markers, and a
greedy answer ends at the end-of-turn marker.
"""

import os
import re
import sys

import jax
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from transformer import rundir
from transformer.data.text import chat_templates
from transformer.inference import sampling, scoring

BOOTSTRAP_ITERS = 100_000  # lm-eval's command's default: the standard errors its table prints


@register_model("transformer")
class RunLM(TemplateLM):
    """An lm-eval model over a run directory (`workdir`, or lm-eval's `pretrained`), or over a `scorer` (and
    its run's `chat` format, for chat-templated tasks)."""

    def __init__(self, workdir: str | None = None, step: int | None = None, batch_size: int | str = 8,
                 max_gen_toks: int = 256, scorer: scoring.Scorer | None = None, pretrained: str | None = None,
                 chat: chat_templates.ChatFormat | None = None, **unused):
        super().__init__()
        workdir = workdir or pretrained
        if scorer is None:
            batch = int(batch_size) if str(batch_size).isdigit() else 8  # lm-eval's 'auto': our default
            scorer = scoring.Scorer.from_run(workdir, None if step is None else int(step), batch)
        if chat is None and workdir:
            chat = rundir.open(workdir).chat_format()
        self.scorer, self.chat, self.name = scorer, chat, os.path.basename(os.path.normpath(workdir or "run"))
        self.backend = scorer.kind
        self.max_gen_toks = int(max_gen_toks)
        self._rendered: dict[str, list[int]] = {}  # chat prompts given to lm-eval as text -> their ids

    @property
    def eot_token_id(self) -> int:
        return self.scorer.stop_id

    @property
    def prefix_token_id(self) -> int:
        return self.scorer.prefix_id

    @property
    def max_length(self) -> int:
        return self.scorer.max_len

    @property
    def tokenizer_name(self) -> str:
        return f"transformer/{self.name}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.chat.source if self.chat is not None and chat_template is not False else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat format's rendering of `chat_history`; its ids are kept for `tok_encode` (the text alone
        would not say which of its characters are markers)."""
        if self.chat is None:
            raise ValueError(f"--apply_chat_template: run {self.name} has no chat template; fine-tune it with the "
                             "sft task")
        ids, _ = self.chat.encode(chat_history, add_generation_prompt)
        text = self.chat.render(chat_history, add_generation_prompt).text
        self._rendered[text] = ids.tolist()
        return text

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The run's ids of `string`; an encoder-decoder's source with its special tokens (`Scorer.source_ids`)
        unless `add_special_tokens` is False, as lm-eval's `hf` encodes a seq2seq model's context. A string
        that starts with a chat rendering (`apply_chat_template`) is that rendering's ids and the rest's."""
        if self.backend == "seq2seq" and add_special_tokens is not False:
            return self.scorer.source_ids(string)
        for length in sorted({len(t) for t in self._rendered}, reverse=True):
            if string[:length] in self._rendered:
                rest = string[length:]
                return self._rendered[string[:length]] + (chat_templates.plain_encode(self.chat.tokenizer, rest)[0]
                                                          if rest else [])
        return self.scorer.tokenizer.encode(string).tolist()

    def tok_decode(self, ids) -> str:
        return self.scorer.tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        documents = [self.scorer.tokenizer.encode(request.args[0]).tolist() for request in requests]
        return self.scorer.loglikelihood_rolling(documents)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy completions, cut before the first of each request's `until` strings."""
        by_limit = {}
        for i, request in enumerate(requests):
            context, kwargs = request.args
            by_limit.setdefault(int(kwargs.get("max_gen_toks", self.max_gen_toks)), []).append(i)
        texts = [""] * len(requests)
        for limit, indices in by_limit.items():
            contexts = [self.tok_encode(requests[i].args[0]) for i in indices]
            for i, ids in zip(indices, self.scorer.generate(contexts, limit)):
                texts[i] = sampling.cut_at_stops(self._reply(ids), stops(requests[i].args[1]))[0]
        return texts

    def _reply(self, ids: list[int]) -> str:
        """Generated ids as text: a chat run's up to its end-of-turn marker, its markers left out."""
        if self.chat is None:
            return self.tok_decode(ids)
        ends = [j for j, i in enumerate(ids) if i in self.chat.end_ids]
        return self.chat.decode(ids[:ends[0]] if ends else ids)


def stops(gen_kwargs: dict) -> list[str]:
    """A request's stop strings (`until`: a string or a list)."""
    until = gen_kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def as_limit(value: float | None) -> int | float | None:
    """A --limit as lm-eval takes it: None for all documents (None or 0), a count (>= 1) or a fraction."""
    if not value:
        return None
    return int(value) if value >= 1 else float(value)


def task_manager(include_path: str | None = None):
    """lm-eval's task index: its built-in tasks, and the YAML tasks under `include_path`."""
    from lm_eval.tasks import TaskManager

    if include_path and not os.path.isdir(include_path):
        raise FileNotFoundError(f"--include_path={include_path} is not a folder")
    return TaskManager(include_path=include_path or None)


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


def run_tasks(scorer: scoring.Scorer, names: list[str], manager, num_fewshot: int | None = None,
              limit: float | None = None, stderr: bool = False, chat: chat_templates.ChatFormat | None = None,
              finished=None) -> dict | None:
    """lm-eval's results of `names` on the scorer's model, one task after another, merged (process 0; the
    others serve its batches and get None); each task's results go to `finished(name, results)` as it ends, so
    that a later task's failure loses none before it. `stderr`: the standard errors lm-eval's own command
    prints (its bootstrap), else none (training's scores). With `chat`, prompts rendered by that chat format
    (few-shot examples as earlier turns). Requests cut on the left to the model's context are said in one line."""
    import lm_eval

    if jax.process_index() > 0:
        scorer.serve()
        return None
    scorer.cuts = scoring.Cuts()
    merged = {}
    try:
        for name in names:
            results = lm_eval.simple_evaluate(model=RunLM(scorer=scorer, chat=chat), tasks=[name],
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


HELP = "Run lm-evaluation-harness's own command line, with a run directory as its model `transformer`."

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    if sys.argv[1:] in (["--help"], ["-h"]):
        print(HELP + "\n")
    sys.exit(cli_evaluate())
