"""Reinforcement learning with verifiable rewards (the grpo task) on a fine-tuned run.

GRPO on the chat run of configs/sft.py, with prompts in JSON lines ({"prompt": ..., "answer": ...}) scored by
the built-in numeric verifier and a format check:

  python -m transformer.train --config configs/grpo.py:init_from=runs/gpt-tiny-sft,data.train_path=prompts.jsonl \
      --config.grpo.rewards=numeric=1,format=0.1 --workdir runs/gpt-tiny-grpo

The model is config.init_from's (its config.json's model section: an SFT run, or a converted Hugging Face
model); prompts use its chat template where it has one. data.batch_size counts rollouts per step (prompts x
grpo.group_size); a reward is a built-in verifier or a `module:function` (transformer/training/rewards.py).
"""

import ml_collections

from transformer import config as config_lib

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
    c.model = config_lib.init_from_model(run, "configs/grpo.py")
    c.data = dict(
        train_path="",        # JSON lines of {"prompt": ...} or {"messages": [...]}, with what the rewards read
        eval_path="",         # held-out prompts ('': eval_fraction of train_path)
        eval_fraction=0.05,   # the share of train_path held out (by a hash of each record)
        seq_len=min(128, c.model.max_len),  # a rollout row's tokens: at least the longest prompt + max_new_tokens
        batch_size=64,        # rollouts per step: prompts x grpo.group_size
        eval_batches=2,       # batches of held-out answers whose loss eval reports
    )
    c.grpo = dict(
        rewards="numeric",        # name=weight,...: exact_match | numeric | format | package.module:function
        group_size=8,             # completions sampled per prompt (advantages are normalised within them)
        max_new_tokens=32,        # a completion's most tokens (it ends at the chat template's end of turn)
        updates_per_rollout=2,    # optimizer steps on each rollout batch before sampling the next
        clip_low=0.2,             # the ratio's clip below 1 - clip_low
        clip_high=0.28,           # and above 1 + clip_high (DAPO's clip-higher)
        loss_type="dapo",         # dapo (each token alike) | grpo (each completion alike) | dr_grpo
        advantage_scale="std",    # std: divide by the group's spread (GRPO) | none (Dr. GRPO)
        kl_weight=0.0,            # > 0: the k3 KL to the starting policy (LoRA: the adapters off)
        eval_prompts=64,          # held-out prompts answered greedily and written at each eval
    )
    c.optim = config_lib.optim_config(lr=1e-4, warmup_steps=10, weight_decay=0.0)
    c.train = config_lib.train_config(steps=100)
    c = config_lib.finish(c, TRAINING, overrides)
    with c.unlocked():
        c.init_from = run
    return c
