"""Splash attention (Pallas, TPU) for the masks it takes: `flash`'s kernel on TPU.

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads, G = H // K, Dh head width.

Splash takes nothing, plain causal (L = S) and any window (its `LocalMask`), with L and S multiples
of 128; grouped kv heads run its multi-query kernel once per kv head. `interpret=True` runs the
Pallas kernel anywhere, slowly (the tests).
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from transformer.layers.attention.masks import Mask


def refusal(q: jax.Array, k: jax.Array, mask: Mask) -> str | None:
    """Why splash does not take this call (None: it does)."""
    windowed = mask.window is not None and not mask.global_tokens and mask.sparse is None
    if not (mask.replace(window=None) if windowed else mask).allows_all:
        return ("the mask has padding, segments, globals, a block-sparse pattern, a position bias "
                "(model.positions=alibi, T5's relative) or explicit positions")
    if mask.causal and q.shape[1] != k.shape[1]:
        return "splash's causal mask is top-left: L != S needs the bottom-right one"
    if q.shape[1] % 128 or k.shape[1] % 128:
        return f"splash attention needs L and S multiples of 128, not {q.shape[1]} and {k.shape[1]}"
    return None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, interpret: bool = False) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh], for a mask `refusal` accepts."""
    b, length, h, dh = q.shape
    source_length, kv_heads = k.shape[1], k.shape[2]
    shape = (length, source_length)
    if mask.window is not None:
        left, right = mask.window
        one = splash_mask.LocalMask(shape, (left, 0 if mask.causal else right), offset=0)
    else:
        one = splash_mask.CausalMask(shape) if mask.causal else splash_mask.FullMask(shape)
    kernel = splash_kernel.make_splash_mqa_single_device(splash_mask.MultiHeadMask([one] * (h // kv_heads)),
                                                         interpret=interpret)
    q = (q * jnp.asarray(dh**-0.5, q.dtype)).reshape(b, length, kv_heads, h // kv_heads, dh)
    out = jax.vmap(jax.vmap(kernel))(q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3),
                                     v.transpose(0, 2, 1, 3))  # [B, K, G, L, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, length, h, dh)
