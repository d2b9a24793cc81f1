"""GPT: a decoder-only transformer language model (GPT-2 / GPT-3 style).

Glossary of shapes: B batch, L length, D model width, V vocab.

    tokens [B, L] -> embed (+ positions) (-> norm if embed_norm) -> num_layers x Block(causal) -> norm
                  -> logits [B, L, V] (tied: embedding^T; untied: a separate 'unembed'; soft-capped
                     where logit_softcap > 0)
                     or, given targets [B, L], the per-token cross entropy [B, L] (blocks of
                     `loss_block` positions: never all the logits at once)
                     or, with head='none', the normed hidden states [B, L, D]
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.layers import cross_entropy, embeddings, matmul
from transformer.layers.attention import Mask, alibi
from transformer.layers.block import apply_blocks
from transformer.models import common

HEADS = ("lm", "none")
POSITIONS = (*embeddings.POSITIONS, "alibi")
BLOOM = dict(positions="alibi", embed_norm=True, vocab_size=250880, max_len=2048)
LLAMA = dict(positions="rotary", activation="swiglu", norm="rmsnorm", use_bias=False, tie_embeddings=False)
QWEN3 = dict(LLAMA, qk_norm=True, num_kv_heads=8, head_dim=128, max_len=40960, vocab_size=151936, rope_theta=1e6,
             norm_epsilon=1e-6)
PRESETS = {
    "tiny": dict(num_layers=4, d_model=192, num_heads=4, mlp_dim=768, max_len=128, vocab_size=256),
    # tiny with a mixture of 8 experts of half its mlp width in each Block, 2 per token (its active width)
    "tiny-moe": dict(num_layers=4, d_model=192, num_heads=4, mlp_dim=384, max_len=128, vocab_size=256,
                     num_experts=8, experts_per_token=2),
    # tiny at 65,536 tokens: rotary positions, blockwise attention (memory linear in L);
    # --config.model.window=1024 makes it a sliding window
    "tiny-long": dict(num_layers=4, d_model=192, num_heads=4, mlp_dim=768, max_len=65536, vocab_size=256,
                      positions="rotary", attention="blockwise", attention_block=512),
    "gpt2-small": dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072),
    "gpt2-medium": dict(num_layers=24, d_model=1024, num_heads=16, mlp_dim=4096),
    "gpt2-large": dict(num_layers=36, d_model=1280, num_heads=20, mlp_dim=5120),
    "gpt2-xl": dict(num_layers=48, d_model=1600, num_heads=25, mlp_dim=6400),
    # ImageGPT (Chen et al. 2020): a GPT over pixels' palette ids ([SOS] + S x S), untied; iGPT-S/M/L at 32 x 32
    # with 512 colours (76M, 455M, 1.4B with their 513-id vocabulary), iGPT-XL at the notes' 64 x 64; igpt-tiny
    # reads the 8 x 8 digits in 16 greys on a CPU
    "igpt-tiny": dict(num_layers=4, d_model=128, num_heads=4, mlp_dim=512, max_len=64, vocab_size=17,
                      tie_embeddings=False),
    "igpt-s": dict(num_layers=24, d_model=512, num_heads=8, mlp_dim=2048, max_len=1024, vocab_size=513,
                   tie_embeddings=False),
    "igpt-m": dict(num_layers=36, d_model=1024, num_heads=8, mlp_dim=4096, max_len=1024, vocab_size=513,
                   tie_embeddings=False),
    "igpt-l": dict(num_layers=48, d_model=1536, num_heads=16, mlp_dim=6144, max_len=1024, vocab_size=513,
                   tie_embeddings=False),
    "igpt-xl": dict(num_layers=60, d_model=3072, num_heads=24, mlp_dim=12288, max_len=4096, vocab_size=513,
                    tie_embeddings=False),
    "gpt3-175b": dict(num_layers=96, d_model=12288, num_heads=96, mlp_dim=49152, max_len=2048,
                      tie_embeddings=False),
    # Llama-style decoders: rotary positions, RMSNorm, SwiGLU, grouped kv heads, no biases, untied
    "llama-tiny": dict(LLAMA, num_layers=4, d_model=192, num_heads=4, num_kv_heads=2, mlp_dim=512, max_len=128,
                       vocab_size=256),
    "llama3-8b": dict(LLAMA, num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                      max_len=8192, vocab_size=128256, rope_theta=500000.0),
    "llama3-70b": dict(LLAMA, num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, mlp_dim=28672,
                       max_len=8192, vocab_size=128256, rope_theta=500000.0),
    "mistral-7b": dict(LLAMA, num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                       max_len=32768, vocab_size=32000, window=4096),
    # Qwen3: Llama's, with each head's query and key normed (qk_norm), heads of 128, the small ones tied
    "qwen3-0.6b": dict(QWEN3, num_layers=28, d_model=1024, num_heads=16, mlp_dim=3072, tie_embeddings=True),
    "qwen3-1.7b": dict(QWEN3, num_layers=28, d_model=2048, num_heads=16, mlp_dim=6144, tie_embeddings=True),
    "qwen3-4b": dict(QWEN3, num_layers=36, d_model=2560, num_heads=32, mlp_dim=9728, tie_embeddings=True),
    "qwen3-8b": dict(QWEN3, num_layers=36, d_model=4096, num_heads=32, mlp_dim=12288),
    # mixtures of experts in every Block, the k router weights renormalised: Mixtral-8x7B-v0.1 (Mistral's
    # attention without a window) and Qwen3-30B-A3B (its dense mlp_dim unused: every layer sparse)
    "mixtral-8x7b": dict(LLAMA, num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                         max_len=32768, vocab_size=32000, rope_theta=1e6, num_experts=8, experts_per_token=2,
                         normalize_topk=True),
    "qwen3-30b-a3b": dict(QWEN3, num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, mlp_dim=6144,
                          moe_mlp_dim=768, num_experts=128, experts_per_token=8, normalize_topk=True),
    # BLOOM: ALiBi in place of position embeddings, a LayerNorm after the embedding, GPT-2's blocks otherwise
    "bloom-560m": dict(BLOOM, num_layers=24, d_model=1024, num_heads=16, mlp_dim=4096),
    "bloom-1b1": dict(BLOOM, num_layers=24, d_model=1536, num_heads=16, mlp_dim=6144),
    "bloom-1b7": dict(BLOOM, num_layers=24, d_model=2048, num_heads=16, mlp_dim=8192),
    "bloom-3b": dict(BLOOM, num_layers=30, d_model=2560, num_heads=32, mlp_dim=10240),
    "bloom-7b1": dict(BLOOM, num_layers=30, d_model=4096, num_heads=32, mlp_dim=16384),
    "bloom-176b": dict(BLOOM, num_layers=70, d_model=14336, num_heads=112, mlp_dim=57344),
}


class GPT(common.TextShared):
    """Decoder-only LM. Fields are the keys of `config.model` (less `family`); the shared ones (sizes,
    norm, dropout, dtypes, remat, scan, attention, window) are declared in `common.TextShared`.

    `window` > 0 lets each token see itself and the window - 1 before it (a sliding window), and
    decoding then keeps a ring buffer of `window` keys per layer. Rotary positions:
    layers/embeddings.Rope; ALiBi (`positions='alibi'`, no position embeddings): the mask's bias,
    layers/attention/alibi.py. `embed_norm` norms the embeddings before the first Block (BLOOM).
    The loss's blocks: `layers/cross_entropy.blockwise_token_losses`.
    """

    vocab_size: int = 50257              # rows of the embedding: at least the tokenizer's ids (0: its ids)
    num_kv_heads: int = 0                # key/value heads shared by groups of query heads (0: num_heads)
    head_dim: int = 0                    # each head's width Dh (0: d_model / num_heads)
    max_len: int = 1024                  # the longest sequence (the learned positions' table)
    positions: str = "learned"           # learned | sinusoidal | rotary | alibi | none
    embed_norm: bool = False             # a norm (model.norm) after the embeddings (BLOOM)
    use_bias: bool = True                # biases in the dense layers
    qkv_bias: bool = False               # biases of the query, key and value projections alone (Qwen2)
    rope_theta: float = 10000.0          # rotary positions turn at rope_theta^(-2i/Dh)
    rope_scaling: str = "none"           # rotary rescaling for longer contexts: none | linear | llama3
    rope_factor: float = 1.0             # rope_scaling's factor
    rope_low_freq_factor: float = 1.0    # llama3 rope_scaling: the low-frequency bound's factor
    rope_high_freq_factor: float = 4.0   # llama3 rope_scaling: the high-frequency bound's factor
    rope_original_max_len: int = 8192    # llama3 rope_scaling: the context the model was trained at
    tie_embeddings: bool = True          # the output projection is the embedding's transpose (else its own)
    head: str = "lm"                     # lm (logits) | none (the normed hidden states)
    cache_length: int = 0                # positions of the decode cache (0: max_len; generate sets it)
    loss_block: int = 2048               # the most positions whose logits the loss holds at once

    @nn.compact
    def __call__(self, tokens: jax.Array, valid: jax.Array | None = None, *, segments: jax.Array | None = None,
                 positions: jax.Array | None = None, order: jax.Array | None = None, decode: bool = False,
                 deterministic: bool = True, last_only: bool = False, targets: jax.Array | None = None,
                 log_z: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
        """tokens [B, L] int -> logits [B, L, V] in float32.

        `valid` [B, L] bool marks real tokens (None: all); padding is never attended to.
        `segments` [B, L] int numbers the documents packed into a row: a token attends only to
        its own document's; `positions` [B, L] are the tokens' positions in their documents.
        `order` [L] int is each token's place in the row when the tokens come reordered (ring
        attention's zigzag, `layers/attention/ring.py`): the mask and, without `positions`, the position
        embeddings use it, and the logits come in the same order. With `decode=True` the tokens continue the
        sequence held in the 'cache' collection (see `transformer.inference.decoding.init_cache`); several tokens at
        once is a prefill. `last_only` gives the last position's logits alone ([B, 1, V]: what a
        prefill needs, without the head's cost over the whole prompt). With `targets` [B, L] ids the
        result is each position's cross entropy [B, L] float32 instead, the head and the loss
        computed over blocks of at most `loss_block` positions (the logits of a long context at a
        large vocabulary do not fit: 16 GiB a row at 32K x 128K); with `log_z` too, the pair (it, each
        position's logsumexp of the logits [B, L]) that PaLM's z-loss squares.
        """
        dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
        offset = embeddings.DecodePosition(name="position")(tokens.shape[1]) if decode else 0
        embed = embeddings.Embed(self.vocab_size, self.d_model, dtype=dtype, param_dtype=param_dtype,
                                 name="embed")
        x = embed(tokens)  # [B, L, D]
        if order is not None and positions is None:
            positions = jnp.broadcast_to(order, tokens.shape)  # [B, L]
        if self.positions == "learned":
            x = embeddings.LearnedPositions(self.max_len, self.d_model, param_dtype=param_dtype,
                                            name="pos_embed")(x, offset, positions)
        elif self.positions == "sinusoidal":
            x = embeddings.SinusoidalPositions()(x, offset, positions)
        if self.embed_norm:
            x = self.make_norm("embed_norm")(x)
        x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
        mask = self.mask() if decode else self.mask(valid, segments, order)
        x = apply_blocks(self._blocks(), x, mask, positions=positions, decode=decode,
                         deterministic=deterministic)
        if last_only:
            x = x[:, -1:]  # [B, 1, D]
        x = self.make_norm("final_norm")(x)
        if self.head == "none":
            return x.astype(jnp.float32)
        x = self.readout(x)
        if self.tie_embeddings:
            weights = embed.embedding
        else:
            weights = embeddings.Unembed(self.vocab_size, self.d_model, param_dtype, name="unembed").kernel
        head = lambda h: embeddings.softcap(  # noqa: E731
            embeddings.project(h, weights, dtype, self.tie_embeddings), self.logit_softcap)
        if targets is not None:
            return cross_entropy.blockwise_token_losses(head, x, targets, self.loss_block,
                                                        fused_backward=matmul.low_precision(dtype), log_z=log_z)
        return head(x)  # [B, L, V]

    def mask(self, valid: jax.Array | None = None, segments: jax.Array | None = None,
             order: jax.Array | None = None) -> Mask:
        """Causal self-attention within the window, over valid [B, L] keys of the same segment [B, L]; the
        tokens at the places `order` [L] in the row (None: in order); ALiBi's bias where positions='alibi'."""
        window = (self.window - 1, 0) if self.window else None
        return Mask(causal=True, window=window, key_valid=valid, segments=segments, query_positions=order,
                    key_positions=order, bias=alibi.bias(self.num_heads) if self.positions == "alibi" else None)

    @property
    def rope(self) -> embeddings.Rope:
        return embeddings.Rope(self.rope_theta, self.rope_scaling, self.rope_factor, self.rope_low_freq_factor,
                               self.rope_high_freq_factor, self.rope_original_max_len)

    def _blocks(self) -> list[nn.Module]:
        return self.stack(
            "block", self.num_layers,
            head_dim=self.head_dim or self.d_model // self.num_heads,
            num_kv_heads=self.num_kv_heads or None,
            use_bias=self.use_bias,
            qkv_bias=self.qkv_bias,
            rope=self.rope if self.positions == "rotary" else None,
            cache_length=self.window or self.cache_length or self.max_len,
            kernel_init=nn.initializers.normal(0.02),
            out_kernel_init=nn.initializers.normal(0.02 / math.sqrt(2 * self.num_layers)),
        )


def validate(model: GPT) -> None:
    """Raises ValueError naming the config.model key that is inconsistent."""
    common.check([
        *common.shape_checks(model, "vocab_size"),
        *common.head_width_checks(model),
        *common.attention_checks(model),
        (model.loss_block >= 1, f"config.model.loss_block={model.loss_block} must be positive"),
        (0 <= model.cache_length <= model.max_len,
         f"config.model.cache_length={model.cache_length} must be in 0..max_len={model.max_len}"),
        (model.positions != "rotary" or (model.head_dim or model.d_model // model.num_heads) % 2 == 0,
         "config.model.positions='rotary' needs an even head width"),
        (model.rope_scaling in embeddings.ROPE_SCALINGS,
         f"config.model.rope_scaling={model.rope_scaling!r}: choose one of {', '.join(embeddings.ROPE_SCALINGS)}"),
        (model.rope_scaling == "none" or model.rope_factor > 0,
         f"config.model.rope_factor={model.rope_factor} must be positive"),
        (model.rope_scaling != "llama3" or model.rope_high_freq_factor > model.rope_low_freq_factor,
         "config.model.rope_high_freq_factor must exceed rope_low_freq_factor"),
    ])


def task(model: GPT) -> str:
    if model.head != "lm":
        raise ValueError(f"config.model.head={model.head!r} (hidden states) has no training task: set it to 'lm'")
    return "lm"


def cost(model: GPT, config) -> common.Cost:
    """Every matrix multiplies each of the L tokens; the embedding only as the tied output; attention
    scores the pairs its implementation computes (a window skips blocks in `blockwise`)."""
    length, width = config.data.seq_len, model.num_heads * (model.head_dim or model.d_model // model.num_heads)
    lookup = lambda path: path[0] == "embed" and not (model.tie_embeddings and model.head == "lm")
    return common.Cost(tokens=length, weight_tokens=lambda path: 0 if lookup(path) else length,
                       attention=(common.Attention(model.num_layers, width,
                                                         common.scored_pairs(model, model.mask(), length, length)),),
                       context=f"L = {length:,}")


def example_inputs(model: GPT) -> tuple:
    """Abstract inputs for `model.init` (shapes only)."""
    return (jax.ShapeDtypeStruct((1, 1), jnp.int32),)


FAMILY = common.Family(
    name="gpt", module=GPT, presets=PRESETS, example_inputs=example_inputs, validate=validate, task=task,
    cost=cost, choices={"head": HEADS, "positions": POSITIONS}, generation="prompt",
    config_file=lambda model: "gpt.py:gpt2-small",
    lens_entry=("final_norm",),
)
build = FAMILY.build
default_model_config = FAMILY.model_config
