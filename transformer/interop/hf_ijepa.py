"""I-JEPA on the ViT family: IJepaForImageClassification and IJepaModel, the ViT that classifies the mean
of its patches.

I-JEPA's encoder is ViT's (pre-LN blocks, biases, learned positions, a final LayerNorm of
`layer_norm_eps`) without a [CLS] token: its positions cover the P patches alone, and its classifier
reads the mean of the final-normed patches, which is `model.pool='mean'` here. Its checkpoints name
their weights as ViT's do (`encoder.layer.N.attention.attention.query`, ...), less `cls_token`, under
the prefix `ijepa`. IJepaModel (head 'none') has no pooler unless built with `add_pooling_layer`,
which config.json cannot say: `model.pooler=True` is refused.

Weight layouts: as ViT's (hf_families.py); position_embeddings [1, P, D] -> pos_embed [P, D].
"""

from transformer.interop.hf_families import Architecture, require, vit_keys, vit_rules, vit_to_ours


def _to_ours(c: dict, keys: set) -> dict:
    return {**vit_to_ours(c, keys), "pool": "mean", "pooler": False}


def _to_theirs(m: dict) -> dict:
    require(m, "I-JEPA", pool="mean", norm="layernorm", pooler=False)
    return vit_keys(m)


IJEPA = Architecture(
    family="vit", model_type="ijepa", prefix="ijepa",
    heads={"IJepaForImageClassification": dict(head="classifier"), "IJepaModel": dict(head="none")},
    to_ours=_to_ours, to_theirs=_to_theirs, rules=vit_rules,
    class_of=lambda m: "IJepaForImageClassification" if m["head"] == "classifier" else "IJepaModel",
    base_class="IJepaModel", head_keys=("classifier.",), ignored=r"pooler\..*",
)


def exports(m: dict) -> Architecture | None:
    """I-JEPA for a ViT that pools the mean of its patches (None: ViT's)."""
    return IJEPA if m.get("pool") == "mean" else None
