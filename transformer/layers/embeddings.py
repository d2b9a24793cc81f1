"""Token embeddings, the output projection (tied to them or its own), absolute positions and rotary.

Glossary of shapes:
  B batch, L length, D model width, V vocab, Dh head width, H heads.
"""

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import sharding
from transformer.layers import matmul
from transformer.sharding import BATCH, EMBED, LENGTH, VOCAB

Dtype = jnp.dtype


class Embed(nn.Module):
    """Token embedding [V, D]; `attend` reuses it as the output projection."""

    vocab_size: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    embedding_init: Callable = nn.initializers.normal(0.02)

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, (VOCAB, EMBED)),
            (self.vocab_size, self.features),
            self.param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [B, L] int -> [B, L, D]: the lookup reads a table gathered whole (FSDP / tensor
        sharding of a gather's operand is slow to repartition), then splits its rows by batch."""
        table = sharding.constrain(self.embedding, (None, None))
        return sharding.constrain(jnp.take(table, ids, axis=0).astype(self.dtype), (BATCH, LENGTH, EMBED))

    def attend(self, x: jax.Array) -> jax.Array:
        """x [B, L, D] -> logits [B, L, V] in float32 against the embedding matrix (`project`)."""
        return project(x, self.embedding, self.dtype, tied=True)


class Unembed(nn.Module):
    """The untied output projection's `kernel` [D, V] (the parameters of a bias-free nn.Dense), for
    `project`."""

    vocab_size: int
    features: int
    param_dtype: Dtype = jnp.float32

    def setup(self):
        self.kernel = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(0.02), (EMBED, VOCAB)),
                                 (self.features, self.vocab_size), self.param_dtype)


def project(x: jax.Array, weights: jax.Array, dtype: Dtype, tied: bool) -> jax.Array:
    """x [..., D] -> logits [..., V] in float32, against a tied embedding [V, D] or a kernel [D, V].

    Inputs in `dtype`, accumulated and returned in float32: the softmax over V needs the precision.
    A pure function of arrays, so that a blockwise loss can call it inside a scan.
    """
    dot = matmul.dot_general_for(dtype) or jax.lax.dot_general
    dims = (((x.ndim - 1,), (1 if tied else 0,)), ((), ()))
    return dot(x.astype(dtype), weights.astype(dtype), dims, preferred_element_type=jnp.float32)


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap x tanh(logits / cap) [...]: every logit within (-cap, cap), Gemma 2's soft cap; cap 0 leaves them."""
    return cap * jnp.tanh(logits / cap) if cap else logits


class LearnedPositions(nn.Module):
    """Learned absolute positions added to the input at `offset`.

    The table is [first_row + max_len, D]: position p reads row first_row + p (BART keeps
    two unused rows in front, first_row=2).
    """

    max_len: int
    features: int
    first_row: int = 0
    param_dtype: Dtype = jnp.float32
    embedding_init: Callable = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self, x: jax.Array, offset=0, positions: jax.Array | None = None) -> jax.Array:
        """x [B, L, D] -> x + rows[offset : offset + L], or + rows[positions] (positions [B, L]:
        each token's position in its document, for packed documents)."""
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, (LENGTH, EMBED)),
            (self.first_row + self.max_len, self.features),
            self.param_dtype,
        )
        if positions is not None:
            # the table gathered whole, as `Embed`'s (a sharded gather operand repartitions badly)
            rows = jnp.take(sharding.constrain(table, (None, None)), self.first_row + positions, axis=0)
            return x + rows.astype(x.dtype)  # [B, L, D]
        pos = jax.lax.dynamic_slice_in_dim(table, self.first_row + offset, x.shape[1], axis=0)  # [L, D]
        return x + pos[None].astype(x.dtype)


class DecodePosition(nn.Module):
    """Where decoding is: the position of the first of `length` new tokens, kept in the 'cache'
    collection and advanced by `length` (the bookkeeping of every family that decodes)."""

    @nn.compact
    def __call__(self, length: int) -> jax.Array:
        position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
        offset = position.value
        position.value = offset + length
        return offset


