"""What every family file shares: typed construction from config.model and preset tables."""

import dataclasses

import flax.linen as nn

_NOT_FIELDS = ("parent", "name")


def fields_of(cls: type[nn.Module]) -> dict:
    """Every config field of a module class with its default."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in _NOT_FIELDS}


def build(cls: type[nn.Module], family: str, model_config, validate) -> nn.Module:
    """config.model (a dict-like with `family`) -> cls(**fields); unknown keys fail naming them."""
    fields = {k: v for k, v in dict(model_config).items() if k != "family"}
    unknown = sorted(set(fields) - set(fields_of(cls)))
    if unknown:
        raise ValueError(f"unknown config.model keys for the {family} family: {', '.join(unknown)}")
    model = cls(**fields)
    validate(model)
    return model


def preset_config(cls: type[nn.Module], family: str, presets: dict, preset: str) -> dict:
    """All fields of `cls` with the preset's sizes filled in, plus `family`."""
    if preset not in presets:
        raise ValueError(f"unknown {family} preset {preset!r}; choose one of {', '.join(presets)}")
    return {"family": family, **fields_of(cls), **presets[preset]}


def check(checks: list[tuple[bool, str]]) -> None:
    """Raises ValueError with the message of the first failed (ok, message) check."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
