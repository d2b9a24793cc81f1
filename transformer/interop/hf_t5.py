"""T5 on the encoder-decoder family: T5ForConditionalGeneration and T5EncoderModel, v1.0 and v1.1.

T5 here (models/encdec.py) is pre-LN with RMSNorm (no bias, no mean), no biases anywhere, no
embedding scale, `positions='relative'` (one bucketed per-head bias table per stack, from
layer 0's SelfAttention in the checkpoint), relu (v1.0, `feed_forward_proj='relu'`) or geglu
(v1.1, 'gated-gelu': wi_0 is the gate, wi_1 the linear part), the output tied and scaled by
D^-0.5 (v1.0) or untied (v1.1). T5 does not scale its attention logits by Dh^-0.5: sqrt(Dh)
is folded into every query kernel on import (and taken out on export), so the attention here
computes T5's logits exactly. transformers 5 always ties T5's output to its embedding (v1.1 as
`scale_decoder_outputs=False`); v1.1 files saved before it carry their own lm_head, read here as
`tie_embeddings=False` (`unembed`), which exports refuse. T5EncoderModel is the family's `head='encoder'` (the encoder
alone: its hidden states [B, S, D]), which reads as what it is: T5's encoder, with T5's own
relative bias, where BERT's encoder has neither.

Weight layouts: D width, H heads, Dh head width (d_kv), F d_ff, V vocab, N buckets.
  q, k, v [H*Dh, D] -> [D, H, Dh] (q x sqrt(Dh));  o [D, H*Dh] -> out [H, Dh, D]
  wi / wi_0 / wi_1 [F, D] -> mlp/up / gate / up [D, F];  wo [D, F] -> mlp/down [F, D]
  relative_attention_bias [N, H] -> src_rel_bias / tgt_rel_bias [N, H];  lm_head [V, D] -> unembed [D, V]
"""

import dataclasses
import math

from transformer.interop.hf_families import Architecture, Rule, Unsupported, linear, per_layer, require, same

FEED_FORWARD = {"relu": "relu", "gated-gelu": "geglu"}


def _to_ours(c: dict, keys: set) -> dict:
    proj = c.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD:
        raise Unsupported(f"config.json: feed_forward_proj={proj!r} is not supported (choose one of "
                          f"{', '.join(FEED_FORWARD)})")
    d, h = c["d_model"], c["num_heads"]
    tied = "lm_head.weight" not in keys  # transformers 5 always ties (a saved T5 has no lm_head); v1.1 files did not
    scale = c.get("scale_decoder_outputs", c.get("tie_word_embeddings", True) is not False)
    return dict(vocab_size=c["vocab_size"], num_layers=c["num_layers"],
                num_decoder_layers=c.get("num_decoder_layers") or c["num_layers"], d_model=d, num_heads=h,
                head_dim=0 if c["d_kv"] == d // h else c["d_kv"], mlp_dim=c["d_ff"], max_len=512,
                positions="relative", relative_buckets=c.get("relative_attention_num_buckets", 32),
                relative_max_distance=c.get("relative_attention_max_distance", 128), position_offset=0,
                scale_embeddings=False, embed_norm=False, logits_bias=False, activation=FEED_FORWARD[proj],
                norm="rmsnorm", norm_placement="pre", norm_epsilon=c.get("layer_norm_epsilon", 1e-6),
                use_bias=False, dropout=c.get("dropout_rate", 0.1), tie_embeddings=tied, scale_output=scale)


