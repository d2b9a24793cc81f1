"""One residual block (norm placement pre | post, self-attention, optional cross-attention, mlp)
and the stack of them that every family runs: a Python loop or one scanned layer, each
optionally rematerialised.

The mlp is dense (width `mlp_dim`), or a mixture of experts (layers/moe.py) in the Blocks that the stack's
`mixture` (layers/moe.Mixture, one record of its settings) makes sparse (`Mixture.layers`). Its router losses
are sown into the 'moe' collection by the mixture layers alone, stacked over the layers of a scanned
stack (which repeats one layer: all mixtures or all dense).

Glossary of shapes: B batch, L length, S source length, D model width, N layers.

pre  (GPT-2):                     x + f(norm(x))
post ("Attention is all you need", BERT): norm(x + f(x))

Stacks: unscanned, layer i's parameters are `{name}_{i}/...`; scanned, they are one
`{name}s/...` tree whose every leaf has a leading [N] axis (logical axis 'layers'), and
the compiler sees one layer instead of N (compile time flat in depth). `remat` trades
compute for memory in the backward pass: 'full' keeps only each layer's input,
'save_dots' also keeps the outputs of the weight matmuls (attention scores and
elementwise work are recomputed); 'auto' is the training loop's to resolve (the lightest
policy whose step fits the device: training/memory.py), and elsewhere means 'none'.
"""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import sharding
from transformer.layers.attention import Mask, MultiHeadAttention
from transformer.layers.embeddings import Rope
from transformer.layers.mlp import Mlp
from transformer.layers.moe import COLLECTION, Mixture, MoeMlp
from transformer.sharding import BATCH, EMBED, LAYERS, LENGTH, NORM

Dtype = jnp.dtype

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
PLACEMENTS = ("pre", "post")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def make_norm(norm: str, name: str, dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
              norm_epsilon: float = 1e-5) -> nn.Module:
    """LayerNorm | RMSNorm with logically named parameters."""
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; choose one of {sorted(NORMS)}")
    kwargs = dict(epsilon=norm_epsilon, dtype=dtype, param_dtype=param_dtype, name=name,
                  scale_init=nn.with_logical_partitioning(nn.initializers.ones, (NORM,)))
    if norm == "layernorm":
        kwargs["bias_init"] = nn.with_logical_partitioning(nn.initializers.zeros, (NORM,))
    return NORMS[norm](**kwargs)


class Block(nn.Module):
    """Self-attention (+ cross-attention when `encoded` is given) + mlp, each residual; `drop_path` drops
    a residual branch for a whole example (stochastic depth, Huang et al. 2016), in training only."""

    num_heads: int
    head_dim: int
    mlp_dim: int
    num_kv_heads: int | None = None
    activation: str = "gelu"
    norm: str = "layernorm"
    norm_placement: str = "pre"
    norm_epsilon: float = 1e-5
    use_bias: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    rope: Rope | None = None
    dropout: float = 0.0
    drop_path: float = 0.0
    cache_length: int = 0
    attention: str = "auto"
    attention_block: int = 512
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Callable = nn.initializers.normal(0.02)
    out_kernel_init: Callable | None = None
    mixture: Mixture | None = None  # the mixture of experts in place of the dense mlp (None: dense)
    attention_scale: float = 0.0    # what q.k is multiplied by (0: 1/sqrt(Dh); muP's 1/Dh: layers/parametrization.py)
    residual_scale: float = 1.0     # what each residual branch is multiplied by (CompleteP's depth rule)

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        mask: Mask | None = None,
        encoded: jax.Array | None = None,
        cross_mask: Mask | None = None,
        positions: jax.Array | None = None,
        decode: bool = False,
        deterministic: bool = True,
    ) -> jax.Array:
        """x [B, L, D], encoded [B, S, D] -> [B, L, D]; positions [B, L] (packed documents) for rotary;
        `mask` and `cross_mask` describe what self- and cross-attention may see (`layers/attention/masks.py`).

        Arguments are positional so that `nn.remat` can treat decode/deterministic as static.
        """
        if self.norm_placement not in PLACEMENTS:
            raise ValueError(f"unknown norm_placement {self.norm_placement!r}; choose one of {PLACEMENTS}")
        attn = dict(num_heads=self.num_heads, head_dim=self.head_dim, num_kv_heads=self.num_kv_heads,
                    use_bias=self.use_bias, dropout=self.dropout, dtype=self.dtype,
                    param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                    out_kernel_init=self.out_kernel_init, attention=self.attention,
                    attention_block=self.attention_block, qk_norm=self.qk_norm, norm_epsilon=self.norm_epsilon,
                    scale=self.attention_scale)
        self_attn = MultiHeadAttention(rope=self.rope, qkv_bias=self.qkv_bias, cache_length=self.cache_length,
                                       name="self_attn", **attn)
        x = self._residual("self_attn", x, lambda h: self_attn(h, mask=mask, positions=positions, decode=decode,
                                                               deterministic=deterministic), deterministic)
        if encoded is not None:
            cross = MultiHeadAttention(name="cross_attn", **attn)
            x = self._residual("cross_attn", x, lambda h: cross(h, encoded, mask=cross_mask, decode=decode,
                                                                deterministic=deterministic), deterministic)
        x = self._residual("mlp", x, self._mlp(deterministic), deterministic)
        return sharding.constrain(x, (BATCH, LENGTH, EMBED))

    def _mlp(self, deterministic: bool) -> Callable:
        """The mlp branch h [B, L, D] -> [B, L, D]: dense, or the mixture of experts."""
        inits = dict(dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                     out_kernel_init=self.out_kernel_init, name="mlp")
        if self.mixture is not None:
            return MoeMlp(self.mixture, self.mlp_dim, self.activation, self.use_bias, **inits)
        mlp = Mlp(self.mlp_dim, self.activation, use_bias=self.use_bias, dropout=self.dropout, **inits)
        return lambda h: mlp(h, deterministic=deterministic)

    def _residual(self, name: str, x: jax.Array, f: Callable, deterministic: bool) -> jax.Array:
        norm = make_norm(self.norm, f"{name}_norm", self.dtype, self.param_dtype, self.norm_epsilon)
        drop = nn.Dropout(self.dropout)
        drop_path = nn.Dropout(self.drop_path, broadcast_dims=(1, 2), name=f"{name}_drop_path")  # per example
        branch = lambda h: drop_path(drop(self._scaled(f(h)), deterministic=deterministic),  # noqa: E731
                                     deterministic=deterministic)
        if self.norm_placement == "pre":
            return x + branch(norm(x))
        return norm(x + branch(x))

    def _scaled(self, h: jax.Array) -> jax.Array:
        return h if self.residual_scale == 1.0 else h * self.residual_scale


