"""Flash attention where the platform has a kernel for the mask: cuDNN through
`jax.nn.dot_product_attention(implementation='cudnn')` on GPU, splash attention (Pallas) on TPU.

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads, G = H // K, Dh head width.

cuDNN's fused kernel takes bfloat16 or float16, and of the mask description: nothing,
plain causal (L = S), and a causal sliding window (`local_window_size=(left, 0)`). A window is
never given to cuDNN without `is_causal=True`: with `is_causal=False` its kernel attended to
the future (jax-ml/jax PR #39576), so a bidirectional window goes blockwise. Splash takes
nothing, plain causal (L = S) and any window (its `LocalMask`), with L and S multiples of 128;
grouped kv heads run its multi-query kernel once per kv head. Any other mask, dtype, shape or
platform (CPU) runs blockwise attention instead, and the process says so once per reason.
"""

import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from transformer.layers import blockwise
from transformer.layers.masks import Mask

_SAID: set[str] = set()
HALF = (jnp.bfloat16, jnp.float16)


def unsupported(q: jax.Array, k: jax.Array, mask: Mask, platform: str | None = None) -> str | None:
    """Why no flash kernel takes this call (None: cuDNN or splash does)."""
    platform = platform or jax.default_backend()
    if platform not in ("gpu", "tpu"):
        return f"no flash kernel on {platform}"
    kernel = "cuDNN" if platform == "gpu" else "splash"
    windowed = mask.window is not None and not mask.global_tokens and mask.sparse is None
    plain = mask.replace(window=None, global_tokens=0) if windowed else mask
    if not plain.allows_all:
        return "the mask has padding, segments, globals, a block-sparse pattern, a bias or explicit positions"
    if mask.causal and q.shape[1] != k.shape[1]:
        return f"{kernel}'s causal mask is top-left: L != S needs the bottom-right one"
    if platform == "tpu":
        if q.shape[1] % 128 or k.shape[1] % 128:
            return f"splash attention needs L and S multiples of 128, not {q.shape[1]} and {k.shape[1]}"
        return None
    if q.dtype not in HALF:
        return f"cuDNN's flash attention needs bfloat16 or float16, not {q.dtype}"
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
    if jax.default_backend() == "tpu":
        return splash(q, k, v, mask)
    window = None if mask.window is None else (mask.window[0], 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, local_window_size=window,
                                        implementation="cudnn")


def splash(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, interpret: bool = False) -> jax.Array:
    """Splash attention (TPU; `interpret=True` runs the Pallas kernel anywhere, slowly, for tests):
    q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh], for a mask `unsupported` accepts on TPU."""
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