def _to_theirs(m: dict) -> dict:
    require(m, "T5", positions="relative", scale_embeddings=False, embed_norm=False, logits_bias=False,
            norm="rmsnorm", norm_placement="pre", use_bias=False, window=0)
    if m["activation"] not in FEED_FORWARD.values():
        raise Unsupported(f"config.model.activation={m['activation']!r} has no equivalent in transformers' T5 "
                          "(needs 'relu' or 'geglu')")
    if m["head"] == "lm" and not m["tie_embeddings"]:
        raise Unsupported("config.model.tie_embeddings=False has no equivalent in transformers' T5 (version 5 ties "
                          "the output to the embedding; T5 v1.1 is tied there, its output unscaled)")
    proj = {v: k for k, v in FEED_FORWARD.items()}[m["activation"]]
    h = m["num_heads"]
    return dict(vocab_size=m["vocab_size"], num_layers=m["num_layers"],
                num_decoder_layers=m["num_decoder_layers"] or m["num_layers"], d_model=m["d_model"], num_heads=h,
                d_kv=m["head_dim"] or m["d_model"] // h, d_ff=m["mlp_dim"], feed_forward_proj=proj,
                relative_attention_num_buckets=m["relative_buckets"],
                relative_attention_max_distance=m["relative_max_distance"], layer_norm_epsilon=m["norm_epsilon"],
                dropout_rate=m["dropout"], tie_word_embeddings=True, scale_decoder_outputs=m["scale_output"],
                is_encoder_decoder=True,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def _attention(theirs: str, ours: str, heads: int, head_dim: int) -> list[Rule]:
    """q, k, v, o of a T5 attention; the query kernel x sqrt(Dh) (T5's logits are unscaled)."""
    weight = lambda t, o, **kw: linear(f"{theirs}.{t}", f"{ours}/{o}", **kw)[0]  # noqa: E731
    query, scale = weight("q", "query", heads_in=heads), math.sqrt(head_dim)
    scaled = dataclasses.replace(query, to_ours=lambda w: (query.to_ours(w)[0] * scale,),
                                 to_theirs=lambda k: query.to_theirs(k / scale))
    return [scaled, weight("k", "key", heads_in=heads), weight("v", "value", heads_in=heads),
            weight("o", "out", heads_out=heads)]


def _feed_forward(theirs: str, activation: str) -> list[Rule]:
    names = {"wi": "up", "wo": "down"} if activation == "relu" else {"wi_0": "gate", "wi_1": "up", "wo": "down"}
    return [linear(f"{theirs}.{t}", f"mlp/{o}")[0] for t, o in names.items()]


def _rules(m: dict) -> list[Rule]:
    h, act = m["num_heads"], m["activation"]
    dh = m["head_dim"] or m["d_model"] // h
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    encoder = [*_attention("layer.0.SelfAttention", "self_attn", h, dh), same("layer.0.layer_norm.weight",
                                                                              "self_attn_norm/scale"),
               *_feed_forward("layer.1.DenseReluDense", act), same("layer.1.layer_norm.weight", "mlp_norm/scale")]
    rules = [same("shared.weight", "embed/embedding"), same(f"encoder.{bias}", "src_rel_bias"),
             same("encoder.final_layer_norm.weight", "encoder_norm/scale")]
    rules += per_layer(encoder, m["num_layers"], "encoder.block.{}", "encoder_{}")
    if m["head"] == "encoder":
        return rules
    decoder = [*_attention("layer.0.SelfAttention", "self_attn", h, dh),
               same("layer.0.layer_norm.weight", "self_attn_norm/scale"),
               *_attention("layer.1.EncDecAttention", "cross_attn", h, dh),
               same("layer.1.layer_norm.weight", "cross_attn_norm/scale"),
               *_feed_forward("layer.2.DenseReluDense", act), same("layer.2.layer_norm.weight", "mlp_norm/scale")]
    rules += [same(f"decoder.{bias}", "tgt_rel_bias"), same("decoder.final_layer_norm.weight", "decoder_norm/scale")]
    rules += per_layer(decoder, m["num_decoder_layers"] or m["num_layers"], "decoder.block.{}", "decoder_{}")
    if not m["tie_embeddings"]:
        rules.append(Rule("lm_head.weight", ("unembed/kernel",), lambda w: (w.T,), lambda k: k.T))
    return rules


T5 = Architecture(
    family="encdec", model_type="t5", prefix="",
    heads={"T5ForConditionalGeneration": dict(head="lm"), "T5EncoderModel": dict(head="encoder")},
    to_ours=_to_ours, to_theirs=_to_theirs, rules=_rules,
    class_of=lambda m: "T5EncoderModel" if m["head"] == "encoder" else "T5ForConditionalGeneration",
    head_keys=("lm_head",), ignored=r"(encoder|decoder)\.embed_tokens\.weight|lm_head\.weight",
    start_token="decoder_start_token_id",
)


def exports(m: dict) -> Architecture | None:
    """T5 for an encoder-decoder with relative positions (None: BART's)."""
    return T5 if m.get("positions") == "relative" else None
