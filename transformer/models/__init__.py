"""Model families, each in its own file; `build(config.model)` imports the family named there."""

import importlib

FAMILIES = ("gpt",)


def family(name: str):
    """The module of a family: it provides PRESETS, build(model_config) and default_model_config(preset)."""
    if name not in FAMILIES:
        raise ValueError(f"config.model.family={name!r}: choose one of {', '.join(FAMILIES)}")
    return importlib.import_module(f"transformer.models.{name}")


def build(model_config):
    return family(model_config["family"]).build(model_config)
