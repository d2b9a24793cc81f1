"""Attention: one function over a mask description, its implementations, and MultiHeadAttention.

Glossary of shapes:
  B batch, L query length, S key/value length, D model width,
  H query heads, K key/value heads (H % K == 0), G = H // K, Dh head width, W window.

`attend(q, k, v, mask, implementation)` is the one attention every layer calls; the mask is
a `masks.Mask` description (causal, padding, documents, window, globals, block-sparse,
bias) and the implementation one of IMPLEMENTATIONS:

  auto       the fused path: `jax.nn.dot_product_attention` on GPU (cuDNN where it applies),
             on CPU/TPU the XLA formulation below, with a plain causal mask in query blocks
  dense      plain XLA over the whole [L, S] mask: the reference every other is tested against
  blockwise  `layers/blockwise.py`: memory O(L x block), masked-out blocks skipped
  ring       `layers/ring.py`: the sequence split over the mesh's context axis, keys and values
             passed around it (blockwise where the axis has one device)
  flash      `layers/flash.py`: cuDNN (GPU) or splash (TPU) for the masks they take, else blockwise

A query that may see no key gets output 0 (and gradient 0) in every implementation.
`dot_product_attention`, the fused path, takes the mask as an array: boolean, True where
attention is allowed, broadcastable to [B, H, L, S].
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import sharding
from transformer.sharding import BATCH, EMBED, HEAD_DIM, HEADS, LENGTH
from transformer.layers import blockwise, embeddings, flash, matmul, ring
from transformer.layers.masks import FAR, Mask

Dtype = jnp.dtype


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask | None = None, implementation: str = "auto",
           block: int = 512) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh]: attention over the pairs `mask` allows."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"choose one of {', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[implementation](q, k, v, Mask() if mask is None else mask, block)


def auto_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask, block: int = 512) -> jax.Array:
    """The fused path (`dot_product_attention`) over the mask as an array; the plain causal mask as the
    trace-time constant its causal kernels recognise. `block` is unused: the signature of every
    implementation."""
    length, source_length = q.shape[1], k.shape[1]
    if mask.is_plain_causal and length == source_length:
        return dot_product_attention(q, k, v, causal_mask(length))
    if mask.allows_all and not mask.causal:
        return dot_product_attention(q, k, v)
    allowed = mask.dense(length, source_length)  # [B | 1, 1, L, S]
    bias = mask.bias_block(*mask.positions(length, source_length))  # [H, L, S] | None
    out = dot_product_attention(q, k, v, allowed, bias)
    return out * jnp.moveaxis(jnp.any(allowed, -1), 1, -1)[..., None].astype(out.dtype)  # sees nothing: 0


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask) -> tuple[jax.Array, jax.Array]:
    """The `dense` implementation: q [B, L, H, Dh], k, v [B, S, K, Dh] -> (out [B, L, H, Dh], weights
    [B, H, L, S] float32) with out = weights @ v; a query that may see no key has weights 0."""
    b, length, h, _ = q.shape
    source_length = k.shape[1]
    allowed = mask.dense(length, source_length)  # [B | 1, 1, L, S]
    bias = mask.bias_block(*mask.positions(length, source_length))  # [H, L, S] | None
    sees = _group_heads(jnp.any(allowed, -1, keepdims=True), h, k.shape[2])  # [B | 1, 1, 1, L, 1]
    weights = _attention_weights(q, k, allowed, bias) * sees  # [B, K, G, L, S]
    return _weighted_values(weights, v), weights.reshape(b, h, length, source_length)


# config.model.attention -> fn(q, k, v, mask, block)
IMPLEMENTATIONS = {
    "auto": auto_attention,
    "dense": lambda q, k, v, mask, block: dense_attention(q, k, v, mask)[0],
    "blockwise": blockwise.attention,
    "ring": ring.attention,
    "flash": flash.attention,
}


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

    On GPU this is `jax.nn.dot_product_attention` (cuDNN's fused kernels where dtype and
    shapes allow, XLA otherwise). Elsewhere it is written out for XLA, which on CPU runs
    faster than jax.nn's XLA path: q is scaled before the matmul, the mask is not
    broadcast, and a causal mask known at trace time (`causal_mask` with L == S) is computed
    in query blocks that skip the keys each block cannot see. On CPU, bfloat16/float16 q, k, v
    take `causal_attention` (those blocks with a backward of its own) for that mask and float32
    otherwise; float32 ones keep autodiff's gradient, whose summation order float32 runs are
    pinned to (issue 21: the tiny preset's first 100 steps within 1e-6).
    """
    causal = bias is None and _is_causal(mask, q.shape[1], k.shape[1])
    if jax.default_backend() == "gpu":
        return _jax_nn_attention(q, k, v, None if causal else mask, bias, is_causal=causal)
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
    takes it on CPU for low-precision q, k, v (issue 21, a 2-core Zen 5: a bf16 layer's attention
    forward and backward 30 -> 18 ms at batch 16 x 256, 4 heads of 64; experiments/bench/RESULTS.md).
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
    return _weighted_values(_attention_weights(q, k, mask, bias), v)


