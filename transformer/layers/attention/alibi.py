"""ALiBi (Press et al., 2022; BLOOM's positions): attention biased by a per-head linear penalty on distance.

Glossary of shapes: H heads, bq queries and bk keys of a block.

Head h adds -slope_h x (query position - key position) to its scores, so a key d positions back
weighs exp(-slope_h d) times what it would weigh at distance 0, whatever the content. There are no
position embeddings. The slopes are BLOOM's for any head count (transformers'
`build_alibi_tensor`): for H a power of two the geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^-8;
otherwise those of the largest power of two n below H, followed by every other slope of 2n's
sequence. BLOOM adds slope x key position instead, which differs by a constant per query and
leaves the softmax unchanged; the distance here keeps the bias small at any position and, without
a causal mask, makes it symmetric.

The bias is a `Bias` of the mask description with the slopes [H] as its parameters, split with the
heads (`Bias.per_head`): where the tensor axis holds some of the heads, each device computes its own
heads' bias block from its own slopes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer.layers.attention.masks import Bias


def slopes(num_heads: int) -> np.ndarray:
    """[H] float32: BLOOM's slopes for `num_heads` heads."""
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, not {num_heads}")
    n = 2 ** math.floor(math.log2(num_heads))
    out = _powers(n, np.arange(1, n + 1))
    if n != num_heads:
        out = np.concatenate([out, _powers(2 * n, np.arange(1, 2 * (num_heads - n), 2))])
    return out


def _powers(n: int, powers: np.ndarray) -> np.ndarray:
    """(2^(-8 / n))^powers in float32 from a float32 base, as BLOOM computes them (to within an ulp)."""
    return (np.float64(np.float32(2.0 ** (-8.0 / n))) ** powers).astype(np.float32)


def distance_bias(head_slopes: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """The `Bias` function: slopes [H], positions q_pos [bq], k_pos [bk] -> -slope |q - k| [H, bq, bk]."""
    distance = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)  # [bq, bk]
    return -head_slopes.astype(jnp.float32)[:, None, None] * distance[None]


def bias(num_heads: int) -> Bias:
    """The mask's ALiBi bias for `num_heads` heads."""
    return Bias(jnp.asarray(slopes(num_heads)), distance_bias, per_head=True)
