"""How a model's scales follow its width and depth: the standard parametrization (`sp`) or muP.

`sp` is every family's own initialisation and one learning rate for all parameters. `mup` (the maximal
update parametrization, Yang et al. 2022, "Tensor Programs V") keeps each layer's activations and their
updates the same size as the width grows, so that a learning rate tuned at `mup_base_width` holds at any
width. With m = d_model / mup_base_width (every hidden width, heads x Dh and the mlp's, grows with it):

  hidden matrices  (every Block kernel, the experts' and routers' too) init std x m^-1/2 where the family's
                   init is a constant std (GPT, BERT; ViT's Xavier and T5's d^-1/2 already shrink so);
                   AdamW and Lion lr x 1/m (`lr_multipliers`); Muon's orthogonalised update x
                   sqrt(fan_out / fan_in), width-free already (training/optim.py)
  embeddings, norms, biases, the output head   init and lr unchanged
  output logits    the hidden state before the head x 1/m (`readout`)
  attention        scores q.k / Dh instead of q.k / sqrt(Dh)

`mup_base_depth` > 0 adds CompleteP's depth rule (Dey et al. 2025, alpha = 1): each residual branch is
multiplied by mup_base_depth / num_layers, so that a learning rate tuned at that depth holds at any depth
(for AdamW the lr needs no depth factor at alpha = 1), and the family's depth-scaled init of the branches'
output projections (GPT-2's 1/sqrt(2N)) gives way to its plain hidden init.

The record travels whole (a field of `models.common.Shared`); its keys are config.model's.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from transformer.layers import moe

PARAMETRIZATIONS = ("sp", "mup")


@dataclasses.dataclass(frozen=True)
class Parametrization:
    """config.model's parametrization keys, one record."""

    parametrization: str = "sp"  # sp (each family's own scales) | mup (width transfer: layers/parametrization.py)
    mup_base_width: int = 0      # mup: the d_model whose learning rate transfers (the width it was tuned at)
    mup_base_depth: int = 0      # mup: > 0 scales residual branches by mup_base_depth / num_layers (CompleteP)

    @property
    def mup(self) -> bool:
        return self.parametrization == "mup"

    def check(self) -> None:
        """Fails naming the config.model key that is out of its range."""
        if self.parametrization not in PARAMETRIZATIONS:
            raise ValueError(f"config.model.parametrization={self.parametrization!r}: choose one of "
                             f"{', '.join(PARAMETRIZATIONS)}")
        if self.mup and self.mup_base_width < 1:
            raise ValueError("config.model.parametrization=mup needs config.model.mup_base_width: the d_model the "
                             "learning rate was tuned at")
        if self.mup_base_depth < 0 or (self.mup_base_depth and not self.mup):
            raise ValueError(f"config.model.mup_base_depth={self.mup_base_depth} needs "
                             "config.model.parametrization=mup (and must not be negative; 0: no depth scaling)")

    def width_mult(self, d_model: int) -> float:
        """m = d_model / mup_base_width under muP, 1 under sp."""
        return d_model / self.mup_base_width if self.mup else 1.0

    def residual_scale(self, num_layers: int) -> float:
        """What each residual branch is multiplied by: mup_base_depth / num_layers under CompleteP, else 1."""
        return self.mup_base_depth / num_layers if self.mup and self.mup_base_depth else 1.0

    def block_fields(self, d_model: int, num_layers: int, fields: dict, init_shrinks: bool) -> dict:
        """A stack's Block fields with the parametrization's scales: under sp `fields` itself, untouched.
        `init_shrinks` says the family's kernel init already shrinks as 1/sqrt(fan_in) (left as it is)."""
        if not self.mup:
            return fields
        fields = dict(fields)
        if self.mup_base_depth:
            fields["out_kernel_init"] = None  # the depth rule is the branch multiplier, not the init
        if not init_shrinks:
            factor = self.width_mult(d_model) ** -0.5
            for key in ("kernel_init", "out_kernel_init"):
                if fields.get(key) is not None:
                    fields[key] = scaled(fields[key], factor)
        return {**fields, "attention_scale": 1.0 / fields["head_dim"],
                "residual_scale": self.residual_scale(num_layers)}

    def readout(self, x: jax.Array, d_model: int) -> jax.Array:
        """The hidden state x [..., D] as the output head takes it: x / m under muP, x itself under sp."""
        return x * (1.0 / self.width_mult(d_model)) if self.mup else x


def scaled(init: Callable, factor: float) -> Callable:
    """The initializer `init` with its draws multiplied by `factor`."""
    return lambda key, shape, dtype=jnp.float32: init(key, shape, dtype) * jnp.asarray(factor, dtype)


def lr_multiplier(path_names: list[str], ndim: int, mult: float) -> float:
    """A parameter's learning-rate multiplier under muP with AdamW or Lion: 1/m for the hidden matrices (a
    `kernel` of two or more axes outside the embeddings and the output head, or an expert's stacked kernel),
    1 for the rest (embeddings, the head, norms, biases, the patch projection)."""
    name = path_names[-1] if path_names else ""
    outside = any(n in OUTSIDE for n in path_names)
    hidden = not outside and ((name == "kernel" and ndim >= 2) or name in moe.EXPERT_KERNELS)
    return 1.0 / mult if hidden else 1.0


OUTSIDE = ("patch_embed", "unembed", "head", "embed", "classifier", "nsp")  # input and output layers



def optimizer_width_mult(model_config) -> float | None:
    """muP's m = d_model / mup_base_width for the optimizer (training/optim.make_optimizer), None under sp
    (or for a model without these keys)."""
    if model_config.get("parametrization", "sp") != "mup":
        return None
    return model_config.d_model / model_config.mup_base_width


def check_same(saved_model_config, model_config, source: str) -> None:
    """Fails in one line where the weights of `source` (a run's config.model: `saved_model_config`) were made
    under another parametrization than `model_config`'s: muP weights mean something else under sp, and under
    another base width or depth."""
    keys = [f.name for f in dataclasses.fields(Parametrization)]
    values = lambda c: {k: c.get(k, getattr(Parametrization(), k)) for k in keys}  # noqa: E731
    saved, here = values(saved_model_config), values(model_config)
    if saved != here:
        said = lambda v: ", ".join(f"{k}={v[k]}" for k in keys)  # noqa: E731
        raise ValueError(f"{source} was trained with model.{said(saved)}, this config has model.{said(here)}: "
                         "set the same model.parametrization and mup_* keys")
