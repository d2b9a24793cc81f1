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
import sys

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from transformer import rundir
from transformer.data.text import chat_templates
from transformer.inference import sampling, scoring


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


def task_manager(include_path: str | None = None):
    """lm-eval's task index: its built-in tasks, and the YAML tasks under `include_path`."""
    from lm_eval.tasks import TaskManager

    if include_path and not os.path.isdir(include_path):
        raise FileNotFoundError(f"--include_path={include_path} is not a folder")
    return TaskManager(include_path=include_path or None)


HELP = "Run lm-evaluation-harness's own command line, with a run directory as its model `transformer`."

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    if sys.argv[1:] in (["--help"], ["-h"]):
        print(HELP + "\n")
    sys.exit(cli_evaluate())
