"""cuDNN's fused attention for the masks it takes: the first choice of `auto` and `flash` on NVIDIA GPUs.

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads, Dh head width.

What `jax.nn.dot_product_attention(implementation='cudnn')` takes, as read in
`jax/_src/cudnn/fused_attention_stablehlo.py` (unchanged from jax 0.10.2 to 0.12; checked when it
is traced, except where said):

- bfloat16 or float16 q, k, v; a head width that is a multiple of 8, at most 128 (256 on Hopper);
- of the mask description: nothing; causal with L = S (its causal mask is top-left); causal with a
  window (`local_window_size` with `is_causal`: without it cuDNN attends to the future, jax-ml/jax
  PR #39576); key padding as sequence lengths, which say that each row's valid keys come first. That
  is checked on the device (`jax.lax.cond`): a batch where it does not hold (or where a row has no
  valid key) runs the `otherwise` kernel. Documents (cuDNN's `q_offsets` are outside jax.nn's API,
  and wrong with grouped heads before jax 0.11.1), globals, block-sparse tables, a bias and explicit
  positions are the kernel's;
- under a gradient, even lengths: an odd L or S (ViT's 197) is padded by one key and query, which
  the sequence lengths leave out and the output drops;
- the batch alone split over devices (its partitioning rejects split heads and lengths);
- a plan cuDNN can build, which shows only when XLA compiles it on the GPU (CUDA 13 builds had none
  for some calls: jax-ml/jax#32430): each call's shapes are compiled once, forward and backward,
  before they are used (`_plan_refusal`), so a call cuDNN cannot plan runs the kernel instead of
  failing the step.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from transformer import sharding
from transformer.layers.attention.masks import Mask
from transformer.sharding import HEADS, LENGTH

HALF = (jnp.bfloat16, jnp.float16)


def available() -> bool:
    """Whether this process computes on a GPU with cuDNN's attention (the CUDA plugin's cuDNN)."""
    if jax.default_backend() != "gpu":
        return False
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
    except Exception:  # no CUDA plugin, a ROCm build, or a jax that moved it
        return False
    return True


def head_limit() -> int:
    """The widest head cuDNN's flash attention takes on this GPU: 256 from Hopper (compute 9.0) on."""
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return 256 if float(capability) >= 9.0 else 128


def refusal(q: jax.Array, k: jax.Array, mask: Mask) -> str | None:
    """Why cuDNN does not take this call (None: it does); q [B, L, H, Dh], k [B, S, K, Dh]."""
    if not available():
        return "no cuDNN here"
    reason = _shape_refusal(q, k, mask, head_limit())
    return reason or _split_refusal() or _plan_refusal(q.shape, k.shape, q.dtype.name, mask.causal, _window(mask),
                                                       mask.key_valid is not None)


def _shape_refusal(q: jax.Array, k: jax.Array, mask: Mask, widest: int) -> str | None:
    """What of the dtypes, shapes and mask cuDNN's flash attention refuses (None: nothing)."""
    if q.dtype not in HALF or k.dtype != q.dtype:
        return f"cuDNN's flash attention needs bfloat16 or float16, not {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > widest:
        return f"cuDNN needs a head width that is a multiple of 8 and at most {widest}, not {q.shape[-1]}"
    if (mask.segments is not None or mask.global_tokens or mask.sparse is not None or mask.bias is not None
            or mask.query_positions is not None or mask.key_positions is not None):
        return ("the mask has documents, globals, a block-sparse pattern, a position bias (model.positions=alibi, "
                "T5's relative) or explicit positions")
    if mask.causal and q.shape[1] != k.shape[1]:
        return "cuDNN's causal mask is top-left: L != S needs the bottom-right one"
    if mask.window is not None and not mask.causal:
        return "cuDNN takes a window only with causal masking (jax-ml/jax PR #39576)"
    return None


def _split_refusal() -> str | None:
    """Whether the mesh the step is traced on splits the heads or the length (cuDNN's partitioning
    takes a split batch only)."""
    active = sharding.active()
    if active is None:
        return None
    mesh, rules = active
    spec = sharding.mesh_spec((HEADS, LENGTH), rules)
    axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    if any(mesh.shape[a] > 1 for a in axes):
        return "the mesh splits the heads or the length, and cuDNN's partitioning splits the batch only"
    return None


def _window(mask: Mask) -> tuple[int, int] | None:
    """The window as cuDNN takes it: (left, 0) under causal masking (a right window adds nothing then)."""
    return None if mask.window is None else (mask.window[0], 0)


@functools.cache
def _plan_refusal(q_shape, k_shape, dtype: str, causal: bool, window, padded: bool) -> str | None:
    """Compiles the call cuDNN would run for these shapes, forward and backward, once per process."""
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    kv = jax.ShapeDtypeStruct(k_shape, dtype)
    lengths = jax.ShapeDtypeStruct(q_shape[:1], jnp.int32) if padded else None
    loss = lambda q, k, v, n: jnp.sum(_call(q, k, v, causal, window, n).astype(jnp.float32))
    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, lengths).compile()
    except Exception as error:  # cuDNN's frontend and XLA raise several kinds
        return f"cuDNN could not build a plan for q {q_shape}, k {k_shape} ({type(error).__name__}: " \
               f"{str(error).splitlines()[0][:200] if str(error) else ''})"
    return None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, otherwise: Callable) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh] by cuDNN, for a call `refusal` accepts;
    `otherwise(q, k, v, mask)` where the batch's valid keys do not come first in every row."""
    window = _window(mask)
    if mask.key_valid is None:
        return _call(q, k, v, mask.causal, window, None)
    lengths = jnp.sum(mask.key_valid, -1, dtype=jnp.int32)  # [B]
    prefix = jnp.all(mask.key_valid == (jnp.arange(k.shape[1]) < lengths[:, None])) & jnp.all(lengths > 0)
    return jax.lax.cond(prefix, lambda: _call(q, k, v, mask.causal, window, lengths),
                        lambda: otherwise(q, k, v, mask))


def _call(q, k, v, causal: bool, window, lengths) -> jax.Array:
    """jax.nn's cuDNN call, odd lengths padded by one position that `lengths` [B] (default S) leaves out."""
    length, source_length = q.shape[1], k.shape[1]
    odd_q, odd_k = length % 2, source_length % 2
    if odd_q or odd_k:
        pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))
        q, k, v = pad(q, odd_q), pad(k, odd_k), pad(v, odd_k)
        lengths = jnp.full(q.shape[:1], source_length, jnp.int32) if lengths is None else lengths
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, key_value_seq_lengths=lengths,
                                       local_window_size=window, implementation="cudnn")
    return out[:, :length]
