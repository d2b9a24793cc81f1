"""Direct preference optimization of a trained language model on prompt/chosen/rejected pairs (the dpo task).

Tune the chat fine-tuned run (or any run: a converted Hugging Face model) on JSON lines of preference pairs:

  python -m transformer.train --config configs/dpo.py:init_from=runs/gpt-tiny-sft,data.train_path=prefs.jsonl \
      --workdir runs/gpt-tiny-dpo

The model and the frozen reference are config.init_from's (transformer/training/tasks/dpo.py). How to
make pairs and pick a loss: docs/post_training.md.

Every key's value, default and meaning: `python -m transformer.inspect --config configs/dpo.py:init_from=RUN --keys`
(the meanings are transformer/config_keys.py's table).
"""


import ml_collections

from transformer import config as config_lib
from transformer import rundir

TRAINING = dict(
    data=dict(batch_size=16, eval_batches=4),
    optim=dict(lr=5e-5, warmup_steps=10, weight_decay=0.0, schedule="cosine"),
    train=dict(steps=200, log_every=20, eval_every=50, checkpoint_every=100, sample_tokens=24),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    _, overrides = config_lib.parse_arg(arg, default_preset="")
    run = overrides.pop("init_from", "")
    c = ml_collections.ConfigDict()
    c.task = "dpo"
    c.model = rundir.starting_model(run, "configs/dpo.py")
    c.model.vocab_size = 0  # the starting run's
    c.data = dict(
        train_path="",
        eval_path="",
        eval_fraction=0.1,
        seq_len=min(256, c.model.max_len),
        batch_size=8,
        eval_batches=8,
    )
    c.dpo = dict(
        beta=0.1,
        loss="sigmoid",
        gamma=0.5,
        disable_dropout=True,
    )
    c.optim = config_lib.optim_config(lr=5e-6, warmup_steps=10)
    c.train = config_lib.train_config(steps=1000, sample_tokens=0)
    c = config_lib.finish(c, TRAINING, overrides)
    with c.unlocked():
        c.init_from = run
    return c
