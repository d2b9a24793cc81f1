"""The dense reference: attention over the whole [L, S] mask, which every other implementation is
tested against (forward and gradients), and the one that can return its softmax weights.

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads, Dh head width.
"""

import jax
import jax.numpy as jnp

from transformer.layers.attention import xla
from transformer.layers.attention.masks import Mask


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask) -> tuple[jax.Array, jax.Array]:
    """The `dense` implementation: q [B, L, H, Dh], k, v [B, S, K, Dh] -> (out [B, L, H, Dh], weights
    [B, H, L, S] float32) with out = weights @ v; a query that may see no key has weights 0."""
    b, length, h, _ = q.shape
    source_length = k.shape[1]
    allowed = mask.dense(length, source_length)  # [B | 1, 1, L, S]
    bias = mask.bias_block(*mask.positions(length, source_length))  # [H, L, S] | None
    sees = xla.group_heads(jnp.any(allowed, -1, keepdims=True), h, k.shape[2])  # [B | 1, 1, 1, L, 1]
    weights = xla.attention_weights(q, k, allowed, bias) * sees  # [B, K, G, L, S]
    return xla.weighted_values(weights, v), weights.reshape(b, h, length, source_length)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """`dense_attention`'s output, with the signature of every implementation (`block` unused)."""
    return dense_attention(q, k, v, mask)[0]
