"""Encoder-decoder transformer ("Attention is all you need", Vaswani et al. 2017).

Glossary of shapes: B batch, S source length, L target length, D model width, V vocab.

    src [B, S] -> embed * sqrt(D) + positions (-> norm if embed_norm)
               -> num_layers x Block(source padding mask)
               -> (final norm if pre-LN) -> encoded [B, S, D]
    tgt_in [B, L] -> embed * sqrt(D) + positions (-> norm if embed_norm)
                  -> num_decoder_layers x Block(causal self-attn, cross-attn to encoded)
                  -> (final norm if pre-LN) -> logits [B, L, V] (the shared embedding^T,
                     + a learned bias if logits_bias, soft-capped if logit_softcap)

BART is this model with learned positions whose table starts `position_offset`=2 rows in,
embed_norm, logits_bias, gelu_exact and no embedding scale. T5 is it pre-LN with RMSNorm, no
biases, no embedding scale, relu (v1.0) or geglu (v1.1) and `positions='relative'`: no position
is added to the embeddings; each attention of the encoder and of the decoder's self-attention
adds a learned per-head bias of the bucketed distance k - q (`relative_buckets` buckets, the
far ones logarithmic up to `relative_max_distance`; bidirectional in the encoder, the past only
in the decoder), one table per stack shared by its layers (`layers/attention.Bias`). T5 leaves its
attention logits unscaled: the interop folds sqrt(Dh) into its query kernels. `tie_embeddings`
False gives the output its own 'unembed' [D, V]; `scale_output` multiplies the decoder's output
by D^-0.5 before the tied projection (T5 v1.0). `head`: 'lm' (logits), 'none' (the decoder's
hidden states, BartModel) or 'encoder' (the encoder's alone: no decoder, T5EncoderModel).

One embedding is shared by source, target and output, as in the paper (a joint vocabulary).
With post-LN (the paper's and the default) every block ends in a norm, so there is no
final norm. Weights start at normal(D^-0.5), the scale of the paper's Xavier init for
D x D matrices (GPT's 0.02 keeps a small model's attention uniform for long). In decode
mode the decoder keeps its self-attention keys/values, the cross-attention keys/values of
`encoded` and its position in the 'cache' collection; `cache_length` sizes the self-attention
cache (0: max_len; the decoding functions set it to what a call needs). `window` > 0 lets each
source token see the window // 2 on either side.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.layers import embeddings, matmul
from transformer.layers.attention import Bias, Mask
from transformer.layers.block import apply_blocks
from transformer.models import common
from transformer.sharding import EMBED, VOCAB
from transformer.sharding import HEADS as HEADS_AXIS

T5 = dict(vocab_size=32128, max_len=512, positions="relative", scale_embeddings=False, activation="relu",
          norm="rmsnorm", norm_placement="pre", norm_epsilon=1e-6, use_bias=False, dropout=0.1, scale_output=True)
MARIAN = dict(norm_epsilon=1e-5)  # Marian's LayerNorm epsilon: these presets export as MarianMTModel
PRESETS = {
    "tiny": dict(MARIAN, num_layers=2, num_decoder_layers=2, d_model=128, num_heads=4, mlp_dim=512, max_len=128,
                 vocab_size=2048, dropout=0.1),
    "vaswani-base": dict(MARIAN, num_layers=6, num_decoder_layers=6, d_model=512, num_heads=8, mlp_dim=2048,
                         max_len=256, vocab_size=37000, dropout=0.1),
    # T5 (Raffel et al. 2020): v1.0 relu and tied (the output scaled by D^-0.5), v1.1 geglu and untied
    "t5-small": dict(T5, num_layers=6, num_decoder_layers=6, d_model=512, num_heads=8, mlp_dim=2048),
    "t5-base": dict(T5, num_layers=12, num_decoder_layers=12, d_model=768, num_heads=12, mlp_dim=3072),
    "t5-v1_1-small": dict(T5, num_layers=8, num_decoder_layers=8, d_model=512, num_heads=6, head_dim=64,
                          mlp_dim=1024, activation="geglu", tie_embeddings=False, scale_output=False),
}

POSITIONS = ("sinusoidal", "learned", "relative", "none")
HEADS = ("lm", "none", "encoder")


def relative_buckets(relative: jax.Array, bidirectional: bool, buckets: int, max_distance: int) -> jax.Array:
    """T5's bucket [...] int32 of each distance k - q [...]: exact below buckets / 2 (a half each way
    when bidirectional), logarithmic up to max_distance, the last bucket beyond."""
    bucket = jnp.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        bucket += (relative > 0).astype(jnp.int32) * buckets
        distance = jnp.abs(relative)
    else:
        distance = -jnp.minimum(relative, 0)
    exact = buckets // 2
    far = exact + (jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).astype(jnp.int32)
    return bucket + jnp.where(distance < exact, distance, jnp.minimum(far, buckets - 1))


def relative_bias(bidirectional: bool, buckets: int, max_distance: int):
    """fn(table [buckets, H], q_pos [bq], k_pos [bk]) -> [H, bq, bk]: a `Bias` function."""
    def fn(table, q_pos, k_pos):
        bucket = relative_buckets(k_pos[None, :] - q_pos[:, None], bidirectional, buckets, max_distance)
        return jnp.moveaxis(table[bucket], -1, 0).astype(jnp.float32)
    return fn


class EncoderDecoder(common.TextShared):
    """Encoder-decoder with shared embeddings. Fields are the keys of `config.model` (less `family`); the
    shared ones (sizes, norm, dropout, dtypes, remat, scan, attention, window) are declared in
    `common.TextShared`, redeclared here where this family's default differs."""

    num_layers: int = 6
    d_model: int = 512
    num_heads: int = 8
    mlp_dim: int = 2048
    activation: str = "relu"
    norm_epsilon: float = 1e-6
    dropout: float = 0.1
    norm_placement: str = "post"
    vocab_size: int = 37000           # rows of the shared embedding: at least the tokenizer's ids
    num_decoder_layers: int = 0       # Blocks of the decoder (0: num_layers)
    head_dim: int = 0                 # each head's width Dh (0: d_model / num_heads)
    max_len: int = 256                # the longest source or target (the positions' table)
    positions: str = "sinusoidal"     # sinusoidal | learned | relative (T5's bucketed bias) | none
    position_offset: int = 0          # rows the learned positions' table starts in (BART: 2)
    scale_embeddings: bool = True     # embeddings times sqrt(D)
    embed_norm: bool = False          # a norm after the embeddings (BART)
    logits_bias: bool = False         # a learned bias on the logits (BART)
    cache_length: int = 0             # positions of the decode cache (0: max_len; generate sets it)
    use_bias: bool = True             # biases in the dense layers
    relative_buckets: int = 32        # relative positions: buckets of the distance
    relative_max_distance: int = 128  # relative positions: the distance from which all share the last bucket
    tie_embeddings: bool = True       # the output projection is the embedding's transpose (else its own)
    scale_output: bool = False        # the decoder's output times D^-0.5 before a tied projection (T5 v1.0)
    head: str = "lm"                  # lm (logits) | none (the decoder's hidden states) | encoder (no decoder)

    def setup(self):
        dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
        self.embed = embeddings.Embed(self.vocab_size, self.d_model, dtype=dtype, param_dtype=param_dtype,
                                      embedding_init=nn.initializers.normal(self.d_model**-0.5), name="embed")
        if self.positions == "learned":
            self.src_pos, self.tgt_pos = (
                embeddings.LearnedPositions(self.max_len, self.d_model, self.position_offset,
                                            param_dtype=param_dtype, name=name)
                for name in ("src_pos", "tgt_pos"))
        if self.embed_norm:
            self.src_embed_norm = self.make_norm("src_embed_norm")
            self.tgt_embed_norm = self.make_norm("tgt_embed_norm")
        has_decoder = self.head != "encoder"
        if self.logits_bias and self.head == "lm":
            self.bias = self.param("logits_bias", nn.with_logical_partitioning(nn.initializers.zeros, (VOCAB,)),
                                   (self.vocab_size,), param_dtype)
        if self.positions == "relative":
            table = lambda name: self.param(  # noqa: E731
                name, nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, HEADS_AXIS)),
                (self.relative_buckets, self.num_heads), param_dtype)
            self.src_rel_bias = table("src_rel_bias")
            if has_decoder:
                self.tgt_rel_bias = table("tgt_rel_bias")
        if not self.tie_embeddings and self.head == "lm":
            self.unembed = nn.Dense(self.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                    dot_general=matmul.dot_general_for(dtype),
                                    kernel_init=nn.with_logical_partitioning(nn.initializers.normal(self.d_model**-0.5),
                                                                             (EMBED, VOCAB)), name="unembed")
        self.encoder = self._blocks("encoder", self.num_layers)
        if has_decoder:
            self.decoder = self._blocks("decoder", self.num_decoder_layers or self.num_layers)
        if self.norm_placement == "pre":
            self.encoder_norm = self.make_norm("encoder_norm")
            if has_decoder:
                self.decoder_norm = self.make_norm("decoder_norm")
        self.position = embeddings.DecodePosition(name="position")
        self.drop = nn.Dropout(self.dropout)

    def encode(self, src: jax.Array, src_valid: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """src [B, S] int, src_valid [B, S] bool -> encoded [B, S, D]."""
        x = self._embed(src, 0, "src", deterministic)  # [B, S, D]
        x = apply_blocks(self.encoder, x, self.source_mask(src_valid, self._relative("src")),
                         deterministic=deterministic)
        return self.encoder_norm(x) if self.norm_placement == "pre" else x

    def decode(self, tgt_in: jax.Array, encoded: jax.Array, src_valid: jax.Array,
               tgt_valid: jax.Array | None = None, *, decode: bool = False,
               deterministic: bool = True) -> jax.Array:
        """tgt_in [B, L] int, encoded [B, S, D], src_valid [B, S] -> logits [B, L, V] in float32.

        With `decode=True` the tokens continue the target held in the 'cache' collection;
        the first such call (on a cache without cross-attention keys) also projects `encoded`.
        """
        offset = self.position(tgt_in.shape[1]) if decode else 0
        x = self._embed(tgt_in, offset, "tgt", deterministic)  # [B, L, D]
        self_mask = Mask(causal=True, key_valid=None if decode else tgt_valid, bias=self._relative("tgt"))
        cross_mask = Mask(key_valid=src_valid)  # padding is never attended to
        x = apply_blocks(self.decoder, x, self_mask, encoded, cross_mask, decode=decode, deterministic=deterministic)
        if self.norm_placement == "pre":
            x = self.decoder_norm(x)
        if self.head == "none":
            return x.astype(jnp.float32)
        x = self.readout(x)
        if not self.tie_embeddings:
            return embeddings.softcap(self.unembed(x).astype(jnp.float32), self.logit_softcap)
        if self.scale_output:
            x = x * self.d_model**-0.5
        logits = self.embed.attend(x)  # [B, L, V]
        if self.logits_bias:
            logits = logits + self.bias.astype(logits.dtype)
        return embeddings.softcap(logits.astype(jnp.float32), self.logit_softcap)

    def __call__(self, src: jax.Array, tgt_in: jax.Array, src_valid: jax.Array,
                 tgt_valid: jax.Array | None = None, *, deterministic: bool = True) -> jax.Array:
        """Teacher-forced logits [B, L, V] of tgt_in [B, L] given src [B, S] (head 'none': the decoder's
        hidden states [B, L, D]; 'encoder': the encoder's [B, S, D], tgt_in unused)."""
        encoded = self.encode(src, src_valid, deterministic=deterministic)
        if self.head == "encoder":
            return encoded.astype(jnp.float32)
        return self.decode(tgt_in, encoded, src_valid, tgt_valid, deterministic=deterministic)

    def source_mask(self, src_valid: jax.Array | None = None, bias: Bias | None = None) -> Mask:
        """The encoder's: valid [B, S] keys (padding is never attended to) within the window, plus `bias`."""
        window = (self.window // 2, self.window // 2) if self.window else None
        return Mask(window=window, key_valid=src_valid, bias=bias)

    def _relative(self, side: str) -> Bias | None:
        """The relative position bias of the encoder ('src') or of the decoder's self-attention ('tgt')."""
        if self.positions != "relative":
            return None
        return Bias(getattr(self, f"{side}_rel_bias"),
                    relative_bias(side == "src", self.relative_buckets, self.relative_max_distance))

    def _embed(self, ids: jax.Array, offset, side: str, deterministic: bool) -> jax.Array:
        """ids [B, L] of the source or target `side` -> [B, L, D]."""
        x = self.embed(ids)  # [B, L, D]
        if self.scale_embeddings:
            x = x * math.sqrt(self.d_model)
        if self.positions == "learned":
            x = getattr(self, f"{side}_pos")(x, offset)
        elif self.positions == "sinusoidal":
            x = x + embeddings.sinusoidal_positions(ids.shape[1], self.d_model, offset)[None].astype(x.dtype)
        if self.embed_norm:
            x = getattr(self, f"{side}_embed_norm")(x)
        return self.drop(x, deterministic=deterministic)

    def _blocks(self, name: str, num_layers: int) -> list[nn.Module]:
        return self.stack(name, num_layers, head_dim=self.head_dim or self.d_model // self.num_heads,
                          use_bias=self.use_bias, cache_length=self.cache_length or self.max_len,
                          kernel_init=nn.initializers.normal(self.d_model**-0.5), init_shrinks=True)


def validate(model: EncoderDecoder) -> None:
    """Raises ValueError naming the config.model key that is inconsistent."""
    common.check([
        *common.head_width_checks(model),
        *common.attention_checks(model),
        (0 <= model.cache_length <= model.max_len,
         f"config.model.cache_length={model.cache_length} must be in 0..max_len={model.max_len}"),
        (model.position_offset >= 0, f"config.model.position_offset={model.position_offset} must be >= 0"),
        (model.num_layers >= 1, f"config.model.num_layers={model.num_layers} must be at least 1"),
        (model.positions != "relative" or model.relative_max_distance > model.relative_buckets // 4 > 0,
         f"config.model.relative_buckets={model.relative_buckets} and relative_max_distance="
         f"{model.relative_max_distance}: need max_distance > buckets / 4 > 0"),
        (model.tie_embeddings or not model.scale_output,
         "config.model.scale_output scales the tied output projection: it needs tie_embeddings=True"),
    ])


def task(model: EncoderDecoder) -> str:
    if model.head != "lm":
        raise ValueError(f"config.model.head={model.head!r} (hidden states) has no training task: set it to 'lm'")
    return "seq2seq"


def cost(model: EncoderDecoder, config) -> common.Cost:
    """Encoder matrices multiply the S source tokens, decoder matrices (and the tied output
    embedding) the L target tokens, except cross-attention's keys and values (S); attention is
    the encoder's S x S (its window's blocks in blockwise), the decoder's L x L and the cross L x S."""
    s, t = config.data.source_len, config.data.target_len
    width = model.num_heads * (model.head_dim or model.d_model // model.num_heads)
    decoder_layers = model.num_decoder_layers or model.num_layers

    def weight_tokens(path: tuple[str, ...]) -> int:
        if path[0].startswith("encoder") or (path[-2:-1] in (("key",), ("value",)) and "cross_attn" in path):
            return s
        return t  # decoder layers, and the embedding as the output projection (its lookups are free)

    return common.Cost(tokens=s + t, weight_tokens=weight_tokens,
                       attention=(common.Attention(model.num_layers, width,
                                                   common.scored_pairs(model, model.source_mask(), s, s)),
                                  common.Attention(decoder_layers, width,
                                                   common.scored_pairs(model, Mask(causal=True), t, t)),
                                  common.Attention(decoder_layers, width, common.scored_pairs(model, Mask(), t, s))),
                       context=f"S = {s:,}, L = {t:,}")


def example_inputs(model: EncoderDecoder) -> tuple:
    """Abstract (src, tgt_in, src_valid) for `model.init` (shapes only)."""
    return (jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1, 1), jnp.int32),
            jax.ShapeDtypeStruct((1, 1), jnp.bool_))


FAMILY = common.Family(
    name="encdec", module=EncoderDecoder, presets=PRESETS, example_inputs=example_inputs, validate=validate,
    task=task, cost=cost, choices={"positions": POSITIONS, "head": HEADS}, generation="input",
    config_file=lambda model: "encdec.py:t5-small" if model.positions == "relative" else "encdec.py:vaswani-base",
    no_lens="the logit lens is read on gpt and bert runs; encdec has none yet",
)
build = FAMILY.build
default_model_config = FAMILY.model_config
