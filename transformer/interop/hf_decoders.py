"""Today's decoders on the GPT family: Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE checkpoints, config
keys and weights.

All are pre-norm decoders with RMSNorm, SwiGLU (down(silu(gate(x)) * up(x))), rotary
positions in the rotate-half layout, grouped kv heads and no biases, the embedding tied or
not; Mistral adds a sliding window (`model.window`: itself and the W - 1 before, as
transformers' mask), Qwen2 biases on q, k and v (`model.qkv_bias`), Qwen3 an RMSNorm over each
head's query and key before rotary (`model.qk_norm`). Rotary frequencies follow
`rope_theta` and the `rope_scaling` kinds default, linear and llama3 (transformers v5 writes
them as `rope_parameters`; earlier configs as `rope_theta` + `rope_scaling`: both are read).

Mixtral (Mistral's with a mixture of `num_local_experts` SwiGLU experts of width `intermediate_size`,
`num_experts_per_tok` per token, their router weights renormalised) and Qwen3-MoE (Qwen3's with
`num_experts` experts of width `moe_intermediate_size`, renormalised where `norm_topk_prob`; with
`use_sliding_window` every layer's attention takes the window `sliding_window`, as Mistral's) put a
mixture of experts in the mlp (config.model.num_experts, experts_per_token, moe_mlp_dim, normalize_topk;
layers/moe.py): Mixtral in every layer, Qwen3-MoE in the layers its `decoder_sparse_step` and
`mlp_only_layers` leave, the others dense of width `intermediate_size`: config.model.moe_every is the step,
dense_first the first dense layers where they say it, dense_layers the others (layers/moe.mixture_layers).
Their `router_aux_loss_coef` (transformers' default 0.001 where config.json has none) comes in as
config.train.load_balance_weight = k x the coefficient, and goes back out as the weight / k: transformers'
load-balancing loss is k times ours in a layer (layers/moe.py).
`router_jitter_noise` is not carried.

Weight layouts: D width, H heads, K kv heads, Dh head width, F mlp width, V vocab.
  q_proj [H*Dh, D] -> query [D, H, Dh];  k_proj, v_proj [K*Dh, D] -> [D, K, Dh];  o_proj [D, H*Dh] -> out [H, Dh, D]
  q_norm, k_norm [Dh] -> query_norm, key_norm [Dh]
  gate_proj, up_proj [F, D] -> mlp/gate, mlp/up [D, F];  down_proj [D, F] -> mlp/down [F, D]
  lm_head [V, D] -> unembed [D, V]
  a mixture (E experts): the router gate [E, D] -> mlp/router [D, E]; each expert e's gate, up [F, D] ->
  mlp/gate[e], mlp/up[e] of [E, D, F], its down [D, F] -> mlp/down[e] of [E, F, D] (Mixtral's w1, w3,
  w2; the per-expert tensors transformers' save_pretrained writes and the released checkpoints hold)
"""

from transformer.interop.hf_families import Architecture, Rule, Unsupported, expert, linear, per_layer, require, same
from transformer.layers.moe import mixture_layers

ROPE_KINDS = {"default": "none", "linear": "linear", "llama3": "llama3"}


