"""Training tasks: what a model is trained on (batches), how (loss) and how it is judged (eval).

A run's task is `name_of(config)`: its model's (`models.task_of(config.model)`, by the model's head; a GPT
on images reads them as ImageGPT, 'image_lm'), or the one config.task names (post-training: 'sft'). Each
task is a file here that provides

  check(config)               the config checks of this task, run before any data is read
  from_data(config)           fills in the keys config leaves to the data (`shapes.FROM_DATA`) that this
                              task takes from its data, in place (`shapes.take`), and returns the
                              lines that say what the data holds and what was taken (`shapes.said`)
  build(config, workdir, rows, start_step)
                              the Task (reads or builds its data, tokenizer, labels); `rows`
                              are the global batch's rows this process builds (sorted indices,
                              `parallel.process_rows`), `start_step` the step the run starts at

and its Task implements every member of the `Task` protocol below: the loop and the steps
call nothing else. Batches are dicts of numpy arrays whose leading dimension is the batch
(this process's rows of the global batch); `loss`, `loss_weights` and `eval_outputs` are
traced inside the jitted steps.
"""

import importlib
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import jax
import numpy as np

from transformer import models
from transformer.data.images import pixels
from transformer.data.text import tokenizers

TASKS = ("lm", "mlm", "sequence_classification", "token_classification", "image_classification",
         "seq2seq", "image_lm", "sft", "dpo", "grpo")
CHOSEN = {"sft": "lm", "dpo": "lm", "grpo": "lm"}  # tasks a config names (config.task) -> the model task they take


@runtime_checkable
class Task(Protocol):
    item_name: str        # what the throughput counts: 'tokens', 'images'
    items_per_step: int   # how many of them one global batch holds

    def init_inputs(self) -> tuple:
        """Positional inputs for `model.init` (a batch of 1)."""

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of step's batch: a pure function of (seed, step)."""

    def eval_batches(self) -> Iterable[dict[str, np.ndarray]]:
        """The fixed eval batches (this process's rows), a list or made as they are iterated."""

    def loss(self, model, params, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, metrics): the loss is a sum of terms, each a mean named in the metrics."""

    def loss_weights(self, batch: dict) -> dict[str, jax.Array]:
        """{term: how many items its mean is over} (masked tokens, rows, ...), for each term of the
        loss, so that accumulated microbatches give exactly the whole batch's loss."""

    def eval_outputs(self, model, params, batch: dict) -> dict[str, jax.Array]:
        """What an eval batch gives (sums, predictions), traced in the jitted eval step."""

    def eval_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Host side: 'eval/...' metrics from every eval batch's outputs."""

    def report(self, model, params, step: int) -> list[str]:
        """Host side: lines to print after an eval (a sample, a few outputs); [] for none."""


@runtime_checkable
class OnPolicy(Protocol):
    """A task whose batches the params being trained make (GRPO's rollouts): before each step the loop calls
    `roll_out` with the state the step starts from, then asks for the step's batch, never ahead of it."""

    def roll_out(self, model, params, step: int) -> None:
        """Makes what `train_batch(step)` returns, where `params` (the state's before `step`) change it."""

    def eval_rollouts(self, model, params, step: int) -> dict[str, float]:
        """'eval/...' metrics of sampling with `params` (held-out reward, accuracy), which the loop logs with the
        eval metrics; an on-policy run is evaluated at step 0 too, the baseline they are read against."""


MEMBERS = tuple(sorted({*Task.__annotations__, *(n for n in vars(Task) if not n.startswith("_"))}))


def check_post_training(config, starts: str, data: str) -> None:
    """The checks every post-training task (sft, dpo, grpo) shares: its lengths, the run it starts from
    (`starts`: what it does to that run) and its JSON-lines train file (`data`: what the file holds)."""
    check_lengths(config, "seq_len")
    if not config.init_from:
        raise ValueError(f"the {config.task} task {starts}: set config.init_from to its workdir")
    if not config.data.train_path:
        raise ValueError(f"config.data.train_path: give a JSON-lines file of {data}")


def module(name: str):
    if name not in TASKS:
        raise ValueError(f"no training task {name!r}; the tasks are {', '.join(TASKS)}")
    return importlib.import_module(f"transformer.training.tasks.{name}")


def name_of(config) -> str:
    """The run's task: config.task where the config names one (a model of the task it takes), else its model's;
    a language model whose data.source names images trains as ImageGPT ('image_lm')."""
    own = models.task_of(config.model)
    chosen = config.get("task", "")
    if not chosen:
        return "image_lm" if own == "lm" and pixels.is_image_source(config.data.source) else own
    if CHOSEN.get(chosen) != own:
        raise ValueError(f"config.task={chosen!r} takes a model of the {CHOSEN.get(chosen)} task, not {own}; "
                         f"choose one of {', '.join(CHOSEN)}")
    return chosen


def check_lengths(config, *keys: str) -> None:
    """Each config.data length fits the model's context (config.model.max_len)."""
    for key in keys:
        if config.data[key] > config.model.max_len:
            raise ValueError(f"config.data.{key}={config.data[key]} exceeds config.model.max_len="
                             f"{config.model.max_len}")


def check_specials(config, *names: str) -> None:
    """The tokenizer config.data asks for has the special tokens the task places."""
    if config.data.tokenizer in tokenizers.WITHOUT_SPECIALS:
        raise ValueError(f"config.data.tokenizer={config.data.tokenizer!r} has no {'/'.join(names)} tokens: set "
                         "it to 'wordpiece' or 'bpe'")


def build(config, workdir: str, name: str, rows: np.ndarray, start_step: int) -> Task:
    task = module(name).build(config, workdir, rows, start_step)
    if not isinstance(task, Task):
        missing = [m for m in MEMBERS if not hasattr(task, m)]
        raise TypeError(f"the {name} task lacks {', '.join(sorted(missing))} of the Task protocol")
    return task
