"""ViT: a Vision Transformer image classifier (Dosovitskiy et al. 2021).

Glossary of shapes: B batch, H/W image height/width, C channels, P patches, T tokens
(P, plus one with the [CLS] token), D model width, N classes.

    images [B, H, W, C] -> PatchEmbed [B, P, D] (+ [CLS]) + learned positions [B, T, D]
                        -> num_layers x Block(pre-LN, no mask) -> norm
                        -> pool ([CLS] token or mean over patches) [B, D] -> head -> logits [B, N]
    head='none': {'hidden': [B, T, D], 'pooled': tanh(dense(hidden[:, 0])) [B, D] when `pooler`}
"""


import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.layers import embeddings
from transformer.layers.attention import Mask
from transformer.layers.block import apply_blocks
from transformer.models import common
from transformer.sharding import CLASSES, EMBED, MLP

POOLS = ("cls", "mean")
HEADS = ("classifier", "none")

# ti16 ... l16: the ViT paper's sizes at 224 x 224 with 16 x 16 patches and 1000 classes.
PRESETS = {
    "tiny": dict(image_size=8, patch_size=2, channels=1, num_classes=10, num_layers=3, d_model=96,
                 num_heads=4, mlp_dim=192, pool="mean"),
    "ti16": dict(num_layers=12, d_model=192, num_heads=3, mlp_dim=768),
    "s16": dict(num_layers=12, d_model=384, num_heads=6, mlp_dim=1536),
    "b16": dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072),
    "l16": dict(num_layers=24, d_model=1024, num_heads=16, mlp_dim=4096),
}


class ViT(common.Shared):
    """Image classifier. Fields are the keys of `config.model` (less `family`); the shared ones (sizes,
    norm, dropout, dtypes, remat, scan, attention) are declared in `common.Shared`, redeclared here
    where ViT's default differs. Its blocks are pre-norm; stochastic depth: layers/block.py."""

    activation: str = "gelu_exact"
    norm_epsilon: float = 1e-6
    image_size: int = 224          # the side S of the square images it takes (0: the data's, training/shapes.py)
    patch_size: int = 16           # the side of each square patch (a token)
    channels: int = 3              # the images' channels (1: grayscale, 3: RGB; 0: the data's)
    num_classes: int = 1000        # classes of the classifier head (0: the data's)
    pool: str = "cls"              # what the head reads: cls (a [CLS] token) | mean (of the patches)
    head: str = "classifier"       # classifier (logits) | none (the hidden states)
    pooler: bool = False           # with head none: a pooled output (dense + tanh of the first token)
    drop_path: float = 0.0         # stochastic depth's rate at the top layer (linear from 0 at the bottom)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + (self.pool == "cls")

    @nn.compact
    def __call__(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array | dict:
        """images [B, H, W, C] float -> logits [B, N] in float32 (head='none': a dict, see above)."""
        dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
        x = embeddings.PatchEmbed(self.patch_size, self.d_model, dtype=dtype, param_dtype=param_dtype,
                                  name="patch_embed")(images.astype(dtype))  # [B, P, D]
        if self.pool == "cls":
            cls = self.param("cls", nn.with_logical_partitioning(nn.initializers.zeros, (None, None, EMBED)),
                             (1, 1, self.d_model), param_dtype)
            cls = jnp.broadcast_to(cls.astype(dtype), (x.shape[0], 1, self.d_model))  # [B, 1, D]
            x = jnp.concatenate([cls, x], axis=1)  # [B, T, D]
        x = embeddings.LearnedPositions(self.num_tokens, self.d_model, param_dtype=param_dtype,
                                        name="pos_embed")(x)
        x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
        x = apply_blocks(self._blocks(), x, deterministic=deterministic)
        x = self.make_norm("final_norm")(x)
        if self.head == "none":
            return self._hidden_outputs(x, dtype, param_dtype)
        pooled = self.readout(x[:, 0] if self.pool == "cls" else x.mean(axis=1))  # [B, D]
        logits = nn.Dense(self.num_classes, dtype=dtype, param_dtype=param_dtype,
                          kernel_init=nn.with_logical_partitioning(nn.initializers.zeros, (EMBED, CLASSES)),
                          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (CLASSES,)),
                          name="head")(pooled)  # [B, N]
        return logits.astype(jnp.float32)

    def _hidden_outputs(self, x: jax.Array, dtype, param_dtype) -> dict:
        out = {"hidden": x}
        if self.pooler:
            dense = nn.Dense(self.d_model, dtype=dtype, param_dtype=param_dtype,
                             kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(),
                                                                      (EMBED, MLP)),
                             bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (MLP,)),
                             name="pooler")
            out["pooled"] = jnp.tanh(dense(x[:, 0]))
        return {k: v.astype(jnp.float32) for k, v in out.items()}

    def _blocks(self) -> list[nn.Module]:
        return self.stack("block", self.num_layers, head_dim=self.d_model // self.num_heads, norm_placement="pre",
                          drop_path=self.drop_path, kernel_init=nn.initializers.xavier_uniform(), init_shrinks=True)


def validate(model: ViT) -> None:
    """Raises ValueError naming the config.model key that is inconsistent."""
    common.check([
        *common.shape_checks(model, "image_size", "channels", "num_classes"),
        (model.patch_size > 0 and model.image_size % model.patch_size == 0,
         f"config.model.image_size={model.image_size} is not divisible by patch_size={model.patch_size}"),
        *common.head_width_checks(model),
        *common.attention_checks(model),
        (not model.pooler or model.head == "none", "config.model.pooler=True needs config.model.head='none'"),
        (0 <= model.drop_path < 1, f"config.model.drop_path={model.drop_path} must be in [0, 1)"),
        (not (model.drop_path and model.scan_layers),
         "config.model.drop_path grows with depth, which a scanned stack cannot express: set "
         "config.model.scan_layers=False"),
    ])


def task(model: ViT) -> str:
    if model.head != "classifier":
        raise ValueError(f"config.model.head={model.head!r} (hidden states) has no training task: set it to "
                         "'classifier'")
    return "image_classification"


def cost(model: ViT, config) -> common.Cost:
    """The blocks' matrices multiply each of the T tokens, the patch embedding the P patches, the
    head and pooler one token per image."""
    tokens, width = model.num_tokens, model.d_model
    per_path = {"patch_embed": model.num_patches, "head": 1, "pooler": 1}
    return common.Cost(tokens=tokens, weight_tokens=lambda path: per_path.get(path[0], tokens),
                       attention=(common.Attention(model.num_layers, width,
                                                         common.scored_pairs(model, Mask(), tokens, tokens)),),
                       context=f"T = {tokens:,} tokens per image")


def example_inputs(model: ViT) -> tuple:
    """Abstract inputs for `model.init` (shapes only): one image."""
    return (jax.ShapeDtypeStruct((1, model.image_size, model.image_size, model.channels), jnp.float32),)


FAMILY = common.Family(
    name="vit", module=ViT, presets=PRESETS, example_inputs=example_inputs, validate=validate, task=task,
    cost=cost, choices={"head": HEADS, "pool": POOLS},
    no_generation="vit models are image classifiers: they do not generate; score this one with python -m "
                  "transformer.evaluate --workdir {workdir}, label new images with python -m transformer.predict "
                  "--workdir {workdir} --input FOLDER",
    config_file=lambda model: "vit.py:b16",
    no_lens="the logit lens reads tokens through a vocabulary; a vit classifies images and has none",
)
build = FAMILY.build
default_model_config = FAMILY.model_config
