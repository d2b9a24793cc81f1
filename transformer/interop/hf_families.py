"""How each Hugging Face architecture maps onto a family here: config keys and weights.

A `Family` translates a transformers `config.json` into `config.model` fields (refusing,
in one line naming it, any option the family here cannot express) and back, and lists
`Rule`s pairing each weight of the transformers checkpoint with the params here.

Weight layouts (torch Linear [out, in]; GPT-2's Conv1D and the kernels here [in, out]):
  D width, H heads, Dh head width, F mlp width, V vocab, C channels, p patch size,
  T tokens (patches + [CLS]).
  query/key/value kernel [D, H, Dh] <- Linear [H*Dh, D];  out kernel [H, Dh, D] <- Linear [D, H*Dh]
  stacked expert kernel [E, D, F] <- E Linears [F, D], one per expert (E experts)
  patch kernel [p, p, C, D] <- Conv2d [D, C, p, p]
"""

import dataclasses
import re
from collections.abc import Callable

import numpy as np


class Unsupported(ValueError):
    """A transformers config option (or a config.model value on export) with no equivalent here."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One checkpoint tensor `theirs` <-> the params `ours` (paths joined by '/')."""

    theirs: str
    ours: tuple[str, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_theirs: Callable[..., np.ndarray]
    optional: bool = False  # absent from a checkpoint: the param starts at zeros
    index: int | None = None  # the tensor is ours[0][index], one expert of a stacked [E, ...] param


def expert(theirs: str, ours: str, index: int) -> Rule:
    """Expert `index`'s torch Linear `theirs`.weight [out, in] <-> its slice [in, out] of the stacked kernel
    `ours` [E, in, out]."""
    return Rule(f"{theirs}.weight", (ours,), lambda w: (w.T,), lambda k: k[index].T, index=index)


def same(theirs: str, ours: str, optional: bool = False) -> Rule:
    return Rule(theirs, (ours,), lambda w: (w,), lambda w: w, optional)


def linear(theirs: str, ours: str, heads_in: int = 0, heads_out: int = 0, conv1d: bool = False) -> list[Rule]:
    """A torch Linear (or GPT-2 Conv1D) `theirs`.weight/.bias <-> `ours`/kernel, bias; `heads_in`
    splits the output features into [H, Dh] (q, k, v), `heads_out` the input features (out)."""
    def kernel_to_ours(w):
        w = w if conv1d else w.T  # [in, out]
        if heads_in:
            return (w.reshape(w.shape[0], heads_in, -1),)
        return (w.reshape(heads_out, -1, w.shape[1]),) if heads_out else (w,)

    def kernel_to_theirs(k):
        w = k.reshape(-1, k.shape[-1]) if heads_out else k.reshape(k.shape[0], -1)
        return w if conv1d else w.T

    bias_shape = (lambda b: (b.reshape(heads_in, -1),)) if heads_in else (lambda b: (b,))
    return [Rule(f"{theirs}.weight", (f"{ours}/kernel",), kernel_to_ours, kernel_to_theirs),
            Rule(f"{theirs}.bias", (f"{ours}/bias",), bias_shape, lambda b: b.reshape(-1))]


def norm(theirs: str, ours: str, weight: str = "weight", bias: str = "bias") -> list[Rule]:
    return [same(f"{theirs}.{weight}", f"{ours}/scale"), same(f"{theirs}.{bias}", f"{ours}/bias")]


def attention(ours: str, heads: int, query: str, key: str, value: str, out: str) -> list[Rule]:
    """The four Linears of an attention module (their names) <-> `ours`/query, key, value, out."""
    return [*linear(query, f"{ours}/query", heads_in=heads), *linear(key, f"{ours}/key", heads_in=heads),
            *linear(value, f"{ours}/value", heads_in=heads), *linear(out, f"{ours}/out", heads_out=heads)]


def activation_of(name: str, key: str) -> str:
    """A transformers activation name -> the name here."""
    names = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
    if name not in names:
        raise Unsupported(f"{key}={name!r} is not supported (choose one of {', '.join(names)})")
    return names[name]


def activation_for(name: str) -> str:
    return {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}[name]


def refuse(config: dict, **unsupported) -> None:
    """Fails naming the first key whose value is one of the unsupported values (a tuple)."""
    for key, values in unsupported.items():
        if key in config and config[key] in values:
            raise Unsupported(f"config.json: {key}={config[key]!r} is not supported")


# The recipe knobs no transformers class here expresses unless its `require` says otherwise.
PLAIN = dict(qk_norm=False, logit_softcap=0.0, router="softmax", routed_scale=1.0, router_groups=0, embed_norm=False)


def require(model: dict, architecture: str, **needed) -> None:
    """On export: fails naming the first config.model key the transformers class cannot express (`needed`,
    and PLAIN's knobs)."""
    for key, value in {**PLAIN, **needed}.items():
        if model.get(key, value) != value:
            raise Unsupported(f"config.model.{key}={model[key]!r} has no equivalent in transformers' "
                              f"{architecture} (needs {value!r})")


def num_labels(config: dict) -> int:
    return len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)


