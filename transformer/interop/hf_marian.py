"""Marian on the encoder-decoder family: MarianMTModel checkpoints, config keys and weights.

Marian is "Attention is all you need" as the encoder-decoder here runs it by default (but for the epsilon): post-LN
blocks with biases everywhere, fixed sinusoidal positions from 0 added to the embeddings times
sqrt(D) (`scale_embedding`), one embedding shared by source, target and output, and a bias on the
logits (`final_logits_bias`: `logits_bias`, zeros where the run has none). Its LayerNorms take
torch's default epsilon, 1e-5 (`model.norm_epsilon=1e-5`; other values are refused), and its
table puts the sines of the D / 2 frequencies in the first half of the width and their cosines in
the second, where the table here interleaves them (layers/embeddings.py). Permuting the width
of the residual stream changes no output (every norm, sum and projection sees the same numbers),
so the weights go out with their width axis in Marian's order (our column `order[j]` at its j)
and come back with it undone: the logits are the same. The decoder's hidden states would come
out permuted, so MarianModel (head 'none') is not offered. Marian computes its table itself
(it is not in the checkpoint); transformers has no pre-LN Marian, and M2M100's and FSMT's
fairseq tables take other frequencies, so a pre-LN encoder-decoder with sinusoidal positions
has no export.

Weight layouts: D width, H heads, Dh head width, F mlp width, V vocab.
  shared [V, D] -> embed [V, D];  q_proj, k_proj, v_proj [H Dh, D] -> [D, H, Dh];  out_proj [D, H Dh] -> [H, Dh, D]
  fc1 [F, D] -> mlp/up [D, F];  fc2 [D, F] -> mlp/down [F, D];  final_logits_bias [1, V] -> logits_bias [V]
"""

import dataclasses

import numpy as np

from transformer.interop import hf_families
from transformer.interop.hf_families import Architecture, Rule, Unsupported, linear, norm, per_layer, require, same

ACTIVATIONS = ("gelu_exact", "gelu", "relu")


def marian_order(d: int) -> np.ndarray:
    """[D] our width column at each of Marian's: the sines' (even) columns, then the cosines' (odd)."""
    return np.r_[np.arange(0, d, 2), np.arange(1, d, 2)]


def _width(rule: Rule, axis: int, order: np.ndarray) -> Rule:
    """`rule` with `axis` of the transformers tensor (the width D) in Marian's `order`."""
    back = np.argsort(order)
    return dataclasses.replace(rule, to_ours=lambda w: rule.to_ours(np.take(w, back, axis)),
                               to_theirs=lambda *ours: np.take(rule.to_theirs(*ours), order, axis))


def _reads(theirs: str, ours: str, order: np.ndarray, heads: int = 0) -> list[Rule]:
    """A Linear from the width D: its weight [out, D] reordered on D, its bias as it is."""
    weight, bias = linear(theirs, ours, heads_in=heads)
    return [_width(weight, 1, order), bias]


def _writes(theirs: str, ours: str, order: np.ndarray, heads: int = 0) -> list[Rule]:
    """A Linear to the width D: its weight [D, in] and bias [D] reordered on D."""
    return [_width(r, 0, order) for r in linear(theirs, ours, heads_out=heads)]


def _norm(theirs: str, ours: str, order: np.ndarray) -> list[Rule]:
    return [_width(r, 0, order) for r in norm(theirs, ours)]


def _to_ours(c: dict, keys: set) -> dict:
    hf_families.refuse(c, share_encoder_decoder_embeddings=(False,), tie_word_embeddings=(False,))
    for ours, theirs in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim"),
                         ("vocab_size", "decoder_vocab_size")):
        if c.get(theirs, c[ours]) != c[ours]:
            raise Unsupported(f"config.json: {theirs}={c[theirs]} differs from {ours}={c[ours]} (not supported)")
    return dict(vocab_size=c["vocab_size"], num_layers=c["encoder_layers"], num_decoder_layers=c["decoder_layers"],
                d_model=c["d_model"], num_heads=c["encoder_attention_heads"], mlp_dim=c["encoder_ffn_dim"],
                max_len=c["max_position_embeddings"], positions="sinusoidal", position_offset=0,
                scale_embeddings=c.get("scale_embedding", False), embed_norm=False,
                logits_bias="final_logits_bias" in keys,
                activation=hf_families.activation_of(c.get("activation_function", "gelu"), "activation_function"),
                norm="layernorm", norm_placement="post", norm_epsilon=1e-5, use_bias=True, tie_embeddings=True,
                dropout=c.get("dropout", 0.1))


