"""Supervised fine-tuning of a trained language model on conversations (the sft task).

Fine-tune the quickstart's run on a JSON-lines file of {"messages": [...]} or prompt/completion pairs:

  python -m transformer.train --config configs/sft.py:init_from=runs/gpt-tiny,data.train_path=chat.jsonl \
      --workdir runs/gpt-tiny-sft

The model is config.init_from's config.json's model section; its vocab_size is left to the data (the chat
markers it adds: transformer/training/tasks/sft.py). How to write conversations: docs/post_training.md.

Every key's value, default and meaning: `python -m transformer.inspect --config configs/sft.py:init_from=RUN --keys`
(the meanings are transformer/config_keys.py's table).
"""

import ml_collections

from transformer import config as config_lib
from transformer import rundir

TRAINING = dict(
    data=dict(batch_size=16, eval_batches=4),
    optim=dict(lr=1e-3, warmup_steps=20, weight_decay=0.0, schedule="cosine"),
    train=dict(steps=300, log_every=25, eval_every=100, checkpoint_every=100, sample_tokens=40),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    _, overrides = config_lib.parse_arg(arg, default_preset="")
    run = overrides.pop("init_from", "")
    c = ml_collections.ConfigDict()
    c.task = "sft"
    c.model = rundir.starting_model(run, "configs/sft.py")
    c.model.vocab_size = 0  # the pretrained one's, grown to hold the chat markers
    c.data = dict(
        train_path="",
        eval_path="",
        eval_fraction=0.05,
        seq_len=min(256, c.model.max_len),
        batch_size=8,
        eval_batches=8,
    )
    c.optim = config_lib.optim_config(lr=5e-4, warmup_steps=50)
    c.train = config_lib.train_config(steps=1000, sample_tokens=0)
    c = config_lib.finish(c, TRAINING, overrides)
    with c.unlocked():
        c.init_from = run
    return c
