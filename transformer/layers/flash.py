"""Flash attention where the platform has a kernel for the mask: cuDNN through
`jax.nn.dot_product_attention(implementation='cudnn')` on GPU.

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads, Dh head width.

cuDNN's fused kernel takes bfloat16 or float16, and of the mask description: nothing,
plain causal (L = S), and a causal sliding window (`local_window_size=(left, 0)`). Any other
mask, dtype or platform (CPU; TPU, whose splash kernel is not wired in yet) runs blockwise
attention instead, and the process says so once per reason. A window is never given to cuDNN
without `is_causal=True`: with `is_causal=False` its kernel attended to the future
(jax-ml/jax PR #39576), so a bidirectional window always goes blockwise.
"""

import sys

import jax
import jax.numpy as jnp

from transformer.layers import blockwise
from transformer.layers.masks import Mask

_SAID: set[str] = set()
HALF = (jnp.bfloat16, jnp.float16)


def unsupported(q: jax.Array, k: jax.Array, mask: Mask, platform: str | None = None) -> str | None:
    """Why no flash kernel takes this call (None: cuDNN does)."""
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return f"no flash kernel on {platform}"
    if q.dtype not in HALF:
        return f"cuDNN's flash attention needs bfloat16 or float16, not {q.dtype}"
    windowed = mask.window is not None and not mask.global_tokens and mask.sparse is None
    plain = mask.replace(window=None, global_tokens=0) if windowed else mask
    if not plain.allows_all:
        return "the mask has padding, segments, globals, a block-sparse pattern, a bias or explicit positions"
    if mask.causal and q.shape[1] != k.shape[1]:
        return "cuDNN's causal mask is top-left: L != S needs the bottom-right one"
    if windowed and not (mask.causal and mask.window[1] == 0):
        return "cuDNN takes a window only with causal masking (jax-ml/jax PR #39576)"
    return None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh]: cuDNN's kernel, or blockwise (said once)."""
    reason = unsupported(q, k, mask)
    if reason is not None:
        if reason not in _SAID:
            _SAID.add(reason)
            print(f"model.attention=flash: {reason}; using blockwise attention", file=sys.stderr)
        return blockwise.attention(q, k, v, mask, block)
    window = None if mask.window is None else (mask.window[0], 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, local_window_size=window,
                                        implementation="cudnn")
