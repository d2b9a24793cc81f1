"""The position-wise feed-forward network.

Glossary of shapes: B batch, L length, D model width, F mlp width.
"""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import sharding
from transformer.layers import matmul
from transformer.sharding import BATCH, EMBED, LENGTH, MLP

Dtype = jnp.dtype

ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x, approximate=True),  # tanh approximation (GPT-2's gelu_new)
    "gelu_exact": lambda x: nn.gelu(x, approximate=False),  # erf (BERT's, ViT's and BART's)
    "relu": nn.relu,
    "swiglu": None,
    "geglu": None,
}
GATES = {"swiglu": nn.silu, "geglu": nn.gelu}  # gated: up(x) * gate_fn(gate(x))


class Mlp(nn.Module):
    """D -> F -> D with gelu | gelu_exact | relu, or gated: swiglu x W_up * silu(x W_gate) (Llama),
    geglu x W_up * gelu(x W_gate), tanh gelu (T5 v1.1's gated-gelu)."""

    mlp_dim: int
    activation: str = "gelu"
    use_bias: bool = True
    dropout: float = 0.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Callable = nn.initializers.normal(0.02)
    out_kernel_init: Callable | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """x [B, L, D] -> [B, L, D]."""
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown mlp activation {self.activation!r}; choose one of {sorted(ACTIVATIONS)}")
        h = self._dense("up", self.mlp_dim, (EMBED, MLP))(x)  # [B, L, F]
        if self.activation in GATES:
            h = h * GATES[self.activation](self._dense("gate", self.mlp_dim, (EMBED, MLP))(x))
        else:
            h = ACTIVATIONS[self.activation](h)
        h = sharding.constrain(h, (BATCH, LENGTH, MLP))
        h = nn.Dropout(self.dropout)(h, deterministic=deterministic)
        return self._dense("down", x.shape[-1], (MLP, EMBED), self.out_kernel_init)(h)

    def _dense(self, name: str, features: int, axes: tuple[str, str], init: Callable | None = None) -> nn.Dense:
        return nn.Dense(
            features,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            dot_general=matmul.dot_general_for(self.dtype),
            kernel_init=nn.with_logical_partitioning(init or self.kernel_init, axes),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[-1:]),
            name=name,
        )
