"""One residual block (norm placement pre | post, self-attention, optional cross-attention, mlp)
and the stack of them that every family runs: a Python loop or one scanned layer, each
optionally rematerialised.

The mlp is dense (width `mlp_dim`), or with `num_experts` > 0 a mixture of experts (layers/moe.py:
`num_experts` expert mlps of width `moe_mlp_dim`, or mlp_dim where 0, `experts_per_token` of them per
token, and a shared expert of width `shared_expert_dim` where > 0) in the layers `mixture_layers`
picks: every `moe_every`-th after the first `dense_first`, but those `dense_layers` names (all of them by
default). Its router losses
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
from transformer.layers.moe import COLLECTION, MoeMlp
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
    num_experts: int = 0
    experts_per_token: int = 2
    moe_mlp_dim: int = 0
    shared_expert_dim: int = 0
    shared_expert_gate: bool = False
    normalize_topk: bool = True
    router: str = "softmax"
    routed_scale: float = 1.0
    router_groups: int = 0
    router_topk_groups: int = 0
    moe_dispatch: str = "dropless"
    capacity_factor: float = 1.25

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
                    attention_block=self.attention_block, qk_norm=self.qk_norm, norm_epsilon=self.norm_epsilon)
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
        if self.num_experts:
            return MoeMlp(self.num_experts, self.experts_per_token, self.moe_mlp_dim or self.mlp_dim,
                          activation=self.activation, use_bias=self.use_bias, normalize_topk=self.normalize_topk,
                          router=self.router, routed_scale=self.routed_scale, router_groups=self.router_groups,
                          router_topk_groups=self.router_topk_groups,
                          shared_hidden=self.shared_expert_dim, shared_gate=self.shared_expert_gate,
                          dispatch=self.moe_dispatch, capacity_factor=self.capacity_factor, **inits)
        mlp = Mlp(self.mlp_dim, self.activation, use_bias=self.use_bias, dropout=self.dropout, **inits)
        return lambda h: mlp(h, deterministic=deterministic)

    def _residual(self, name: str, x: jax.Array, f: Callable, deterministic: bool) -> jax.Array:
        norm = make_norm(self.norm, f"{name}_norm", self.dtype, self.param_dtype, self.norm_epsilon)
        drop = nn.Dropout(self.dropout)
        drop_path = nn.Dropout(self.drop_path, broadcast_dims=(1, 2), name=f"{name}_drop_path")  # per example
        branch = lambda h: drop_path(drop(f(h), deterministic=deterministic), deterministic=deterministic)  # noqa: E731
        if self.norm_placement == "pre":
            return x + branch(norm(x))
        return norm(x + branch(x))


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


def mixture_layers(num_layers: int, moe_every: int = 1, dense_first: int = 0, dense_layers: str = "") -> list[bool]:
    """Whether each layer of a stack holds the mixture of experts: layer i (from 0) does where
    i >= dense_first and (i + 1) % moe_every == 0 (Llama 4's and Qwen3-MoE's step, DeepSeek-V3's first
    dense layers) and i is not among `dense_layers` (comma-separated indices: Qwen3-MoE's mlp_only_layers)."""
    dense = set(layer_indices(dense_layers))
    return [i >= dense_first and (i + 1) % moe_every == 0 and i not in dense for i in range(num_layers)]


def layer_indices(text: str) -> list[int]:
    """'0,2' (or '(0,2)', '[0, 2]') -> [0, 2] (config.model.dense_layers); a ValueError naming the key where
    an entry is no integer."""
    try:
        return [int(part) for part in text.strip("()[] ").replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"config.model.dense_layers={text!r}: give layer indices separated by commas, "
                         "e.g. 0,2") from None


def make_blocks(name: str, num_layers: int, remat: str = "none", scan_layers: bool = False, moe_every: int = 1,
                dense_first: int = 0, dense_layers: str = "", **block_fields) -> list[nn.Module]:
    """The layers of a stack, to be run in turn by `apply_blocks`.

    Unscanned: `num_layers` blocks named `{name}_{i}`; a `drop_path` rate p gives layer i the rate
    p x i / (num_layers - 1) (DeiT's linear rule: none at the bottom, p at the top); with `num_experts` > 0,
    the layers `mixture_layers` leaves out are dense. Scanned: one module named `{name}s` holding all layers'
    parameters (and decode caches) stacked on a leading axis.
    """
    experts = block_fields.pop("num_experts", 0)
    mixtures = mixture_layers(num_layers, moe_every, dense_first, dense_layers) if experts else [False] * num_layers
    if not scan_layers:
        top = block_fields.pop("drop_path", 0.0)
        return [remat_block(remat)(**block_fields, num_experts=experts if mixture else 0,
                                   drop_path=top * i / max(num_layers - 1, 1), name=f"{name}_{i}")
                for i, mixture in enumerate(mixtures)]
    if block_fields.get("drop_path"):
        raise ValueError("config.model.drop_path grows with depth, which a scanned stack cannot express: set "
                         "config.model.scan_layers=False")
    if len(set(mixtures)) > 1:
        raise ValueError(f"config.model.scan_layers=True repeats one layer, but moe_every={moe_every}, "
                         f"dense_first={dense_first} and dense_layers={dense_layers!r} mix dense and "
                         "mixture-of-experts layers: set config.model.scan_layers=False")
    block_fields["num_experts"] = experts if all(mixtures) else 0
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
        out = block(x, mask, encoded, cross_mask, positions, decode, deterministic)
        x = out[0] if isinstance(out, tuple) else out  # a scanned stack returns (carry, None)
    return x
