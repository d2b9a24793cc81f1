"""The one loss: cross entropy in float32 as a (sum, weight) pair, which every task divides, and the
terms a language model's loss may add to it.

Glossary of shapes: V classes (the vocabulary, or a classifier's labels); `...` any leading
dimensions (batch, length). Targets are integer ids [...] or, for soft targets (mixup,
distillation), distributions [..., V]. The per-item cross entropy and a language model's
blockwise head and loss are layers (`transformer.layers.cross_entropy`): the models use them too.

A task's loss is a sum of named terms, each a mean over its items (`total`); the language-model
tasks (lm, mlm, seq2seq) add PaLM's z-loss, config.train.z_loss x mean(log Z^2) over the tokens
of the cross entropy, log Z = logsumexp(logits) (Chowdhery et al. 2022), where that weight is > 0.
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


def z_loss(log_z: jax.Array, weights: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """log Z [...] (each item's logsumexp of its logits: `cross_entropy.log_partition`) -> the (sum, weight)
    pair of log Z^2: PaLM's z-loss, which keeps the softmax's normaliser near 1."""
    return weighted_sum(jnp.square(log_z), weights)


def z_loss_weight(config) -> float:
    """config.train.z_loss (0: none)."""
    return config.train.z_loss


def total(terms: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the loss, its metrics) of named mean terms: their sum, logged as 'loss' beside each term; a single
    term is 'loss' alone. `term_weights` names a task's `loss_weights` alike."""
    loss = sum(terms.values())
    return loss, {"loss": loss, **terms} if len(terms) > 1 else {"loss": loss}


def term_weights(weights: dict, config) -> dict:
    """{term: its items} of the terms of `total` (`weights`, the z-loss's added: the items of the first
    term, a language model's cross entropy, where config.train.z_loss > 0), a single term's as 'loss'."""
    if z_loss_weight(config):
        weights = {**weights, "z_loss": next(iter(weights.values()))}
    return weights if len(weights) > 1 else {"loss": next(iter(weights.values()))}