def _rope_to_ours(c: dict) -> dict:
    rope = dict(c.get("rope_parameters") or {})
    rope = {"rope_theta": c.get("rope_theta", 10000.0), **(c.get("rope_scaling") or {}), **rope}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise Unsupported(f"config.json: rope type {kind!r} is not supported (choose one of {', '.join(ROPE_KINDS)})")
    fields = dict(rope_theta=float(rope["rope_theta"]), rope_scaling=ROPE_KINDS[kind])
    if kind != "default":
        fields["rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_len=int(rope["original_max_position_embeddings"]))
    return fields


def _rope_to_theirs(m: dict) -> dict:
    kind = {v: k for k, v in ROPE_KINDS.items()}[m["rope_scaling"]]
    rope = {"rope_type": kind, "rope_theta": m["rope_theta"]}
    if kind != "default":
        rope["factor"] = m["rope_factor"]
    if kind == "llama3":
        rope.update(low_freq_factor=m["rope_low_freq_factor"], high_freq_factor=m["rope_high_freq_factor"],
                    original_max_position_embeddings=m["rope_original_max_len"])
    return {"rope_parameters": rope, "rope_theta": m["rope_theta"], "rope_scaling": None if kind == "default" else rope}


def _decoder_to_ours(c: dict, keys: set) -> dict:
    if c.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"config.json: hidden_act={c['hidden_act']!r} is not supported (needs 'silu': SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise Unsupported(f"config.json: {key}=True is not supported (the GPT family's use_bias covers every "
                              "projection; qkv_bias only q, k and v)")
    d, h = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or d // h
    kv = c.get("num_key_value_heads") or h
    return dict(vocab_size=c["vocab_size"], num_layers=c["num_hidden_layers"], d_model=d, num_heads=h,
                num_kv_heads=0 if kv == h else kv, head_dim=0 if head_dim == d // h else head_dim,
                mlp_dim=c["intermediate_size"], max_len=c["max_position_embeddings"], positions="rotary",
                activation="swiglu", norm="rmsnorm", norm_placement="pre", norm_epsilon=c.get("rms_norm_eps", 1e-6),
                use_bias=False, tie_embeddings=c.get("tie_word_embeddings", False),
                dropout=c.get("attention_dropout", 0.0), **_rope_to_ours(c))


def _llama_to_ours(c: dict, keys: set) -> dict:
    return _decoder_to_ours(c, keys)


def _mistral_to_ours(c: dict, keys: set) -> dict:
    return {**_decoder_to_ours(c, keys), "window": c.get("sliding_window") or 0}


def _no_sliding_window(c: dict, name: str) -> None:
    if c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or ()):
        raise Unsupported(f"config.json: use_sliding_window=True is not supported ({name}'s window covers only some "
                          "layers; the GPT family's model.window covers all)")


def _qwen2_to_ours(c: dict, keys: set) -> dict:
    _no_sliding_window(c, "Qwen2")
    return {**_decoder_to_ours({**c, "attention_bias": False}, keys), "qkv_bias": True}


def _qwen3_to_ours(c: dict, keys: set) -> dict:
    _no_sliding_window(c, "Qwen3")
    return {**_decoder_to_ours(c, keys), "qk_norm": True}


def _decoder_to_theirs(m: dict, name: str, **needed) -> dict:
    require(m, name, family="gpt", positions="rotary", activation="swiglu", norm="rmsnorm", norm_placement="pre",
            use_bias=False, **{"qkv_bias": False, **needed})
    h = m["num_heads"]
    return dict(vocab_size=m["vocab_size"], num_hidden_layers=m["num_layers"], hidden_size=m["d_model"],
                num_attention_heads=h, num_key_value_heads=m["num_kv_heads"] or h,
                head_dim=m["head_dim"] or m["d_model"] // h, intermediate_size=m["mlp_dim"],
                max_position_embeddings=m["max_len"], hidden_act="silu", rms_norm_eps=m["norm_epsilon"],
                tie_word_embeddings=m["tie_embeddings"], attention_dropout=m["dropout"], attention_bias=False,
                mlp_bias=False, **_rope_to_theirs(m))


def _mistral_to_theirs(m: dict) -> dict:
    return {**_decoder_to_theirs(m, "Mistral"), "sliding_window": m["window"] or None}


def _qwen2_to_theirs(m: dict) -> dict:
    return {**_decoder_to_theirs(m, "Qwen2", qkv_bias=True, window=0), "use_sliding_window": False}


def _qwen3_to_theirs(m: dict) -> dict:
    return {**_decoder_to_theirs(m, "Qwen3", qk_norm=True, window=0), "use_sliding_window": False}


AUX_LOSS_COEF = 0.001  # transformers' router_aux_loss_coef where config.json has none (Mixtral's and Qwen3-MoE's)


def _router_to_ours(c: dict) -> dict:
    return {"load_balance_weight": c.get("router_aux_loss_coef", AUX_LOSS_COEF) * c["num_experts_per_tok"]}


def _router_to_theirs(train: dict, m: dict) -> dict:
    return {"router_aux_loss_coef": train["load_balance_weight"] / m["experts_per_token"]}


def _experts_to_ours(c: dict, experts: int, width: int, normalize: bool) -> dict:
    return dict(num_experts=experts, experts_per_token=c["num_experts_per_tok"], moe_mlp_dim=width,
                normalize_topk=normalize)


def _mixtral_to_ours(c: dict, keys: set) -> dict:
    return {**_mistral_to_ours(c, keys), **_experts_to_ours(c, c["num_local_experts"], 0, True)}


