"""Model families, each in its own file; `build(config.model)` imports the family named there.

A family module provides:
  PRESETS                          sizes by preset name (a lookup table)
  default_model_config(preset)     every model field, with the preset's sizes, plus 'family'
  build(model_config)              the flax module; unknown or inconsistent keys fail naming them
  example_inputs(model)            abstract inputs (jax.ShapeDtypeStruct) for `model.init`
"""

import importlib

import flax.linen as nn
import jax

FAMILIES = ("gpt", "bert", "vit", "encdec")


def family(name: str):
    if name not in FAMILIES:
        raise ValueError(f"config.model.family={name!r}: choose one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"transformer.models.{name}")


def build(model_config):
    return family(model_config["family"]).build(model_config)


def count_params(model_config) -> int:
    """The number of parameters of `build(model_config)`, from shapes alone (nothing allocated)."""
    fam = family(model_config["family"])
    model = fam.build(model_config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), *fam.example_inputs(model))["params"]
    return sum(x.size for x in jax.tree.leaves(nn.unbox(shapes)))
