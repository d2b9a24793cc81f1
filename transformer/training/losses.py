"""The one loss: cross entropy in float32 as a (sum, weight) pair, which every task divides.

Glossary of shapes: V classes (the vocabulary, or a classifier's labels); `...` any leading
dimensions (batch, length). Targets are integer ids [...] or, for soft targets (mixup,
distillation), distributions [..., V].
"""

import jax
import jax.numpy as jnp
import optax


def token_losses(logits: jax.Array, targets: jax.Array, smoothing: float = 0.0) -> jax.Array:
    """Per-item cross entropy in float32: logits [..., V], targets [...] ids or [..., V] -> [...].

    `smoothing` mixes the targets with the uniform distribution (label smoothing).
    """
    logits = logits.astype(jnp.float32)
    if targets.ndim == logits.ndim:
        return optax.softmax_cross_entropy(logits, optax.smooth_labels(targets.astype(jnp.float32), smoothing))
    if smoothing:
        return optax.softmax_cross_entropy(
            logits, optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1]), smoothing))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None,
                  smoothing: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(sum of the weighted per-item losses, sum of the weights), both float32 scalars.

    `weights` [...] (bool or float; None: every item counts 1) leaves out padding, unmasked
    tokens and the like. The mean is sum / weight (`mean`); the weight is also what gradient
    accumulation needs to weigh a microbatch (`Task.loss_weights`).
    """
    losses = token_losses(logits, targets, smoothing)
    if weights is None:
        return losses.sum(), jnp.asarray(losses.size, jnp.float32)
    weights = weights.astype(jnp.float32)
    return (losses * weights).sum(), weights.sum()


def mean(total: tuple[jax.Array, jax.Array]) -> jax.Array:
    """sum / weight of a (sum, weight) pair; 0 where nothing counts."""
    loss_sum, weight = total
    return loss_sum / jnp.maximum(weight, 1.0)