def _mixture_layers_to_ours(c: dict) -> dict:
    """Qwen3-MoE's mixture layers (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers -> moe_every and
    dense_first where they say which, else moe_every and dense_layers."""
    layers, step, dense = c["num_hidden_layers"], c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    mixtures = [(i + 1) % step == 0 and i not in dense for i in range(layers)]
    if not any(mixtures):
        raise Unsupported(f"config.json: decoder_sparse_step={step} and mlp_only_layers={dense} make no layer a "
                          "mixture of experts")
    first = mixtures.index(True)
    first = 0 if first < step else first
    if mixtures == mixture_layers(layers, step, first):
        return dict(moe_every=step, dense_first=first, dense_layers="")
    return dict(moe_every=step, dense_first=0, dense_layers=",".join(str(i) for i in sorted(set(dense))
                                                                     if 0 <= i < layers and (i + 1) % step == 0))


def _qwen3_moe_to_ours(c: dict, keys: set) -> dict:
    experts = c.get("num_experts", c.get("num_local_experts"))
    window = (c.get("sliding_window") or 0) if c.get("use_sliding_window") else 0
    return {**_qwen3_to_ours({**c, "use_sliding_window": False}, keys), "window": window,
            **_mixture_layers_to_ours(c),
            **_experts_to_ours(c, experts, c["moe_intermediate_size"], c.get("norm_topk_prob", False))}


def _mixtral_to_theirs(m: dict) -> dict:
    return {**_decoder_to_theirs(m, "Mixtral", shared_expert_dim=0, normalize_topk=True, moe_every=1, dense_first=0,
                                 dense_layers=""),
            "sliding_window": m["window"] or None, "intermediate_size": m["moe_mlp_dim"] or m["mlp_dim"],
            "num_local_experts": m["num_experts"], "num_experts_per_tok": m["experts_per_token"]}


def _qwen3_moe_to_theirs(m: dict) -> dict:
    return {**_decoder_to_theirs(m, "Qwen3-MoE", qk_norm=True, shared_expert_dim=0),
            "use_sliding_window": bool(m["window"]), "sliding_window": m["window"] or None,
            "num_experts": m["num_experts"],
            "num_experts_per_tok": m["experts_per_token"], "moe_intermediate_size": m["moe_mlp_dim"] or m["mlp_dim"],
            "norm_topk_prob": m["normalize_topk"], "decoder_sparse_step": m["moe_every"],
            "mlp_only_layers": [i for i, mixture in enumerate(_mixtures(m)) if (i + 1) % m["moe_every"] == 0
                                and not mixture]}


def _mixtures(m: dict) -> list[bool]:
    return mixture_layers(m["num_layers"], m.get("moe_every", 1), m.get("dense_first", 0), m.get("dense_layers", ""))


def _weight(theirs: str, ours: str, heads_in: int = 0, heads_out: int = 0) -> Rule:
    return linear(theirs, ours, heads_in=heads_in, heads_out=heads_out)[0]


def _attention_rules(m: dict) -> list[Rule]:
    """One layer's self-attention: q, k, v (their biases where `qkv_bias`), o, and the query's and key's
    norms where `qk_norm`."""
    h, kv = m["num_heads"], m["num_kv_heads"] or m["num_heads"]
    rules = [_weight("self_attn.o_proj", "self_attn/out", heads_out=h)]
    for theirs, ours, heads in [("q_proj", "query", h), ("k_proj", "key", kv), ("v_proj", "value", kv)]:
        rules += linear(f"self_attn.{theirs}", f"self_attn/{ours}", heads_in=heads)[:2 if m.get("qkv_bias") else 1]
    if m.get("qk_norm"):
        rules += [same("self_attn.q_norm.weight", "self_attn/query_norm/scale"),
                  same("self_attn.k_norm.weight", "self_attn/key_norm/scale")]
    return rules


def dense_mlp_rules(m: dict) -> list[Rule]:
    """One layer's SwiGLU mlp (a mixture of experts' architecture passes its own to `decoder`)."""
    return [_weight(f"mlp.{theirs}_proj", f"mlp/{theirs}") for theirs in ("gate", "up", "down")]


