"""`attend`, the one attention every layer calls, its implementations by name, and MultiHeadAttention.

Glossary of shapes:
  B batch, L query length, S key/value length, D model width,
  H query heads, K key/value heads (H % K == 0), G = H // K, Dh head width, W window.

`attend(q, k, v, mask, implementation)` takes a `Mask` description (causal, padding, documents,
window, globals, block-sparse, bias) and one of IMPLEMENTATIONS:

  auto       the fused path for the platform (`platforms.auto`): on an NVIDIA GPU cuDNN for the
             masks it takes and the Pallas kernel for every other; on a TPU splash for the masks
             it takes; elsewhere the XLA formulation of `xla.py`
  dense      `dense.py`: plain XLA over the whole [L, S] mask, the reference every other is
             tested against
  blockwise  `blockwise.py`: memory O(L x block), masked-out blocks skipped (on a GPU the
             Pallas kernel runs the blocks: `platforms.BLOCKS`)
  ring       `ring.py`: the sequence split over the mesh's context axis, keys and values passed
             around it, each hop blockwise
  flash      `platforms.flash`: a fused kernel on every platform (GPU and TPU as auto), blockwise
             where there is none

A query that may see no key gets output 0 (and gradient 0) in every implementation.
"""

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import sharding
from transformer.layers import embeddings, matmul
from transformer.layers.attention import blockwise, dense, platforms, ring
from transformer.layers.attention.dense import dense_attention
from transformer.layers.attention.masks import FAR, Mask
from transformer.sharding import BATCH, EMBED, HEAD_DIM, HEADS, LENGTH, NORM

