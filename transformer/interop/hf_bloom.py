"""BLOOM on the GPT family: BloomForCausalLM and BloomModel checkpoints, config keys and weights.

BLOOM is GPT-2's pre-norm block (LayerNorm, biases everywhere, tanh GELU, a 4 x D mlp, tied
embeddings) with ALiBi in place of position embeddings (`model.positions='alibi'`: the same slopes,
layers/attention/alibi.py) and a LayerNorm right after the embedding (`model.embed_norm`). Its
config.json has no longest sequence: `seq_length` where it has one, else 2048, BLOOM's training length,
is `model.max_len` (the decode cache's default size; ALiBi itself has no table). BLOOM's
`apply_residual_connection_post_layernorm` is refused; `pretraining_tp` and `slow_but_exact` only
change how Megatron's shards summed, and are not carried.

Weight layouts: D width, H heads, Dh head width, F = 4 D mlp width, V vocab.
  word_embeddings [V, D] -> embed;  word_embeddings_layernorm -> embed_norm;  ln_f -> final_norm
  query_key_value [3 H Dh, D] (laid out per head as [H, 3, Dh]) -> query, key, value [D, H, Dh];
  its bias [3 H Dh] -> [H, Dh] each
  dense [D, H Dh] -> self_attn/out [H, Dh, D];  dense_h_to_4h [F, D] -> mlp/up;  dense_4h_to_h [D, F] -> mlp/down
  lm_head [V, D] -> unembed [D, V] where the embedding is not tied
"""

import numpy as np

from transformer.interop.hf_families import Architecture, Rule, Unsupported, linear, norm, per_layer, require, same

SEQ_LENGTH = 2048  # BLOOM's training length: max_len where config.json has no seq_length


def _to_ours(c: dict, keys: set) -> dict:
    if c.get("apply_residual_connection_post_layernorm"):
        raise Unsupported("config.json: apply_residual_connection_post_layernorm=True is not supported (the residual "
                          "here is the block's input)")
    d = c["hidden_size"]
    return dict(vocab_size=c["vocab_size"], num_layers=c.get("n_layer", c.get("num_hidden_layers")), d_model=d,
                num_heads=c.get("n_head", c.get("num_attention_heads")), mlp_dim=4 * d,
                max_len=c.get("seq_length") or SEQ_LENGTH, positions="alibi", embed_norm=True, activation="gelu",
                norm="layernorm", norm_placement="pre", norm_epsilon=c.get("layer_norm_epsilon", 1e-5),
                use_bias=True, tie_embeddings=c.get("tie_word_embeddings", True), dropout=c.get("hidden_dropout", 0.0))


def _to_theirs(m: dict) -> dict:
    require(m, "BLOOM", family="gpt", positions="alibi", embed_norm=True, activation="gelu", norm="layernorm",
            norm_placement="pre", use_bias=True, qkv_bias=False, num_kv_heads=0, head_dim=0, window=0,
            mlp_dim=4 * m["d_model"])
    return dict(vocab_size=m["vocab_size"], n_layer=m["num_layers"], hidden_size=m["d_model"], n_head=m["num_heads"],
                layer_norm_epsilon=m["norm_epsilon"], tie_word_embeddings=m["tie_embeddings"],
                hidden_dropout=m["dropout"], attention_dropout=m["dropout"], seq_length=m["max_len"],
                apply_residual_connection_post_layernorm=False)


def _fused_qkv(h: int, d: int) -> list[Rule]:
    """query_key_value's weight [H * 3 * Dh, D] and bias [H * 3 * Dh] <-> query, key, value kernels [D, H, Dh]
    and biases [H, Dh]."""
    names = tuple(f"self_attn/{n}" for n in ("query", "key", "value"))
    weight = Rule("self_attention.query_key_value.weight", tuple(f"{n}/kernel" for n in names),
                  lambda w: tuple(w.reshape(h, 3, -1, d)[:, i].transpose(2, 0, 1) for i in range(3)),
                  lambda *ks: np.stack([k.transpose(1, 2, 0) for k in ks], 1).reshape(-1, d))
    bias = Rule("self_attention.query_key_value.bias", tuple(f"{n}/bias" for n in names),
                lambda b: tuple(b.reshape(h, 3, -1)[:, i] for i in range(3)),
                lambda *bs: np.stack(bs, 1).reshape(-1))
    return [weight, bias]


def _rules(m: dict) -> list[Rule]:
    h = m["num_heads"]
    layer = [*norm("input_layernorm", "self_attn_norm"), *norm("post_attention_layernorm", "mlp_norm"),
             *_fused_qkv(h, m["d_model"]), *linear("self_attention.dense", "self_attn/out", heads_out=h),
             *linear("mlp.dense_h_to_4h", "mlp/up"), *linear("mlp.dense_4h_to_h", "mlp/down")]
    rules = [same("word_embeddings.weight", "embed/embedding"), *norm("word_embeddings_layernorm", "embed_norm"),
             *norm("ln_f", "final_norm"), *per_layer(layer, m["num_layers"], "h.{}", "block_{}")]
    if not m["tie_embeddings"] and m.get("head", "lm") == "lm":
        rules.append(Rule("lm_head.weight", ("unembed/kernel",), lambda w: (w.T,), lambda k: k.T))
    return rules


BLOOM = Architecture(
    family="gpt", model_type="bloom", prefix="transformer",
    heads={"BloomForCausalLM": dict(head="lm"), "BloomModel": dict(head="none")},
    to_ours=_to_ours, to_theirs=_to_theirs, rules=_rules,
    class_of=lambda m: "BloomForCausalLM" if m.get("head", "lm") == "lm" else "BloomModel",
    base_class="BloomModel", head_keys=("lm_head",), ignored=r"lm_head\.weight",
)


def exports(m: dict) -> Architecture | None:
    """BLOOM for a GPT-family config.model with ALiBi positions (None: another architecture's)."""
    return BLOOM if m.get("positions") == "alibi" else None
