"""Reinforcement learning with verifiable rewards (the grpo task) on a fine-tuned run.

GRPO on the chat run of configs/sft.py, with prompts in JSON lines ({"prompt": ..., "answer": ...}) scored by
the built-in numeric verifier and a format check:

  python -m transformer.train --config configs/grpo.py:init_from=runs/gpt-tiny-sft,data.train_path=prompts.jsonl \
      --config.grpo.rewards=numeric=1,format=0.1 --workdir runs/gpt-tiny-grpo

The model is config.init_from's config.json's model section (transformer/training/tasks/grpo.py).
data.batch_size counts rollouts (prompts x grpo.group_size); a reward is a built-in verifier or a
`module:function` (transformer/training/rewards.py). How to write prompts and rewards: docs/post_training.md.

Every key's value, default and meaning: `python -m transformer.inspect --config configs/grpo.py:init_from=RUN --keys`
(the meanings are transformer/config_keys.py's table).
"""

import ml_collections

from transformer import config as config_lib
from transformer import rundir

TRAINING = dict(
    data=dict(batch_size=64, eval_batches=2),
    optim=dict(lr=1e-4, warmup_steps=10, schedule="constant"),
    train=dict(steps=100, log_every=5, eval_every=25, checkpoint_every=25),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    _, overrides = config_lib.parse_arg(arg, default_preset="")
    run = overrides.pop("init_from", "")
    c = ml_collections.ConfigDict()
    c.task = "grpo"
    c.model = rundir.starting_model(run, "configs/grpo.py")
    c.data = dict(
        train_path="",
        eval_path="",
        eval_fraction=0.05,
        seq_len=min(128, c.model.max_len),
        batch_size=64,
        eval_batches=2,
    )
    c.grpo = dict(
        rewards="numeric",
        group_size=8,
        max_new_tokens=32,
        updates_per_rollout=2,
        clip_low=0.2,
        clip_high=0.28,
        loss_type="dapo",
        advantage_scale="std",
        kl_weight=0.0,
        eval_prompts=64,
    )
    c.optim = config_lib.optim_config(lr=1e-4, warmup_steps=10, weight_decay=0.0)
    c.train = config_lib.train_config(steps=100)
    c = config_lib.finish(c, TRAINING, overrides)
    with c.unlocked():
        c.init_from = run
    return c
