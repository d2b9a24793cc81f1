"""BERT: a bidirectional transformer encoder with pretraining and fine-tuning heads.

Glossary of shapes: B batch, L length, D model width, V vocab, C classes (num_labels).

    tokens [B, L] -> embed + positions + token types -> norm, dropout
                  -> num_layers x Block(padding mask, post-norm by default) -> hidden [B, L, D]
    pooler:   tanh(dense(hidden[:, 0]))                                  -> pooled [B, D]
    heads:    pretrain  mlm_logits [B, L, V] (dense, gelu, norm, tied decoder + bias, soft cap)
                        (+ nsp_logits [B, 2] from pooled when `nsp`)
              sequence  logits [B, C] from pooled
              token     logits [B, L, C]
              none      hidden [B, L, D] (+ pooled [B, D] when `pooler`)

The encoder body's parameter paths (embed, pos_embed, type_embed, embed_norm, block_i,
pooler) are the same for every head, so `config.init_from` carries a pretrained body into
fine-tuning while a new head starts fresh.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.layers import embeddings, matmul
from transformer.layers.attention import Mask
from transformer.layers.block import apply_blocks
from transformer.layers.mlp import ACTIVATIONS
from transformer.models import common
from transformer.sharding import CLASSES, EMBED, MLP, TYPES, VOCAB

PRESETS = {
    "tiny": dict(num_layers=4, d_model=128, num_heads=4, mlp_dim=512, max_len=128, vocab_size=4096),
    # Longformer's attention at tiny size: a 256-token window, [CLS] global, blockwise
    "longformer-tiny": dict(num_layers=4, d_model=128, num_heads=4, mlp_dim=512, max_len=4096, vocab_size=4096,
                            window=256, global_tokens=1, attention="blockwise", attention_block=128),
    "bert-base": dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072),
    "bert-large": dict(num_layers=24, d_model=1024, num_heads=16, mlp_dim=4096),
}
HEADS = ("pretrain", "sequence", "token", "none")


NORMAL = nn.initializers.normal(0.02)


def _init(axes: tuple, init=NORMAL):
    return nn.with_logical_partitioning(init, axes)


class BERT(common.TextShared):
    """Encoder with a head picked by `head`. Fields are the keys of `config.model` (less `family`); the
    shared ones (sizes, norm, dropout, dtypes, remat, scan, attention, window) are declared in
    `common.TextShared`, redeclared here where BERT's default differs.

    `window` > 0 lets each token see the window // 2 tokens on either side and the first
    `global_tokens` positions ([CLS]), which see every token: Longformer's attention.
    """

    activation: str = "gelu_exact"
    norm_placement: str = "post"
    norm_epsilon: float = 1e-12
    dropout: float = 0.1
    vocab_size: int = 30522        # rows of the embedding: at least the tokenizer's ids (0: its ids)
    max_len: int = 512             # the longest sequence (the positions' table)
    type_vocab_size: int = 2       # token types (segment A / B) of the type embedding
    head: str = "pretrain"         # pretrain (masked LM) | sequence | token (classifiers) | none (hidden states)
    pooler: bool = True            # the [CLS] pooler (dense + tanh) of the sequence and NSP heads
    nsp: bool = False              # pretrain adds next-sentence prediction
    num_labels: int = 2            # classes of the sequence and token heads (0: the data's labels)
    global_tokens: int = 0         # with window > 0: the first positions that see every token ([CLS])

    @nn.compact
    def __call__(self, tokens: jax.Array, type_ids: jax.Array | None = None, valid: jax.Array | None = None,
                 *, segments: jax.Array | None = None, positions: jax.Array | None = None,
                 deterministic: bool = True) -> dict:
        """tokens, type_ids [B, L] int, valid [B, L] bool (None: all valid) -> dict of float32 outputs.

        `segments` [B, L] numbers the documents packed into a row (a token attends to its own
        document's only) and `positions` [B, L] are the tokens' positions in them."""
        dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
        embed = embeddings.Embed(self.vocab_size, self.d_model, dtype=dtype, param_dtype=param_dtype,
                                 name="embed")
        hidden = self._encode(embed, tokens, type_ids, valid, segments, positions, deterministic)
        drop = lambda x: nn.Dropout(self.dropout)(x, deterministic=deterministic)
        if self.head == "pretrain":
            out = {"mlm_logits": self._mlm(embed, hidden)}
            if self.nsp:
                out["nsp_logits"] = self._dense(2, (EMBED, CLASSES), "nsp")(self.readout(self._pool(hidden)))
        elif self.head == "sequence":
            out = {"logits": self._dense(self.num_labels, (EMBED, CLASSES), "classifier")(
                self.readout(drop(self._pool(hidden))))}
        elif self.head == "token":
            out = {"logits": self._dense(self.num_labels, (EMBED, CLASSES), "classifier")(self.readout(drop(hidden)))}
        else:
            out = {"hidden": hidden, **({"pooled": self._pool(hidden)} if self.pooler else {})}
        return {k: v.astype(jnp.float32) for k, v in out.items()}

    def _encode(self, embed, tokens, type_ids, valid, segments, positions, deterministic) -> jax.Array:
        """tokens [B, L] -> hidden [B, L, D]."""
        dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
        x = embeddings.LearnedPositions(self.max_len, self.d_model, param_dtype=param_dtype,
                                        name="pos_embed")(embed(tokens), positions=positions)  # [B, L, D]
        types = self.param("type_embed", _init((TYPES, EMBED)), (self.type_vocab_size, self.d_model),
                           param_dtype)
        type_ids = jnp.zeros_like(tokens) if type_ids is None else type_ids
        x = x + jnp.take(types, type_ids, axis=0).astype(dtype)  # [B, L, D]
        x = self.make_norm("embed_norm")(x)
        x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
        x = apply_blocks(self._blocks(), x, self.mask(valid, segments), deterministic=deterministic)
        if self.norm_placement == "pre":
            x = self.make_norm("final_norm")(x)
        return x

    def mask(self, valid: jax.Array | None = None, segments: jax.Array | None = None) -> Mask:
        """Valid [B, L] keys (padding is never attended to) of the same segment [B, L], within the window."""
        window = (self.window // 2, self.window // 2) if self.window else None
        return Mask(window=window, global_tokens=self.global_tokens, key_valid=valid, segments=segments)

    def _pool(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, L, D] -> [B, D]: tanh(dense) of the first ([CLS]) position, or it alone."""
        if not self.pooler:
            return hidden[:, 0]
        return jnp.tanh(self._dense(self.d_model, (EMBED, MLP), "pooler")(hidden[:, 0]))

    def _mlm(self, embed, hidden) -> jax.Array:
        """hidden [B, L, D] -> logits [B, L, V] through the transform and the tied decoder."""
        h = ACTIVATIONS[self.activation](self._dense(self.d_model, (EMBED, MLP), "mlm_transform")(hidden))
        h = self.readout(self.make_norm("mlm_norm")(h))
        bias = self.param("mlm_bias", _init((VOCAB,), nn.initializers.zeros), (self.vocab_size,),
                          jnp.dtype(self.param_dtype))
        return embeddings.softcap(embed.attend(h) + bias.astype(jnp.float32), self.logit_softcap)  # [B, L, V]

    def _dense(self, features: int, axes: tuple[str, str], name: str) -> nn.Dense:
        return nn.Dense(features, dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype),
                        dot_general=matmul.dot_general_for(self.dtype),
                        kernel_init=_init(axes), bias_init=_init(axes[-1:], nn.initializers.zeros), name=name)

    def _blocks(self) -> list[nn.Module]:
        return self.stack("block", self.num_layers, head_dim=self.d_model // self.num_heads,
                          kernel_init=nn.initializers.normal(0.02))