class _ScanStep(nn.Module):
    """A Block in the (carry, out) form of `nn.scan`; `remat` wraps the block inside the scan."""

    block: dict
    remat: str = "none"

    @nn.compact
    def __call__(self, x, mask, encoded, cross_mask, positions, decode, deterministic):
        block = remat_block(self.remat, scanned=True)(**self.block, name="block")
        return block(x, mask, encoded, cross_mask, positions, decode, deterministic), None


def remat_block(remat: str, scanned: bool = False) -> type[nn.Module]:
    """Block, or Block rematerialised with `remat`, one of REMAT_POLICIES (decode, deterministic static).

    Outside a scan, XLA would merge the recomputation back into the forward pass unless
    common-subexpression elimination is prevented; inside one it cannot, and preventing it costs.
    """
    remat = remat.replace("-", "_")
    if remat == "auto":  # the training loop's to choose (training/memory.py); built elsewhere, no remat
        return Block
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; choose one of {', '.join(REMAT_POLICIES)}")
    if remat == "none":
        return Block
    return nn.remat(Block, policy=REMAT_POLICIES[remat], prevent_cse=not scanned, static_argnums=(6, 7))


def make_blocks(name: str, num_layers: int, remat: str = "none", scan_layers: bool = False,
                mixture: Mixture | None = None, **block_fields) -> list[nn.Module]:
    """The layers of a stack, to be run in turn by `apply_blocks`; the `mixture` of experts goes into the
    Blocks its `layers` makes sparse, the others are dense.

    Unscanned: `num_layers` blocks named `{name}_{i}`; a `drop_path` rate p gives layer i the rate
    p x i / (num_layers - 1) (DeiT's linear rule: none at the bottom, p at the top). Scanned: one module
    named `{name}s` holding all layers' parameters (and decode caches) stacked on a leading axis.
    """
    mixtures = mixture.layers(num_layers) if mixture is not None else [False] * num_layers
    if not scan_layers:
        top = block_fields.pop("drop_path", 0.0)
        return [remat_block(remat)(**block_fields, mixture=mixture if sparse else None,
                                   drop_path=top * i / max(num_layers - 1, 1), name=f"{name}_{i}")
                for i, sparse in enumerate(mixtures)]
    if block_fields.get("drop_path"):
        raise ValueError("config.model.drop_path grows with depth, which a scanned stack cannot express: set "
                         "config.model.scan_layers=False")
    if len(set(mixtures)) > 1:
        raise ValueError(f"config.model.scan_layers=True repeats one layer, but moe_every={mixture.moe_every}, "
                         f"dense_first={mixture.dense_first} and dense_layers={mixture.dense_layers!r} mix dense and "
                         "mixture-of-experts layers: set config.model.scan_layers=False")
    block_fields["mixture"] = mixture if all(mixtures) else None
    scanned = nn.scan(_ScanStep, variable_axes={"params": 0, "cache": 0, COLLECTION: 0},
                      split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * 6,
                      length=num_layers, metadata_params={nn.PARTITION_NAME: LAYERS})
    return [scanned(block=block_fields, remat=remat, name=f"{name}s")]


def apply_blocks(blocks: list[nn.Module], x: jax.Array, mask: Mask | None = None,
                 encoded: jax.Array | None = None, cross_mask: Mask | None = None,
                 positions: jax.Array | None = None, decode: bool = False,
                 deterministic: bool = True) -> jax.Array:
    """x [B, L, D] through every block of `make_blocks` -> [B, L, D]."""
    for block in blocks:
        if isinstance(block, _ScanStep):  # a scanned stack's carry has the dtype a Block returns: float32 at
            x = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # least (its residual sums are), as unscanned
        out = block(x, mask, encoded, cross_mask, positions, decode, deterministic)
        x = out[0] if isinstance(out, tuple) else out  # a scanned stack returns (carry, None)
    return x
