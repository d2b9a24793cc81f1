"""The optimizer from config.optim: AdamW, warmup + cosine, clipping, no decay on norms/biases."""

import jax
import optax

NO_DECAY = ("bias", "scale")


OPTIMIZERS = ("adamw",)
SCHEDULES = ("cosine", "constant")


def check(optim_config) -> None:
    """Fails naming the config.optim key whose value is not one of its choices or out of range."""
    c = optim_config
    if c.optimizer not in OPTIMIZERS:
        raise ValueError(f"config.optim.optimizer={c.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if c.schedule not in SCHEDULES:
        raise ValueError(f"config.optim.schedule={c.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    for key in ("lr", "warmup_steps", "weight_decay", "clip_norm", "final_lr_fraction"):
        if c[key] < 0:
            raise ValueError(f"config.optim.{key}={c[key]} must not be negative")


def make_schedule(optim_config, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine (or constant) to `lr * final_lr_fraction`."""
    c = optim_config
    warmup = min(c.warmup_steps, max(total_steps - 1, 0))
    if c.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=c.lr, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=c.lr * c.final_lr_fraction)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, c.lr, warmup), optax.constant_schedule(c.lr)], [warmup])


def decay_mask(params):
    """True for weights that take weight decay: everything but biases and norm scales."""
    def decays(path, _):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return names[-1] not in NO_DECAY
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(optim_config, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    c = optim_config
    check(c)
    schedule = make_schedule(c, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(c.clip_norm) if c.clip_norm > 0 else optax.identity(),
        optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask),
    )
    return tx, schedule
