"""One residual block: norm placement pre | post, self-attention, optional cross-attention, mlp.

Glossary of shapes: B batch, L length, S source length, D model width.

pre  (GPT-2):                     x + f(norm(x))
post ("Attention is all you need", BERT): norm(x + f(x))
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.layers.attention import MultiHeadAttention
from transformer.layers.mlp import Mlp

Dtype = jnp.dtype

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
PLACEMENTS = ("pre", "post")


def make_norm(kind: str, name: str, dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
              epsilon: float = 1e-5) -> nn.Module:
    """LayerNorm | RMSNorm with logically named parameters."""
    if kind not in NORMS:
        raise ValueError(f"unknown norm {kind!r}; choose one of {sorted(NORMS)}")
    kwargs = dict(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name,
                  scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)))
    if kind == "layernorm":
        kwargs["bias_init"] = nn.with_logical_partitioning(nn.initializers.zeros, ("norm",))
    return NORMS[kind](**kwargs)


class Block(nn.Module):
    """Self-attention (+ cross-attention when `encoded` is given) + mlp, each residual."""

    num_heads: int
    head_dim: int
    mlp_dim: int
    num_kv_heads: int | None = None
    activation: str = "gelu"
    norm: str = "layernorm"
    norm_placement: str = "pre"
    norm_epsilon: float = 1e-5
    use_bias: bool = True
    rotary: bool = False
    dropout_rate: float = 0.0
    cache_length: int = 0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Callable = nn.initializers.normal(0.02)
    out_kernel_init: Callable | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None = None,
        encoded: jax.Array | None = None,
        cross_mask: jax.Array | None = None,
        *,
        decode: bool = False,
        deterministic: bool = True,
    ) -> jax.Array:
        """x [B, L, D], encoded [B, S, D] -> [B, L, D]."""
        if self.norm_placement not in PLACEMENTS:
            raise ValueError(f"unknown norm_placement {self.norm_placement!r}; choose one of {PLACEMENTS}")
        attn = dict(num_heads=self.num_heads, head_dim=self.head_dim, num_kv_heads=self.num_kv_heads,
                    use_bias=self.use_bias, dropout_rate=self.dropout_rate, dtype=self.dtype,
                    param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                    out_kernel_init=self.out_kernel_init)
        self_attn = MultiHeadAttention(rotary=self.rotary, cache_length=self.cache_length,
                                       name="self_attn", **attn)
        x = self._residual("self_attn", x, lambda h: self_attn(h, mask=mask, decode=decode,
                                                               deterministic=deterministic), deterministic)
        if encoded is not None:
            cross = MultiHeadAttention(name="cross_attn", **attn)
            x = self._residual("cross_attn", x, lambda h: cross(h, encoded, mask=cross_mask, decode=decode,
                                                                deterministic=deterministic), deterministic)
        mlp = Mlp(self.mlp_dim, self.activation, use_bias=self.use_bias, dropout_rate=self.dropout_rate,
                  dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                  out_kernel_init=self.out_kernel_init, name="mlp")
        return self._residual("mlp", x, lambda h: mlp(h, deterministic=deterministic), deterministic)

    def _residual(self, name: str, x: jax.Array, f: Callable, deterministic: bool) -> jax.Array:
        norm = make_norm(self.norm, f"{name}_norm", self.dtype, self.param_dtype, self.norm_epsilon)
        drop = nn.Dropout(self.dropout_rate)
        if self.norm_placement == "pre":
            return x + drop(f(norm(x)), deterministic=deterministic)
        return norm(x + drop(f(x), deterministic=deterministic))