Dtype = jnp.dtype


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask | None = None, implementation: str = "auto",
           block: int = 512) -> jax.Array:
    """q [B, L, H, Dh], k, v [B, S, K, Dh] -> [B, L, H, Dh]: attention over the pairs `mask` allows."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"choose one of {', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[implementation](q, k, v, Mask() if mask is None else mask, block)


# config.model.attention -> fn(q, k, v, mask, block)
IMPLEMENTATIONS = {
    "auto": platforms.auto,
    "dense": dense.attention,
    "blockwise": functools.partial(blockwise.attention, kernel=platforms.BLOCKS),
    "ring": ring.attention,
    "flash": platforms.flash,
}


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with grouped kv heads, rotary positions (`rope`) and a kv cache.

    `use_bias` gives every projection a bias, `qkv_bias` the query, key and value ones only (Qwen2).
    `qk_norm` normalises each head's query and key (RMSNorm over Dh, one [Dh] scale shared by the heads,
    epsilon `norm_epsilon`) before the rotary positions: Qwen3's form (OLMo2 normalises over H x Dh).

    Call with `inputs_q` [B, L, D], for cross-attention `inputs_kv` [B, S, D], and a `Mask`
    description. With `decode=True`, self-attention keeps keys and values in the 'cache'
    collection, the queries sitting at positions cache_index .. cache_index + L - 1: a cache
    of `cache_length` positions, or, when the mask has a sliding window, a ring buffer of
    `cache_length` >= W slots that holds the last keys only (memory W however long the
    decoding). Cross-attention projects `inputs_kv` on the first decode call and reuses
    those keys and values from the cache afterwards. With `attention` 'dense' the softmax
    weights [B, H, L, S] are sown as 'intermediates'/'attention_weights', kept only where the
    caller makes 'intermediates' mutable (transformer.probe does).
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    use_bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_epsilon: float = 1e-5
    rope: embeddings.Rope | None = None
    dropout: float = 0.0
    cache_length: int = 0
    attention: str = "auto"
    attention_block: int = 512
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Callable = nn.initializers.normal(0.02)
    out_kernel_init: Callable | None = None
    scale: float = 0.0  # what q.k is multiplied by (0: 1/sqrt(Dh), every implementation's own)

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
        if self.scale:  # the implementations divide by sqrt(Dh): q carries the rest
            q = q * jnp.asarray(self.scale * math.sqrt(self.head_dim), q.dtype)

        if decode and inputs_kv is None:  # k, v [B, K, S, Dh]: the cache's layout
            out = self._attend_cache(q, k, v, offset + q.shape[1], mask)
        elif self.attention == "dense":
            out, weights = dense_attention(q, k, v, mask)  # [B, L, H, Dh], [B, H, L, S]
            self.sow("intermediates", "attention_weights", weights)
        else:
            out = attend(q, k, v, mask, self.attention, self.attention_block)  # [B, L, H, Dh]
        out = nn.Dropout(self.dropout)(out, deterministic=deterministic)
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
        float32), split over the mesh's tensor axis by head; a query or key normed where `qk_norm`."""
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
        if self.qk_norm and name in ("query", "key"):
            y = nn.RMSNorm(epsilon=self.norm_epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
                           scale_init=nn.with_logical_partitioning(nn.initializers.ones, (NORM,)),
                           name=f"{name}_norm")(y)  # over Dh: [B, L, heads, Dh]
        return sharding.constrain(y.astype(self.dtype), (BATCH, LENGTH, HEADS, HEAD_DIM))

    def _keys_values(self, inputs_kv: jax.Array, kv_heads: int,
                     positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """inputs_kv [B, S, D] -> k, v [B, S, K, Dh] (keys rotated at `positions`, default 0..S-1)."""
        k = self._project("key", inputs_kv, kv_heads)  # [B, S, K, Dh]
        v = self._project("value", inputs_kv, kv_heads)  # [B, S, K, Dh]
        if self.rope:
            k = embeddings.apply_rotary(k, jnp.arange(k.shape[1]) if positions is None else positions, self.rope)
        return k, v

    def _attend_cache(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, mask: Mask) -> jax.Array:
        """q [B, L, H, Dh] over the cache's k, v [B, K, S, Dh], `lengths` keys written -> [B, L, H, Dh]: one
        token under auto or flash by the platform's decode path (`platforms.decode`), else as any call."""
        swapped = lambda q, k, v, lengths, mask: attend(  # noqa: E731
            q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask, self.attention, self.attention_block)
        if self.attention in ("auto", "flash") and q.shape[1] == 1 and mask.window is None:
            return platforms.decode(q, k, v, lengths, mask, otherwise=swapped)
        if self.attention == "dense":
            out, weights = dense_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), mask)
            self.sow("intermediates", "attention_weights", weights)
            return out
        return swapped(q, k, v, lengths, mask)

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
        """Writes k, v [B, L, K, Dh] into the cache; returns the keys and values to attend to ([B, K, S, Dh],
        head-major as the cache keeps them), the queries' first position and `mask` with the queries' and
        keys' positions.

        Rotary positions are applied to keys before they are cached, so cached keys never need
        rotating again. Without a window the keys are the whole cache (slot = position); with one,
        the ring's previous keys and the new ones (slot = position mod its size), so a prefill
        longer than the ring still sees its own window.
        """
        b, length, kv_heads, dh = k.shape
        if not self.cache_length:
            raise ValueError("decode=True needs cache_length > 0")
        if mask.window is not None and self.cache_length < mask.window[0] + 1:
            raise ValueError(f"a window of {mask.window[0] + 1} keys needs cache_length >= it, not {self.cache_length}")
        shape = (b, kv_heads, self.cache_length, dh)  # head-major: the layout the attention dots read
        cached_k = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        i = index.value
        positions = i + jnp.arange(length)  # [L]
        if self.rope:
            k = embeddings.apply_rotary(k, positions, self.rope)
        index.value = i + length
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, L, Dh]
        if mask.window is None:
            cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k, (0, 0, i, 0))
            cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v, (0, 0, i, 0))
            return cached_k.value, cached_v.value, i, mask.replace(
                causal=True, query_positions=positions, key_positions=jnp.arange(self.cache_length))
        cached_pos = self.variable("cache", "cached_position", jnp.full, (b, self.cache_length), FAR, jnp.int32)
        keys = jnp.concatenate([cached_k.value, k], 2)  # [B, K, W + L, Dh]
        values = jnp.concatenate([cached_v.value, v], 2)
        filled = jnp.arange(self.cache_length) < i  # slots fill in order before the ring wraps; a zeroed cache works
        key_positions = jnp.concatenate([jnp.where(filled, cached_pos.value[0], FAR), positions])  # [W + L]
        kept = min(length, self.cache_length)
        slots = positions[-kept:] % self.cache_length
        cached_k.value = cached_k.value.at[:, :, slots].set(k[:, :, -kept:])
        cached_v.value = cached_v.value.at[:, :, slots].set(v[:, :, -kept:])
        cached_pos.value = cached_pos.value.at[:, slots].set(positions[-kept:])
        return keys, values, i, mask.replace(causal=True, query_positions=positions, key_positions=key_positions)
