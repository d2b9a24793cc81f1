"""Attention written out for XLA: `auto`'s path on CPU and TPU, and the math of the dense reference.

Glossary of shapes: B batch, L queries, S keys, H heads, K kv heads, G = H // K, Dh head width.

`attention` takes the mask description as XLA arrays: a plain causal mask as the trace-time constant
the query-block paths recognise (`causal_mask`, `dot_product_attention`), any other as its [L, S]
array. That is right for a CPU, where XLA has no fused kernel and the dense array costs little at the
lengths it trains, and not for a GPU, which never runs this file (`platforms.auto`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from transformer.layers import matmul
from transformer.layers.attention.masks import Mask


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh]: `dot_product_attention` over the mask as an
    array; the plain causal mask as the trace-time constant its causal paths recognise. `block` is
    unused: the signature of every implementation."""
    length, source_length = q.shape[1], k.shape[1]
    if mask.is_plain_causal and length == source_length:
        return dot_product_attention(q, k, v, causal_mask(length))
    if mask.allows_all and not mask.causal:
        return dot_product_attention(q, k, v)
    allowed = mask.dense(length, source_length)  # [B | 1, 1, L, S]
    bias = mask.bias_block(*mask.positions(length, source_length))  # [H, L, S] | None
    out = dot_product_attention(q, k, v, allowed, bias)
    return out * jnp.moveaxis(jnp.any(allowed, -1), 1, -1)[..., None].astype(out.dtype)  # sees nothing: 0