def _attention_weights(q, k, mask=None, bias=None) -> jax.Array:
    """q [B, L, H, Dh], k [B, S, K, Dh] -> softmax(q k^T / sqrt(Dh) + bias) [B, K, G, L, S] in float32."""
    b, l, h, dh = q.shape
    kv_heads = k.shape[2]
    q = (q * jnp.asarray(dh**-0.5, q.dtype)).reshape(b, l, kv_heads, h // kv_heads, dh)  # [B, L, K, G, Dh]
    logits = jnp.einsum("blkgd,bskd->bkgls", q, k, preferred_element_type=jnp.float32)  # [B, K, G, L, S]
    if bias is not None:
        logits = logits + _group_heads(bias, h, kv_heads)
    if mask is not None:
        logits = jnp.where(_group_heads(mask, h, kv_heads), logits, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)


def _weighted_values(weights, v) -> jax.Array:
    """weights [B, K, G, L, S], v [B, S, K, Dh] -> weights @ v [B, L, H, Dh] in v's dtype."""
    b, kv_heads, groups, l, _ = weights.shape
    out = jnp.einsum("bkgls,bskd->blkgd", weights.astype(v.dtype), v)  # [B, L, K, G, Dh]
    return out.reshape(b, l, kv_heads * groups, v.shape[-1])


def _group_heads(x: jax.Array, heads: int, kv_heads: int) -> jax.Array:
    """Broadcastable to [B, H, L, S] -> broadcastable to [B, K, G, L, S] (size-1 dims kept, not copied)."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)  # [B|1, H|1, L|1, S|1]
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], kv_heads, heads // kv_heads, *x.shape[2:])


def _jax_nn_attention(q, k, v, mask=None, bias=None, is_causal: bool = False) -> jax.Array:
    """`jax.nn.dot_product_attention` (cuDNN on GPU when it applies) with 4-d mask and bias."""
    as_4d = lambda x: None if x is None else jnp.asarray(x).reshape((1,) * (4 - jnp.ndim(x)) + jnp.shape(x))
    return jax.nn.dot_product_attention(q, k, v, bias=as_4d(bias), mask=as_4d(mask), is_causal=is_causal)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with grouped kv heads, rotary positions (`rope`) and a kv cache.

    `use_bias` gives every projection a bias, `qkv_bias` the query, key and value ones only (Qwen2).

    Call with `inputs_q` [B, L, D], for cross-attention `inputs_kv` [B, S, D], and a `Mask`
    description. With `decode=True`, self-attention keeps keys and values in the 'cache'
    collection, the queries sitting at positions cache_index .. cache_index + L - 1: a cache
    of `cache_length` positions, or, when the mask has a sliding window, a ring buffer of
    `cache_length` >= W slots that holds the last keys only (memory W however long the
    decoding). Cross-attention projects `inputs_kv` on the first decode call and reuses
    those keys and values from the cache afterwards. With implementation 'dense' the softmax
    weights [B, H, L, S] are sown as 'intermediates'/'attention_weights', kept only where the
    caller makes 'intermediates' mutable (transformer.probe does).
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    use_bias: bool = True
    qkv_bias: bool = False
    rope: embeddings.Rope | None = None
    dropout_rate: float = 0.0
    cache_length: int = 0
    implementation: str = "auto"
    block_size: int = 512
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Callable = nn.initializers.normal(0.02)
    out_kernel_init: Callable | None = None

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: jax.Array | None = None,
        mask: Mask | None = None,
        *,
        positions: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
    ) -> jax.Array:
        kv_heads = self.num_kv_heads or self.num_heads
        if self.num_heads % kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={kv_heads}")
        mask = Mask() if mask is None else mask
        q = self._project("query", inputs_q, self.num_heads)  # [B, L, H, Dh]
        offset = 0
        if decode and inputs_kv is not None:
            k, v = self._source_cache(inputs_kv, kv_heads)
        elif decode:
            k, v, offset, mask = self._update_cache(self._project("key", inputs_q, kv_heads),
                                                    self._project("value", inputs_q, kv_heads), mask)
        else:
            k, v = self._keys_values(inputs_q if inputs_kv is None else inputs_kv, kv_heads, positions)
        if self.rope:
            q_positions = offset + jnp.arange(q.shape[1]) if positions is None else positions
            q = embeddings.apply_rotary(q, q_positions, self.rope)

        if self.implementation == "dense":
            out, weights = dense_attention(q, k, v, mask)  # [B, L, H, Dh], [B, H, L, S]
            self.sow("intermediates", "attention_weights", weights)
        else:
            out = attend(q, k, v, mask, self.implementation, self.block_size)  # [B, L, H, Dh]
        out = nn.Dropout(self.dropout_rate)(out, deterministic=deterministic)
        return nn.DenseGeneral(
            inputs_q.shape[-1],
            axis=(-2, -1),
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            dot_general=matmul.dot_general_for(self.dtype),
            kernel_init=nn.with_logical_partitioning(
                self.out_kernel_init or self.kernel_init, (HEADS, HEAD_DIM, EMBED)
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (EMBED,)),
            name="out",
        )(out)

    def _project(self, name: str, x: jax.Array, heads: int) -> jax.Array:
        """x [B, L, D] -> [B, L, heads, Dh] in the compute dtype (the CPU's low-precision dots return
        float32), split over the mesh's tensor axis by head."""
        y = nn.DenseGeneral(
            (heads, self.head_dim),
            use_bias=self.use_bias or self.qkv_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            dot_general=matmul.dot_general_for(self.dtype),
            kernel_init=nn.with_logical_partitioning(self.kernel_init, (EMBED, HEADS, HEAD_DIM)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (HEADS, HEAD_DIM)),
            name=name,
        )(x)
        return sharding.constrain(y.astype(self.dtype), (BATCH, LENGTH, HEADS, HEAD_DIM))

    def _keys_values(self, inputs_kv: jax.Array, kv_heads: int,
                     positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """inputs_kv [B, S, D] -> k, v [B, S, K, Dh] (keys rotated at `positions`, default 0..S-1)."""
        k = self._project("key", inputs_kv, kv_heads)  # [B, S, K, Dh]
        v = self._project("value", inputs_kv, kv_heads)  # [B, S, K, Dh]
        if self.rope:
            k = embeddings.apply_rotary(k, jnp.arange(k.shape[1]) if positions is None else positions, self.rope)
        return k, v

    def _source_cache(self, inputs_kv: jax.Array, kv_heads: int) -> tuple[jax.Array, jax.Array]:
        """Cross-attention k, v [B, S, K, Dh], projected on the first decode call only.

        The first call (a cache without 'source_key') stores them in the 'cache'
        collection; later calls read them back and ignore `inputs_kv`.
        """
        if not self.has_variable("cache", "source_key"):
            k, v = self._keys_values(inputs_kv, kv_heads)
            self.put_variable("cache", "source_key", k)
            self.put_variable("cache", "source_value", v)
        return self.get_variable("cache", "source_key"), self.get_variable("cache", "source_value")

    def _update_cache(self, k: jax.Array, v: jax.Array, mask: Mask):
        """Writes k, v [B, L, K, Dh] into the cache; returns the keys and values to attend to, the
        queries' first position and `mask` with the queries' and keys' positions.

        Rotary positions are applied to keys before they are cached, so cached keys never need
        rotating again. Without a window the keys are the whole cache (slot = position); with one,
        the ring's previous keys and the new ones (slot = position mod its size), so a prefill
        longer than the ring still sees its own window.
        """
        b, l, kv_heads, dh = k.shape
        if not self.cache_length:
            raise ValueError("decode=True needs cache_length > 0")
        if mask.window is not None and self.cache_length < mask.window[0] + 1:
            raise ValueError(f"a window of {mask.window[0] + 1} keys needs cache_length >= it, not {self.cache_length}")
        shape = (b, kv_heads, self.cache_length, dh)  # head-major: the layout the attention dots read
        cached_k = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        i = index.value
        positions = i + jnp.arange(l)  # [L]
        if self.rope:
            k = embeddings.apply_rotary(k, positions, self.rope)
        index.value = i + l
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, L, Dh]
        if mask.window is None:
            cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, 0, i, 0))
            cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, 0, i, 0))
            return jnp.swapaxes(cached_k.value, 1, 2), jnp.swapaxes(cached_v.value, 1, 2), i, mask.replace(
                causal=True, query_positions=positions, key_positions=jnp.arange(self.cache_length))
        cached_pos = self.variable("cache", "cached_position", jnp.full, (b, self.cache_length), FAR, jnp.int32)
        keys, values = jnp.concatenate([cached_k.value, k], 2), jnp.concatenate([cached_v.value, v], 2)  # [B, K, W + L, Dh]
        filled = jnp.arange(self.cache_length) < i  # slots fill in order before the ring wraps; a zeroed cache works
        key_positions = jnp.concatenate([jnp.where(filled, cached_pos.value[0], FAR), positions])  # [W + L]
        kept = min(l, self.cache_length)
        slots = positions[-kept:] % self.cache_length
        cached_k.value = cached_k.value.at[:, :, slots].set(k[:, :, -kept:])
        cached_v.value = cached_v.value.at[:, :, slots].set(v[:, :, -kept:])
        cached_pos.value = cached_pos.value.at[:, slots].set(positions[-kept:])
        keys, values = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)  # [B, W + L, K, Dh]
        return keys, values, i, mask.replace(causal=True, query_positions=positions, key_positions=key_positions)
