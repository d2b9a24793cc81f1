"""Every check of a run's config, before any data, tokenizer or compile work.

`validate(config)` runs them all, each mistake failing in one line that names `config.KEY`:
the model (its family's choices and relations: transformer/models/), its task's checks
(lengths against the context, the tokenizer's special tokens), the tokenizer's size against
`config.model.vocab_size`, the optimizer (Muon's against the model's weights), the loop's
schedule and the mesh rules. A config that leaves shapes to the data is checked with them filled
in (`shapes.resolved`: only what the shapes need is read, an index, class folders, a few image
headers). What needs the devices (the mesh sizes, the batch split) is checked when the mesh is made,
still before any data.

A launch resolves and validates its config once, in the command, before anything is built: `checked(config)`
is the `Checked` record that `loop.setup` and evaluation take.
"""

import dataclasses

from transformer import models, sharding
from transformer.models import common
from transformer.training import losses, optim, shapes, tasks, trackers
from transformer.training.tasks import text_data

Z_LOSS_TASKS = ("lm", "mlm", "seq2seq")  # the language-model tasks, whose loss takes config.train.z_loss
_POSITIVE = {
    "model": ("d_model", "max_len"),
    "data": ("batch_size", "seq_len", "source_len", "target_len", "eval_batches"),
    "optim": ("accum_steps",),
    "train": ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints"),
}


@dataclasses.dataclass(frozen=True)
class Checked:
    """A config resolved (the shapes it leaves to the data filled in) and validated: what a launch builds from."""

    config: object
    task: str                # its training task
    said: tuple[str, ...]    # what the data holds and what the run took from it (`shapes.resolve`)


def checked(config, resolve: bool = True, workdir: str = "") -> Checked:
    """`config` with the shapes it leaves to the data filled in, in place (`resolve`: said even where it leaves
    none; else only where it leaves any, silently, as a run's own config.json needs none), then validated; a
    text source the run in `workdir` has not tokenized names files before anything is said."""
    if workdir:
        text_data.check_sources(config, workdir)
    said = shapes.resolve(config) if resolve or shapes.left_to_data(config) else []
    return Checked(config, validate(config), tuple(said if resolve else ()))


def validate(config) -> str:
    """Checks the whole config (the shapes it leaves to the data filled in); returns its training task."""
    config = shapes.resolved(config)
    models.build(config.model, config.get("lora"))
    task = tasks.name_of(config)
    for section, keys in _POSITIVE.items():
        for key in keys:
            if key in config[section] and config[section][key] < 1:
                raise ValueError(f"config.{section}.{key}={config[section][key]} must be at least 1")
    tasks.module(task).check(config)
    z_loss = losses.z_loss_weight(config)
    if z_loss < 0:
        raise ValueError(f"config.train.z_loss={z_loss} must be >= 0 (0: none)")
    if z_loss and task not in Z_LOSS_TASKS:
        raise ValueError(f"config.train.z_loss={z_loss}: the z-loss is a language model's ({', '.join(Z_LOSS_TASKS)} "
                         f"tasks), not the {task} task's; set it to 0")
    common.auxiliary(config)
    trackers.parse(config.train.get("trackers", ""))
    optim.check(config.optim)
    if config.optim.optimizer == "muon":  # which of the model's weights are its matrices (shapes only)
        optim.check_muon(models.param_shapes(config.model))
    sharding.check_rules(config.mesh)
    return task