def sinusoidal_positions(length: int, features: int, offset=0, max_timescale: float = 1e4,
                         positions: jax.Array | None = None) -> jax.Array:
    """[L, D] sin/cos table of "Attention is all you need" (sin in even, cos in odd slots) at
    offset .. offset + L - 1, or [B, L, D] at `positions` [B, L]."""
    pos = (offset + jnp.arange(length, dtype=jnp.float32)) if positions is None else positions.astype(jnp.float32)
    inv_freq = max_timescale ** (-jnp.arange(0, features, 2, dtype=jnp.float32) / features)
    angles = pos[..., None] * inv_freq  # [(B,) L, D/2]
    table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [(B,) L, D/2, 2]
    return table.reshape(*pos.shape, -1)[..., :features]


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal absolute positions added to the input at `offset`."""

    @nn.compact
    def __call__(self, x: jax.Array, offset=0, positions: jax.Array | None = None) -> jax.Array:
        table = sinusoidal_positions(x.shape[1], x.shape[2], offset, positions=positions)  # [(B,) L, D]
        return x + (table if positions is not None else table[None]).astype(x.dtype)


ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary positions' frequencies: theta^(-2i/Dh), rescaled for a longer context by `scaling`:
    'linear' divides every frequency by `factor` (position interpolation, Chen et al. 2023);
    'llama3' divides those of wavelength above original_max_len / low_freq_factor by `factor`,
    keeps those below original_max_len / high_freq_factor, and interpolates smoothly between
    (Llama 3.1's rule, as transformers computes it)."""

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def frequencies(self, dh: int) -> jax.Array:
        """[Dh/2] float32 angular frequencies."""
        inv_freq = self.theta ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
        if self.scaling == "linear":
            return inv_freq / self.factor
        if self.scaling != "llama3":
            return inv_freq
        wavelength = 2 * jnp.pi / inv_freq
        low, high = self.original_max_len / self.low_freq_factor, self.original_max_len / self.high_freq_factor
        smooth = (self.original_max_len / wavelength - self.low_freq_factor) / (self.high_freq_factor
                                                                                - self.low_freq_factor)
        scaled = jnp.where(wavelength > low, inv_freq / self.factor, inv_freq)
        medium = (wavelength >= high) & (wavelength <= low)
        return jnp.where(medium, (1 - smooth) * inv_freq / self.factor + smooth * inv_freq, scaled)


def apply_rotary(x: jax.Array, positions: jax.Array, rope: Rope = Rope()) -> jax.Array:
    """Rotates pairs (i, i + Dh/2) of x [B, L, H, Dh] by angle position x rope.frequencies(Dh)[i].

    The "rotate half" layout of GPT-NeoX and Llama; `positions` is [L], or [B, L] (packed documents).
    """
    angles = positions.astype(jnp.float32)[..., None] * rope.frequencies(x.shape[-1])  # [(B,) L, Dh/2]
    angles = angles[None] if angles.ndim == 2 else angles  # [B|1, L, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B|1, L, 1, Dh/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, L, H, Dh/2] each
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


POSITIONS = ("learned", "sinusoidal", "rotary", "none")


class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches, each projected to D (a stride-p convolution written as a dense).

    Shapes: B batch, D width, C channels, p patch size, P = (H / p) * (W / p) patches.
    """

    patch_size: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        """images [B, H, W, C] -> [B, P, D], patches in row-major order."""
        b, h, w, c = images.shape
        p = self.patch_size
        x = images.reshape(b, h // p, p, w // p, p, c)  # [B, H/p, p, W/p, p, C]
        x = x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // p) * (w // p), p, p, c)  # [B, P, p, p, C]
        return nn.DenseGeneral(
            self.features,
            axis=(-3, -2, -1),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            dot_general=matmul.dot_general_for(self.dtype),
            kernel_init=nn.with_logical_partitioning(self.kernel_init, (None, None, None, EMBED)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (EMBED,)),
            name="proj",
        )(x)  # [B, P, D]