def validate(model: BERT) -> None:
    """Raises ValueError naming the config.model key that is inconsistent."""
    common.check([
        *common.shape_checks(model, "vocab_size", *(["num_labels"] if model.head in ("sequence", "token") else [])),
        *common.head_width_checks(model),
        *common.attention_checks(model),
        (model.type_vocab_size >= 1, f"config.model.type_vocab_size={model.type_vocab_size} must be >= 1"),
    ])


# head -> the task that trains it (transformer/training/tasks/).
TASKS = {"pretrain": "mlm", "sequence": "sequence_classification", "token": "token_classification"}


def task(model: BERT) -> str:
    if model.head not in TASKS:
        raise ValueError(f"config.model.head={model.head!r} (hidden states) has no training task: choose one of "
                         f"{', '.join(TASKS)} (configs/bert.py:PRESET,task=TASK sets it)")
    return TASKS[model.head]


def cost(model: BERT, config) -> common.Cost:
    """The encoder's matrices multiply each of the L tokens; the pooler, next-sentence and sequence
    heads one token per example; the embedding only as the masked-LM head's tied decoder."""
    length, width = config.data.seq_len, model.d_model

    def weight_tokens(path: tuple[str, ...]) -> int:
        if path[0] == "embed":
            return length if model.head == "pretrain" else 0
        if path[0] in ("pooler", "nsp") or (path[0] == "classifier" and model.head == "sequence"):
            return 1
        return length

    return common.Cost(tokens=length, weight_tokens=weight_tokens,
                       attention=(common.Attention(model.num_layers, width,
                                                         common.scored_pairs(model, model.mask(), length, length)),),
                       context=f"L = {length:,}")


def example_inputs(model: BERT) -> tuple:
    """Abstract inputs for `model.init` (shapes only): tokens, type ids, validity."""
    return (jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1, 1), jnp.int32),
            jax.ShapeDtypeStruct((1, 1), jnp.bool_))


FAMILY = common.Family(
    name="bert", module=BERT, presets=PRESETS, example_inputs=example_inputs, validate=validate, task=task,
    cost=cost, choices={"head": HEADS, "activation": ("gelu_exact", "gelu", "relu")},
    no_generation="bert models are encoders (masked-LM / classifiers): they do not generate; score this one "
                  "with python -m transformer.evaluate --workdir {workdir}, label new texts with python -m "
                  "transformer.predict --workdir {workdir} --input FILE (a classifier), or fine-tune from it with "
                  "--config.init_from={workdir}",
    config_file=lambda model: f"bert.py:bert-base,task={TASKS.get(model.head, 'mlm')}",
    lens_entry=("final_norm", "mlm_transform"),
)
build = FAMILY.build
default_model_config = FAMILY.model_config