def _to_theirs(m: dict) -> dict:
    require(m, "Marian", positions="sinusoidal", norm="layernorm", norm_placement="post", norm_epsilon=1e-5,
            use_bias=True, tie_embeddings=True, scale_output=False, head_dim=0, window=0)
    if m["activation"] not in ACTIVATIONS:
        raise Unsupported(f"config.model.activation={m['activation']!r} has no equivalent in transformers' Marian "
                          f"(needs one of {', '.join(ACTIVATIONS)})")
    h, f, layers = m["num_heads"], m["mlp_dim"], m["num_decoder_layers"] or m["num_layers"]
    return dict(vocab_size=m["vocab_size"], decoder_vocab_size=m["vocab_size"], encoder_layers=m["num_layers"],
                decoder_layers=layers, d_model=m["d_model"], encoder_attention_heads=h, decoder_attention_heads=h,
                encoder_ffn_dim=f, decoder_ffn_dim=f, max_position_embeddings=m["max_len"],
                scale_embedding=m["scale_embeddings"], activation_function=hf_families.activation_for(m["activation"]),
                dropout=m["dropout"], attention_dropout=0.0, activation_dropout=0.0,
                share_encoder_decoder_embeddings=True, tie_word_embeddings=True, is_encoder_decoder=True,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=None, forced_eos_token_id=None)


def _rules(m: dict) -> list[Rule]:
    h, order = m["num_heads"], marian_order(m["d_model"])

    def attention(theirs: str, ours: str) -> list[Rule]:
        qkv = [r for n in ("query", "key", "value") for r in _reads(f"{theirs}.{n[0]}_proj", f"{ours}/{n}", order, h)]
        return [*qkv, *_writes(f"{theirs}.out_proj", f"{ours}/out", order, h)]

    common = [*attention("self_attn", "self_attn"), *_norm("self_attn_layer_norm", "self_attn_norm", order),
              *_reads("fc1", "mlp/up", order), *_writes("fc2", "mlp/down", order),
              *_norm("final_layer_norm", "mlp_norm", order)]
    cross = [*attention("encoder_attn", "cross_attn"), *_norm("encoder_attn_layer_norm", "cross_attn_norm", order)]
    rules = [_width(same("shared.weight", "embed/embedding"), 1, order)]
    if m["logits_bias"]:
        rules.append(Rule("final_logits_bias", ("logits_bias",), lambda b: (b[0],), lambda b: b[None], optional=True))
    rules += per_layer(common, m["num_layers"], "encoder.layers.{}", "encoder_{}")
    return rules + per_layer(common + cross, m["num_decoder_layers"] or m["num_layers"], "decoder.layers.{}",
                           "decoder_{}")


MARIAN = Architecture(
    family="encdec", model_type="marian", prefix="model",
    heads={"MarianMTModel": dict(head="lm")},
    to_ours=_to_ours, to_theirs=_to_theirs, rules=_rules, class_of=lambda m: "MarianMTModel",
    head_keys=("final_logits_bias", "lm_head"),
    ignored=r"(encoder|decoder)\.(embed_tokens|embed_positions)\.weight|lm_head\.weight",
    start_token="decoder_start_token_id",
)


def exports(m: dict) -> Architecture | None:
    """Marian for an encoder-decoder with sinusoidal positions (None: another architecture's)."""
    return MARIAN if m.get("positions") == "sinusoidal" else None
