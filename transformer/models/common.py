"""What every family file shares: typed construction from config.model and preset tables."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.layers.block import REMAT_POLICIES

_NOT_FIELDS = ("parent", "name")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


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
    check_shared(model)
    validate(model)
    return model


def check_shared(model: nn.Module) -> None:
    """The fields every family has: remat policy and compute / parameter dtypes."""
    checks = [(model.remat.replace("-", "_") in REMAT_POLICIES,
               f"config.model.remat={model.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")]
    for key in ("dtype", "param_dtype"):
        value = getattr(model, key)
        checks.append((value in _FLOAT_DTYPES,
                       f"config.model.{key}={value!r}: choose one of {', '.join(_FLOAT_DTYPES)}"))
    check(checks)


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


def stack_layers(params: dict, name: str, num_layers: int) -> dict:
    """Unscanned params ({name}_0 ... {name}_{N-1}) -> the scanned layout ({name}s/block, leading [N])."""
    layers = [params[f"{name}_{i}"] for i in range(num_layers)]
    rest = {k: v for k, v in params.items() if k not in {f"{name}_{i}" for i in range(num_layers)}}
    return {**rest, f"{name}s": {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}}


def unstack_layers(params: dict, name: str) -> dict:
    """The scanned layout ({name}s/block, leading [N]) -> unscanned params ({name}_0 ...)."""
    stacked = params[f"{name}s"]["block"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != f"{name}s"}
    return {**rest, **{f"{name}_{i}": jax.tree.map(lambda x: x[i], stacked) for i in range(num_layers)}}


def match_layers(source: dict, target: dict) -> dict:
    """`source` params with each layer stack put in `target`'s layout (scanned or unscanned)."""
    for key in target:
        name = key[:-1]
        if key.endswith("s") and f"{name}_0" in source and key not in source:
            count = sum(1 for k in source if k.startswith(f"{name}_") and k[len(name) + 1:].isdigit())
            source = stack_layers(source, name, count)
        elif key.endswith("_0") and f"{key[:-2]}s" in source and key not in source:
            source = unstack_layers(source, key[:-2])
    return source