def causal_mask(length: int, source_length: int | None = None, offset=0) -> jax.Array:
    """[1, 1, L, S] mask letting query i (at absolute position offset + i) see keys <= it.

    With a Python int offset the mask is a numpy constant, which `dot_product_attention`
    recognises at trace time (lower-triangular: the causal kernels); a traced offset gives
    a traced mask.
    """
    source_length = length if source_length is None else source_length
    xp = np if isinstance(offset, int) else jnp
    q_pos = offset + xp.arange(length)[:, None]
    k_pos = xp.arange(source_length)[None, :]
    return (k_pos <= q_pos)[None, None]


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(Dh) + bias) v, with the logits and softmax in float32.

    Args:
      q: [B, L, H, Dh]; k, v: [B, S, K, Dh] with H a multiple of K (grouped-query).
      mask: boolean, broadcastable to [B, H, L, S]; True = attend.
      bias: additive, broadcastable to [B, H, L, S].
    Returns:
      [B, L, H, Dh] in v's dtype.

    Written out for XLA:CPU (which TPUs run too): q is scaled before the matmul, the mask is not
    broadcast, and a causal mask known at trace time (`causal_mask` with L == S) is computed in
    query blocks that skip the keys each block cannot see. bfloat16/float16 q, k, v take
    `causal_attention` (those blocks with a backward of its own) for that mask and float32
    otherwise; float32 ones keep autodiff's gradient and its summation order, which float32 runs'
    losses are pinned to.
    """
    causal = bias is None and _is_causal(mask, q.shape[1], k.shape[1])
    if matmul.low_precision_on_cpu(q.dtype):
        if causal:
            return causal_attention(q, k, v)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]  # XLA:CPU's batched bf16 dots trail its float32 ones
        return _xla_attention(*f32, mask, bias).astype(v.dtype)
    if causal:
        return jnp.concatenate([_xla_attention(q[:, i:end], k[:, :end], v[:, :end], causal_mask(end - i, end, offset=i))
                                for i, end in _query_blocks(q.shape[1])], axis=1)  # [B, L, H, Dh]
    return _xla_attention(q, k, v, mask, bias)


def _query_blocks(length: int) -> list[tuple[int, int]]:
    """The causal path's query blocks (start, end): queries start..end-1 see keys < end."""
    block = max(64, length // 8)
    return [(i, min(i + block, length)) for i in range(0, length, block)]


@jax.custom_vjp
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, L, K, Dh] -> [B, L, H, Dh] in v's dtype: causal attention in query
    blocks (`_query_blocks`) that skip the keys a block cannot see, logits and softmax in float32.

    Written for XLA:CPU, whose fast dot kernels take row-major operands contracting the lhs's last
    dim only: the heads are moved ahead of the length once (q [B, K, G, L, Dh], k^T [B, K, Dh, L],
    v [B, K, L, Dh]), and the hand-written backward keeps every dot in that form (v^T, k, the
    blocks' q^T and dO^T copied row-major), where autodiff's would contract rows. The blocks'
    probabilities are saved for the backward, as autodiff saves them. `dot_product_attention`
    takes it on CPU for low-precision q, k, v, where it is the faster (experiments/bench/RESULTS.md).
    Any dtype works; in float32 its gradients differ from autodiff's by ~1e-6 relative.
    """
    return _causal_forward(q, k, v)[0]


def _causal_forward(q, k, v):
    """`causal_attention`'s output and the residuals its backward reads."""
    b, length, h, dh = q.shape
    kv_heads = k.shape[2]
    qh = (q * jnp.asarray(dh**-0.5, q.dtype)).reshape(b, length, kv_heads, h // kv_heads, dh)
    qh = qh.transpose(0, 2, 3, 1, 4)  # [B, K, G, L, Dh]
    kt, vh = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [B, K, Dh, L], [B, K, L, Dh]
    outs, probs = [], []
    for i, end in _query_blocks(length):
        logits = jnp.einsum("bkgld,bkds->bkgls", qh[:, :, :, i:end], kt[..., :end], preferred_element_type=jnp.float32)
        sees = np.arange(end)[None, :] <= np.arange(i, end)[:, None]  # [end - i, end]
        p = jax.nn.softmax(jnp.where(sees, logits, jnp.finfo(jnp.float32).min), axis=-1)  # [B, K, G, end - i, end]
        probs.append(p)
        outs.append(jnp.einsum("bkgls,bksd->bkgld", p.astype(v.dtype), vh[:, :, :end],
                               preferred_element_type=jnp.float32))
    out = jnp.concatenate(outs, axis=3)  # [B, K, G, L, Dh] float32
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(v.dtype), (qh, kt, vh, out, probs)


def _causal_backward(residuals, g):
    """dS = P * (dO V^T - rowsum(dO * O)); dQ = dS K, dK^T = sum over blocks of Q^T dS, dV^T of dO^T P."""
    qh, kt, vh, out, probs = residuals
    b, kv_heads, groups, length, dh = qh.shape
    do = g.reshape(b, length, kv_heads, groups, dh).transpose(0, 2, 3, 1, 4).astype(jnp.float32)  # [B, K, G, L, Dh]
    delta = jnp.sum(do * out, axis=-1, keepdims=True)  # [B, K, G, L, 1]
    transposed = lambda x: matmul.row_major(jnp.swapaxes(x, -1, -2))
    vt, k_rows = transposed(vh), transposed(kt)  # [B, K, Dh, L], [B, K, L, Dh]
    dq, dkt, dvt = [], jnp.zeros(kt.shape, jnp.float32), jnp.zeros(kt.shape, jnp.float32)
    for (i, end), p in zip(_query_blocks(length), probs):
        do_i = do[:, :, :, i:end].astype(vh.dtype)  # [B, K, G, end - i, Dh]
        dp = jnp.einsum("bkgld,bkds->bkgls", do_i, vt[..., :end], preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, :, :, i:end])  # [B, K, G, end - i, end]
        dq.append(jnp.einsum("bkgls,bksd->bkgld", ds.astype(qh.dtype), k_rows[:, :, :end],
                             preferred_element_type=jnp.float32))
        dvt = dvt.at[..., :end].add(jnp.einsum("bkgdl,bkgls->bkds", transposed(do_i), p.astype(vh.dtype),
                                               preferred_element_type=jnp.float32))
        dkt = dkt.at[..., :end].add(jnp.einsum("bkgdl,bkgls->bkds", transposed(qh[:, :, :, i:end]), ds.astype(qh.dtype),
                                               preferred_element_type=jnp.float32))
    dq = (jnp.concatenate(dq, axis=3) * dh**-0.5).transpose(0, 3, 1, 2, 4).reshape(b, length, kv_heads * groups, dh)
    return dq.astype(qh.dtype), dkt.transpose(0, 3, 1, 2).astype(kt.dtype), dvt.transpose(0, 3, 1, 2).astype(vh.dtype)


causal_attention.defvjp(_causal_forward, _causal_backward)


def _is_causal(mask, length: int, source_length: int) -> bool:
    """Whether `mask` is a trace-time constant equal to causal_mask(length) (square, offset 0)."""
    if not isinstance(mask, np.ndarray) or length != source_length or mask.shape[-2:] != (length, length):
        return False
    return bool(np.all(mask == np.tril(np.ones((length, length), bool))))


def _xla_attention(q, k, v, mask=None, bias=None) -> jax.Array:
    """The XLA formulation: q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh]."""
    return weighted_values(attention_weights(q, k, mask, bias), v)


def attention_weights(q, k, mask=None, bias=None) -> jax.Array:
    """q [B, L, H, Dh], k [B, S, K, Dh] -> softmax(q k^T / sqrt(Dh) + bias) [B, K, G, L, S] in float32."""
    b, length, h, dh = q.shape
    kv_heads = k.shape[2]
    q = (q * jnp.asarray(dh**-0.5, q.dtype)).reshape(b, length, kv_heads, h // kv_heads, dh)  # [B, L, K, G, Dh]
    logits = jnp.einsum("blkgd,bskd->bkgls", q, k, preferred_element_type=jnp.float32)  # [B, K, G, L, S]
    if bias is not None:
        logits = logits + group_heads(bias, h, kv_heads)
    if mask is not None:
        logits = jnp.where(group_heads(mask, h, kv_heads), logits, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)


def weighted_values(weights, v) -> jax.Array:
    """weights [B, K, G, L, S], v [B, S, K, Dh] -> weights @ v [B, L, H, Dh] in v's dtype."""
    b, kv_heads, groups, length, _ = weights.shape
    out = jnp.einsum("bkgls,bskd->blkgd", weights.astype(v.dtype), v)  # [B, L, K, G, Dh]
    return out.reshape(b, length, kv_heads * groups, v.shape[-1])


def group_heads(x: jax.Array, heads: int, kv_heads: int) -> jax.Array:
    """Broadcastable to [B, H, L, S] -> broadcastable to [B, K, G, L, S] (size-1 dims kept, not copied)."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)  # [B|1, H|1, L|1, S|1]
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], kv_heads, heads // kv_heads, *x.shape[2:])
