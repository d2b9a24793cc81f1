"""Loading config files, applying overrides, and the parts every family shares.

A config spec is `path/to/file.py[:arg]`; the file's `get_config(arg)` returns a
locked `ml_collections.ConfigDict`. Its arg is a comma-separated list: a bare word
picks a preset, `key=value` overrides a (dotted) key, e.g.
`configs/gpt.py:tiny,optim.lr=3e-3,model.num_layers=2`. A key the config lacks fails naming the
nearest one it has (`nearest`). `load_with_base` also gives the family's base config (the values
before the preset's training settings and the overrides), which `transformer.config_keys` lists
beside each key's meaning (its table: a key's one line, kept there alone).
"""

import ast
import contextvars
import difflib
import importlib.util
import json
import os
import re

import ml_collections

from transformer import sharding


def parse_arg(arg: str | None, default_preset: str) -> tuple[str, dict[str, str]]:
    """'tiny,optim.lr=1e-3' -> ('tiny', {'optim.lr': '1e-3'}); commas inside brackets belong to a value
    ('tiny,data.mean=(1.0,2.0,3.0)')."""
    preset, overrides = default_preset, {}
    for part in filter(None, re.split(r",(?![^()\[\]]*[)\]])", arg or "")):
        if "=" in part:
            key, value = part.split("=", 1)
            overrides[key.strip()] = value.strip()
        else:
            preset = part.strip()
    if "preset" in overrides:
        preset = overrides.pop("preset")
    return preset, overrides


def parse_value(text: str, like):
    """Parses `text` into the type of the existing value `like`."""
    if isinstance(like, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    if isinstance(like, str) or like is None:
        return text
    value = ast.literal_eval(text)
    return type(like)(value) if isinstance(like, (int, float)) else value


def leaves(config, prefix: str = "") -> dict:
    """Every settable key of `config` (dotted, e.g. 'optim.lr') with its value."""
    found = {}
    for key, value in config.items():
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            found.update(leaves(value, f"{prefix}{key}."))
        else:
            found[prefix + key] = value
    return found


def nearest(key: str, known) -> str | None:
    """The key of `known` closest to the misspelt `key`: spelled alike, or the initials of its last part
    ('optim.learning_rate' -> 'optim.lr')."""
    parent, _, last = key.rpartition(".")
    initials = ".".join(filter(None, [parent, "".join(word[:1] for word in last.split("_"))]))
    if "_" in last and initials in known:
        return initials
    return next(iter(difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)), None)


def unknown_key(key: str, config) -> KeyError:
    """The error of setting `key` where `config` has no such key, naming the nearest it has."""
    near = nearest(key, leaves(config))
    return KeyError(f"unknown config key {key}" + (f"; did you mean {near}?" if near else ""))


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
    """Sets each dotted key; an unknown key fails naming the nearest known one."""
    for key, text in overrides.items():
        node, *path = config, *key.split(".")
        for part in path[:-1]:
            if not isinstance(node.get(part), (dict, ml_collections.ConfigDict)):
                raise unknown_key(key, config)
            node = node[part]
        if path[-1] not in node or isinstance(node[path[-1]], (dict, ml_collections.ConfigDict)):
            raise unknown_key(key, config)
        try:
            node[path[-1]] = parse_value(text, node[path[-1]])
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"config key {key!r}: cannot parse {text!r}: {e}") from None


def load(spec: str, overrides: list[str] | tuple[str, ...] = ()) -> ml_collections.ConfigDict:
    """Loads `path.py[:arg]` and applies `key=value` overrides."""
    return load_with_base(spec, overrides)[0]


# Where `finish` puts the base config it makes, while `load_with_base` asks for it.
_BASES: contextvars.ContextVar[list | None] = contextvars.ContextVar("bases", default=None)


def load_with_base(spec: str, overrides=()) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict | None]:
    """`load(spec, overrides)` and its base: what its get_config held before the preset's training settings
    and the overrides (None for a file whose get_config does not end in `finish`)."""
    bases = []
    token = _BASES.set(bases)
    try:
        config = _load(spec)
    finally:
        _BASES.reset(token)
    apply_overrides(config, dict(o.split("=", 1) for o in overrides))
    return config, (bases[-1] if bases else None)


