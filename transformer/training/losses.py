"""The one loss: cross entropy in float32 as a (sum, weight) pair, which every task divides.

Glossary of shapes: V classes (the vocabulary, or a classifier's labels); `...` any leading
dimensions (batch, length). Targets are integer ids [...] or, for soft targets (mixup,
distillation), distributions [..., V]. The per-item cross entropy and a language model's
blockwise head and loss are layers (`transformer.layers.cross_entropy`): the models use them too.
"""

import jax
import jax.numpy as jnp

from transformer.layers.cross_entropy import token_losses


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None,
                  smoothing: float = 0.0, fused_backward: bool = False) -> tuple[jax.Array, jax.Array]:
    """(sum of the weighted per-item losses, sum of the weights), both float32 scalars.

    `weights` [...] (bool or float; None: every item counts 1) leaves out padding, unmasked
    tokens and the like. The mean is sum / weight (`mean`); the weight is also what gradient
    accumulation needs to weigh a microbatch (`Task.loss_weights`). `fused_backward`: as in
    `token_losses`.
    """
    return weighted_sum(token_losses(logits, targets, smoothing, fused_backward), weights)


def weighted_sum(losses: jax.Array, weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-item losses [...] -> (sum of the weighted losses, sum of the weights): `cross_entropy`'s pair."""
    if weights is None:
        return losses.sum(), jnp.asarray(losses.size, jnp.float32)
    weights = weights.astype(jnp.float32)
    return (losses * weights).sum(), weights.sum()


def mean(total: tuple[jax.Array, jax.Array]) -> jax.Array:
    """sum / weight of a (sum, weight) pair; 0 where nothing counts."""
    loss_sum, weight = total
    return loss_sum / jnp.maximum(weight, 1.0)