def labels(n: int) -> dict:
    return {"id2label": {str(i): f"LABEL_{i}" for i in range(n)},
            "label2id": {f"LABEL_{i}": i for i in range(n)}}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One transformers model type and the family here that runs it.

    `heads`: transformers class -> the config.model fields it implies. `to_ours(config, keys)`
    reads config.json (and which weights the checkpoint has); `to_theirs(model)` writes it.
    `train_to_ours(config)`: the config.train fields config.json sets (a mixture's router loss weight);
    `train_to_theirs(train, model)`: the config.json keys config.train writes back.
    `base_class`: the class whose names carry no prefix. `head_keys`: checkpoint names
    outside the base model's prefix. `ignored`: tensors the
    checkpoint may hold that are tied copies or buffers.
    """

    family: str
    model_type: str
    prefix: str
    heads: dict[str, dict]
    to_ours: Callable[[dict, set], dict]
    to_theirs: Callable[[dict], dict]
    rules: Callable[[dict], list[Rule]]
    class_of: Callable[[dict], str]
    base_class: str = ""
    head_keys: tuple[str, ...] = ()
    ignored: str = "$^"
    start_token: str = ""  # the config.json key of the token an encoder-decoder's decoder starts from
    wraps: tuple[str, ...] = ()  # the specials its tokenizer puts around a text ([CLS] text [SEP]), as our tasks do
    experts: bool = False  # its layers' mlp is a mixture of experts (config.model.num_experts > 0)
    train_to_ours: Callable[[dict], dict] = lambda config: {}
    train_to_theirs: Callable[[dict, dict], dict] = lambda train, model: {}

    def check_head(self, m: dict) -> None:
        """On export: fails naming config.model.head where no class of this model type has it."""
        heads = list(dict.fromkeys(fields["head"] for fields in self.heads.values()))
        if m.get("head", heads[0]) not in heads:
            raise Unsupported(f"config.model.head={m['head']!r} has no equivalent in transformers' {self.model_type} "
                              f"(its heads: {', '.join(heads)})")

    def is_head_key(self, key: str) -> bool:
        return key.startswith(self.head_keys)

    def is_ignored(self, key: str) -> bool:
        return re.fullmatch(self.ignored, key) is not None

    def decoder_start(self, config: dict) -> int | None:
        """The id the decoder starts from (the run's [BOS]), where config.json names one."""
        return config.get(self.start_token) if self.start_token else None


# GPT-2 -----------------------------------------------------------------------------------

def _gpt2_to_ours(c: dict, keys: set) -> dict:
    refuse(c, add_cross_attention=(True,), scale_attn_by_inverse_layer_idx=(True,), scale_attn_weights=(False,))
    return dict(vocab_size=c["vocab_size"], num_layers=c["n_layer"], d_model=c["n_embd"], num_heads=c["n_head"],
                mlp_dim=c.get("n_inner") or 4 * c["n_embd"], max_len=c["n_positions"], positions="learned",
                activation=activation_of(c.get("activation_function", "gelu_new"), "activation_function"),
                norm="layernorm", norm_placement="pre", norm_epsilon=c.get("layer_norm_epsilon", 1e-5),
                use_bias=True, tie_embeddings=c.get("tie_word_embeddings", True), dropout=c.get("resid_pdrop", 0.1))


def _gpt2_to_theirs(m: dict) -> dict:
    require(m, "GPT-2", family="gpt", positions="learned", norm="layernorm", norm_placement="pre", use_bias=True,
            num_kv_heads=0, head_dim=0, window=0)
    return dict(vocab_size=m["vocab_size"], n_layer=m["num_layers"], n_embd=m["d_model"], n_head=m["num_heads"],
                n_inner=m["mlp_dim"], n_positions=m["max_len"], activation_function=activation_for(m["activation"]),
                layer_norm_epsilon=m["norm_epsilon"], tie_word_embeddings=m["tie_embeddings"],
                resid_pdrop=m["dropout"], embd_pdrop=m["dropout"], attn_pdrop=m["dropout"])


def _gpt2_rules(m: dict) -> list[Rule]:
    h, d = m["num_heads"], m["d_model"]
    qkv_kernel = Rule("attn.c_attn.weight", tuple(f"self_attn/{n}/kernel" for n in ("query", "key", "value")),
                      lambda w: tuple(x.reshape(d, h, -1) for x in np.split(w, 3, axis=1)),
                      lambda *ks: np.concatenate([k.reshape(d, -1) for k in ks], axis=1))
    qkv_bias = Rule("attn.c_attn.bias", tuple(f"self_attn/{n}/bias" for n in ("query", "key", "value")),
                    lambda b: tuple(x.reshape(h, -1) for x in np.split(b, 3)),
                    lambda *bs: np.concatenate([b.reshape(-1) for b in bs]))
    rules = [same("wte.weight", "embed/embedding"), same("wpe.weight", "pos_embed/embedding"),
             *norm("ln_f", "final_norm")]
    layer = [*norm("ln_1", "self_attn_norm"), *norm("ln_2", "mlp_norm"), qkv_kernel, qkv_bias,
             *linear("attn.c_proj", "self_attn/out", heads_out=h, conv1d=True),
             *linear("mlp.c_fc", "mlp/up", conv1d=True), *linear("mlp.c_proj", "mlp/down", conv1d=True)]
    rules += per_layer(layer, m["num_layers"], "h.{}", "block_{}")
    if not m["tie_embeddings"] and m.get("head", "lm") == "lm":
        rules.append(Rule("lm_head.weight", ("unembed/kernel",), lambda w: (w.T,), lambda k: k.T))
    return rules


def per_layer(rules: list[Rule], count: int, theirs: str, ours: str) -> list[Rule]:
    """`rules` of one layer repeated for layers 0..count-1, their names under the layer prefixes."""
    return [dataclasses.replace(r, theirs=f"{theirs.format(i)}.{r.theirs}",
                                ours=tuple(f"{ours.format(i)}/{o}" for o in r.ours))
            for i in range(count) for r in rules]


GPT2 = Architecture(
    family="gpt", model_type="gpt2", prefix="transformer",
    heads={"GPT2LMHeadModel": dict(head="lm"), "GPT2Model": dict(head="none")},
    to_ours=_gpt2_to_ours, to_theirs=_gpt2_to_theirs, rules=_gpt2_rules,
    class_of=lambda m: "GPT2LMHeadModel" if m.get("head", "lm") == "lm" else "GPT2Model",
    base_class="GPT2Model", head_keys=("lm_head",), ignored=r"lm_head\.weight|h\.\d+\.attn\.(bias|masked_bias)",
)

# BERT ------------------------------------------------------------------------------------

_BERT_HEADS = {"BertModel": dict(head="none"), "BertForMaskedLM": dict(head="pretrain", nsp=False),
               "BertForPreTraining": dict(head="pretrain", nsp=True),
               "BertForSequenceClassification": dict(head="sequence"),
               "BertForTokenClassification": dict(head="token")}


def _bert_to_ours(c: dict, keys: set) -> dict:
    refuse(c, position_embedding_type=("relative_key", "relative_key_query"), is_decoder=(True,),
           add_cross_attention=(True,), tie_word_embeddings=(False,))
    return dict(vocab_size=c["vocab_size"], num_layers=c["num_hidden_layers"], d_model=c["hidden_size"],
                num_heads=c["num_attention_heads"], mlp_dim=c["intermediate_size"],
                max_len=c["max_position_embeddings"], type_vocab_size=c.get("type_vocab_size", 2),
                activation=activation_of(c.get("hidden_act", "gelu"), "hidden_act"), norm="layernorm",
                norm_placement="post", norm_epsilon=c.get("layer_norm_eps", 1e-12),
                dropout=c.get("hidden_dropout_prob", 0.1), num_labels=num_labels(c),
                pooler="pooler.dense.weight" in keys)


def _bert_to_theirs(m: dict) -> dict:
    require(m, "BERT", norm="layernorm", norm_placement="post", window=0)
    return dict(vocab_size=m["vocab_size"], num_hidden_layers=m["num_layers"], hidden_size=m["d_model"],
                num_attention_heads=m["num_heads"], intermediate_size=m["mlp_dim"],
                max_position_embeddings=m["max_len"], type_vocab_size=m["type_vocab_size"],
                hidden_act=activation_for(m["activation"]), layer_norm_eps=m["norm_epsilon"],
                hidden_dropout_prob=m["dropout"], attention_probs_dropout_prob=m["dropout"],
                **labels(m["num_labels"]))


def _bert_rules(m: dict) -> list[Rule]:
    e = "embeddings"
    rules = [same(f"{e}.word_embeddings.weight", "embed/embedding"),
             same(f"{e}.position_embeddings.weight", "pos_embed/embedding"),
             same(f"{e}.token_type_embeddings.weight", "type_embed"), *norm(f"{e}.LayerNorm", "embed_norm")]
    layer = [*attention("self_attn", m["num_heads"], "attention.self.query", "attention.self.key",
                        "attention.self.value", "attention.output.dense"),
             *norm("attention.output.LayerNorm", "self_attn_norm"),
             *linear("intermediate.dense", "mlp/up"), *linear("output.dense", "mlp/down"),
             *norm("output.LayerNorm", "mlp_norm")]
    rules += per_layer(layer, m["num_layers"], "encoder.layer.{}", "block_{}")
    head = m["head"]
    if (head == "none" and m["pooler"]) or head == "sequence" or (head == "pretrain" and m["nsp"]):
        rules += linear("pooler.dense", "pooler")
    if head == "pretrain":
        rules += [*linear("cls.predictions.transform.dense", "mlm_transform"),
                  *norm("cls.predictions.transform.LayerNorm", "mlm_norm"), same("cls.predictions.bias", "mlm_bias")]
        if m["nsp"]:
            rules += linear("cls.seq_relationship", "nsp")
    elif head in ("sequence", "token"):
        rules += linear("classifier", "classifier")
    return rules


def _bert_class(m: dict) -> str:
    if m["head"] == "pretrain":
        return "BertForPreTraining" if m["nsp"] else "BertForMaskedLM"
    return {"none": "BertModel", "sequence": "BertForSequenceClassification",
            "token": "BertForTokenClassification"}[m["head"]]


BERT = Architecture(
    family="bert", model_type="bert", prefix="bert", heads=_BERT_HEADS,
    to_ours=_bert_to_ours, to_theirs=_bert_to_theirs, rules=_bert_rules, class_of=_bert_class,
    base_class="BertModel", head_keys=("cls.", "classifier."), wraps=("[CLS]", "[SEP]"),
    ignored=r"cls\.predictions\.decoder\.(weight|bias)|embeddings\.position_ids|pooler\..*|cls\.seq_relationship\..*",
)

# ViT -------------------------------------------------------------------------------------

def vit_to_ours(c: dict, keys: set) -> dict:
    refuse(c, qkv_bias=(False,))
    for key in ("image_size", "patch_size"):
        if not isinstance(c.get(key, 0), int):
            raise Unsupported(f"config.json: {key}={c[key]!r} is not supported (square sizes only)")
    return dict(image_size=c["image_size"], patch_size=c["patch_size"], channels=c.get("num_channels", 3),
                num_classes=num_labels(c), num_layers=c["num_hidden_layers"], d_model=c["hidden_size"],
                num_heads=c["num_attention_heads"], mlp_dim=c["intermediate_size"], pool="cls",
                activation=activation_of(c.get("hidden_act", "gelu"), "hidden_act"), norm="layernorm",
                norm_epsilon=c.get("layer_norm_eps", 1e-12), dropout=c.get("hidden_dropout_prob", 0.0),
                pooler="pooler.dense.weight" in keys)


def _vit_to_theirs(m: dict) -> dict:
    require(m, "ViT", pool="cls", norm="layernorm")
    return vit_keys(m)


def vit_keys(m: dict) -> dict:
    """config.json of a ViT-shaped config.model `m` (ViT's and I-JEPA's keys)."""
    return dict(image_size=m["image_size"], patch_size=m["patch_size"], num_channels=m["channels"],
                num_hidden_layers=m["num_layers"], hidden_size=m["d_model"], num_attention_heads=m["num_heads"],
                intermediate_size=m["mlp_dim"], hidden_act=activation_for(m["activation"]),
                layer_norm_eps=m["norm_epsilon"], hidden_dropout_prob=m["dropout"],
                attention_probs_dropout_prob=0.0, qkv_bias=True, **labels(m["num_classes"]))


def vit_rules(m: dict) -> list[Rule]:
    e = "embeddings"
    rules = [*([same(f"{e}.cls_token", "cls")] if m["pool"] == "cls" else []),
             Rule(f"{e}.position_embeddings", ("pos_embed/embedding",), lambda w: (w[0],), lambda t: t[None]),
             Rule(f"{e}.patch_embeddings.projection.weight", ("patch_embed/proj/kernel",),
                  lambda w: (w.transpose(2, 3, 1, 0),), lambda k: k.transpose(3, 2, 0, 1)),
             same(f"{e}.patch_embeddings.projection.bias", "patch_embed/proj/bias"), *norm("layernorm", "final_norm")]
    layer = [*attention("self_attn", m["num_heads"], "attention.attention.query", "attention.attention.key",
                        "attention.attention.value", "attention.output.dense"),
             *norm("layernorm_before", "self_attn_norm"), *norm("layernorm_after", "mlp_norm"),
             *linear("intermediate.dense", "mlp/up"), *linear("output.dense", "mlp/down")]
    rules += per_layer(layer, m["num_layers"], "encoder.layer.{}", "block_{}")
    if m["head"] == "none" and m["pooler"]:
        rules += linear("pooler.dense", "pooler")
    if m["head"] == "classifier":
        rules += linear("classifier", "head")
    return rules


VIT = Architecture(
    family="vit", model_type="vit", prefix="vit",
    heads={"ViTModel": dict(head="none"), "ViTForImageClassification": dict(head="classifier", pooler=False)},
    to_ours=vit_to_ours, to_theirs=_vit_to_theirs, rules=vit_rules,
    class_of=lambda m: "ViTForImageClassification" if m["head"] == "classifier" else "ViTModel",
    base_class="ViTModel", head_keys=("classifier.",), ignored=r"pooler\..*",
)

# BART ------------------------------------------------------------------------------------

def _bart_to_ours(c: dict, keys: set) -> dict:
    refuse(c, tie_word_embeddings=(False,), normalize_before=(True,), add_final_layer_norm=(True,))
    for ours, theirs in (("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim")):
        if c[ours] != c[theirs]:
            raise Unsupported(f"config.json: {theirs}={c[theirs]} differs from {ours}={c[ours]} (not supported)")
    return dict(vocab_size=c["vocab_size"], num_layers=c["encoder_layers"], num_decoder_layers=c["decoder_layers"],
                d_model=c["d_model"], num_heads=c["encoder_attention_heads"], mlp_dim=c["encoder_ffn_dim"],
                max_len=c["max_position_embeddings"], positions="learned", position_offset=2,
                scale_embeddings=c.get("scale_embedding", False), embed_norm=True, logits_bias=True,
                activation=activation_of(c.get("activation_function", "gelu"), "activation_function"),
                norm="layernorm", norm_placement="post", norm_epsilon=1e-5, use_bias=True,
                dropout=c.get("dropout", 0.1))


def _bart_to_theirs(m: dict) -> dict:
    require(m, "BART", positions="learned", position_offset=2, embed_norm=True, logits_bias=True,
            norm="layernorm", norm_placement="post", norm_epsilon=1e-5, use_bias=True, head_dim=0, window=0)
    layers = m["num_decoder_layers"] or m["num_layers"]
    return dict(vocab_size=m["vocab_size"], encoder_layers=m["num_layers"], decoder_layers=layers,
                d_model=m["d_model"], encoder_attention_heads=m["num_heads"], decoder_attention_heads=m["num_heads"],
                encoder_ffn_dim=m["mlp_dim"], decoder_ffn_dim=m["mlp_dim"], max_position_embeddings=m["max_len"],
                scale_embedding=m["scale_embeddings"], activation_function=activation_for(m["activation"]),
                dropout=m["dropout"], attention_dropout=0.0, activation_dropout=0.0)


def _bart_rules(m: dict) -> list[Rule]:
    h = m["num_heads"]
    attn = lambda theirs, ours: attention(ours, h,
                                          *(f"{theirs}.{n}" for n in ("q_proj", "k_proj", "v_proj", "out_proj")))
    common = [*linear("fc1", "mlp/up"), *linear("fc2", "mlp/down"), *norm("final_layer_norm", "mlp_norm"),
              *attn("self_attn", "self_attn"), *norm("self_attn_layer_norm", "self_attn_norm")]
    cross = [*attn("encoder_attn", "cross_attn"), *norm("encoder_attn_layer_norm", "cross_attn_norm")]
    rules = [same("shared.weight", "embed/embedding")]
    if m.get("head", "lm") == "lm":
        rules.append(Rule("final_logits_bias", ("logits_bias",), lambda b: (b[0],), lambda b: b[None], optional=True))
    for side, ours in (("encoder", "src"), ("decoder", "tgt")):
        rules += [same(f"{side}.embed_positions.weight", f"{ours}_pos/embedding"),
                  *norm(f"{side}.layernorm_embedding", f"{ours}_embed_norm")]
    rules += per_layer(common, m["num_layers"], "encoder.layers.{}", "encoder_{}")
    rules += per_layer(common + cross, m["num_decoder_layers"] or m["num_layers"], "decoder.layers.{}", "decoder_{}")
    return rules


BART = Architecture(
    family="encdec", model_type="bart", prefix="model",
    heads={"BartForConditionalGeneration": dict(head="lm"), "BartModel": dict(head="none")},
    to_ours=_bart_to_ours, to_theirs=_bart_to_theirs, rules=_bart_rules,
    class_of=lambda m: "BartForConditionalGeneration" if m.get("head", "lm") == "lm" else "BartModel",
    base_class="BartModel",
    head_keys=("final_logits_bias", "lm_head"),
    ignored=r"(encoder|decoder)\.embed_tokens\.weight|lm_head\.weight",
    start_token="decoder_start_token_id",
)

ARCHITECTURES = {a.model_type: a for a in (GPT2, BERT, VIT, BART)}


def architecture_for(family: str) -> Architecture:
    """The transformers architecture a family here exports to."""
    found = [a for a in ARCHITECTURES.values() if a.family == family]
    if not found:
        raise Unsupported(f"config.model.family={family!r} has no transformers export")
    return found[0]