def _load(spec: str) -> ml_collections.ConfigDict:
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file not found: {path}")
    module_spec = importlib.util.spec_from_file_location("_config_module", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def from_json(path: str) -> ml_collections.ConfigDict:
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
"""The families' config files (gpt.py, ...): the repository's configs/ beside the package installed from it."""


def shown_path(path: str) -> str:
    """`path` as a command shows it: relative to the working directory where it lies under it, else absolute."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else os.path.abspath(path)


def save_json(config: ml_collections.ConfigDict, path: str) -> None:
    with open(path, "w") as f:
        f.write(config.to_json(indent=2, sort_keys=True))


def finish(c: ml_collections.ConfigDict, training: dict, overrides: dict) -> ml_collections.ConfigDict:
    """The end of every get_config: adds mesh and init_from, then the preset's `training` settings
    ({section: values}) and the arg's overrides; locks the config. (The training task is the
    model's: its family names it, by the model's head.)"""
    c.mesh = mesh_config()
    c.init_from = ""
    c.lora = lora_config()
    if (bases := _BASES.get()) is not None:
        bases.append(c.copy_and_resolve_references())
    for section, values in training.items():
        c[section].update(values)
    apply_overrides(c, overrides)
    c.lock()
    return c


def lora_config() -> ml_collections.ConfigDict:
    """Low-rank adapters on named kernels (transformer/layers/lora.py); only they train."""
    return ml_collections.ConfigDict(dict(
        rank=0,
        alpha=16.0,
        dropout=0.0,
        targets="attention",
    ))


def mesh_config() -> ml_collections.ConfigDict:
    """Pure data parallelism over every device; rules give FSDP / context / tensor / expert parallelism
    when sized."""
    return ml_collections.ConfigDict(dict(
        data=-1,
        fsdp=1,
        context=1,
        tensor=1,
        expert=1,
        rules=[[name, list(axes) if isinstance(axes, tuple) else axes]
               for name, axes in sharding.DEFAULT_RULES],
    ))


def optim_config(**overrides) -> ml_collections.ConfigDict:
    """The optimizer, its learning-rate schedule and clipping (transformer/training/optim.py); the
    batch's gradient accumulated over `accum_steps` microbatches."""
    return ml_collections.ConfigDict(dict(dict(
        optimizer="adamw",
        lr=3e-4,
        warmup_steps=100,
        schedule="cosine",
        final_lr_fraction=0.1,
        decay_fraction=0.2,
        cooldown="linear",
        b1=0.9, b2=0.95, eps=1e-8,
        weight_decay=0.1,
        clip_norm=1.0,
        accum_steps=1,
        muon_momentum=0.95,
        muon_ns_steps=5,
        muon_rms=0.2,
        muon_adamw_lr_scale=1.0,
        adafactor_decay_rate=0.8,
        adafactor_clip=1.0,
        adafactor_momentum=0.0,
        lion_b1=0.9,
        lion_b2=0.99,
    ), **overrides))


def train_config(**overrides) -> ml_collections.ConfigDict:
    """The loop's schedule (transformer/training/loop.py); a family's config adds its own keys."""
    return ml_collections.ConfigDict(dict(dict(
        steps=1000,
        log_every=50,
        eval_every=250,
        checkpoint_every=500,
        keep_checkpoints=3,
        seed=0,
        sample_prompt="",
        sample_tokens=0,
        z_loss=0.0,
        stop_at=0,
        memory_limit_gb=0.0,
        profile_start=10,
        profile_steps=0,
        load_balance_weight=0.01,
        router_z_weight=0.001,
        router_bias_rate=0.0,
        harness_tasks="",
        harness_every=0,
        harness_num_fewshot=-1,
        harness_limit=0.0,
        harness_include_path="",
        trackers="tensorboard",
        tracker_project="transformer",
        tracker_group="",
    ), **overrides))