def expert_rules(router: str, experts: str, names: dict[str, str]):
    """The mlp rules of a mixture (for `decoder`): the Linear `router`, and expert e's Linears
    `experts`.e.{theirs} for each of `names` {theirs: ours (gate | up | down)}."""
    def rules(m: dict) -> list[Rule]:
        return [_weight(router, "mlp/router"), *(expert(f"{experts}.{e}.{theirs}", f"mlp/{ours}", e)
                                                for e in range(m["num_experts"]) for theirs, ours in names.items())]
    return rules


def _decoder_rules(m: dict, mlp_rules) -> list[Rule]:
    """Every weight: the layers' attention and norms, the mlp of each layer (`mlp_rules` where it is a mixture)."""
    layer = [same("input_layernorm.weight", "self_attn_norm/scale"),
             same("post_attention_layernorm.weight", "mlp_norm/scale"), *_attention_rules(m)]
    rules = [same("embed_tokens.weight", "embed/embedding"), same("norm.weight", "final_norm/scale")]
    rules += per_layer(layer, m["num_layers"], "layers.{}", "block_{}")
    for i, mixture in enumerate(_mixtures(m)):
        rules += per_layer((mlp_rules if mixture else dense_mlp_rules)(m), 1, f"layers.{i}", f"block_{i}")
    if not m["tie_embeddings"] and m.get("head", "lm") == "lm":
        rules.append(Rule("lm_head.weight", ("unembed/kernel",), lambda w: (w.T,), lambda k: k.T))
    return rules


def decoder(model_type: str, name: str, to_ours, to_theirs, mlp_rules=dense_mlp_rules,
            experts: bool = False) -> Architecture:
    """The architecture of transformers' {name}ForCausalLM and {name}Model: the layers' weights by
    `_decoder_rules`, their mlp's by `mlp_rules(config.model)` (a mixture of experts' where `experts`, with
    its router's load-balancing weight in config.train)."""
    causal, plain = f"{name}ForCausalLM", f"{name}Model"
    heads = {causal: dict(head="lm"), plain: dict(head="none")}
    return Architecture(
        family="gpt", model_type=model_type, prefix="model", heads=heads, to_ours=to_ours, to_theirs=to_theirs,
        rules=lambda m: _decoder_rules(m, mlp_rules),
        class_of=lambda m: causal if m.get("head", "lm") == "lm" else plain,
        base_class=plain, head_keys=("lm_head",), ignored=r"lm_head\.weight|layers\.\d+\.self_attn\.rotary_emb\..*",
        experts=experts, **(dict(train_to_ours=_router_to_ours, train_to_theirs=_router_to_theirs) if experts else {}),
    )


LLAMA = decoder("llama", "Llama", _llama_to_ours, lambda m: _decoder_to_theirs(m, "Llama", window=0))
MISTRAL = decoder("mistral", "Mistral", _mistral_to_ours, _mistral_to_theirs)
QWEN2 = decoder("qwen2", "Qwen2", _qwen2_to_ours, _qwen2_to_theirs)
QWEN3 = decoder("qwen3", "Qwen3", _qwen3_to_ours, _qwen3_to_theirs)
MIXTRAL = decoder("mixtral", "Mixtral", _mixtral_to_ours, _mixtral_to_theirs, experts=True,
                  mlp_rules=expert_rules("block_sparse_moe.gate", "block_sparse_moe.experts",
                                         {"w1": "gate", "w3": "up", "w2": "down"}))
QWEN3_MOE = decoder("qwen3_moe", "Qwen3Moe", _qwen3_moe_to_ours, _qwen3_moe_to_theirs, experts=True,
                    mlp_rules=expert_rules("mlp.gate", "mlp.experts",
                                           {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}))
ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE)


def exports(m: dict) -> Architecture | None:
    """The decoder architecture a GPT-family config.model exports to (None: GPT-2's); a mixture of experts
    goes to Qwen3-MoE with qk_norm, else to Mixtral."""
    if m.get("positions") != "rotary" and m.get("norm") != "rmsnorm":
        if m.get("num_experts"):
            raise Unsupported(f"config.model.num_experts={m['num_experts']} has no equivalent in transformers' gpt2: "
                              "a mixture exports as Mixtral or Qwen3-MoE, which need model.positions='rotary' and "
                              "model.norm='rmsnorm'")
        return None
    if m.get("num_experts"):
        return QWEN3_MOE if m.get("qk_norm") else MIXTRAL
    if m.get("qk_norm"):
        return QWEN3
    if m.get("qkv_bias"):
        return QWEN2
    return MISTRAL if m.get("window") else LLAMA
