"""Loading config files, applying overrides, and the parts every family shares.

A config spec is `path/to/file.py[:arg]`; the file's `get_config(arg)` returns a
locked `ml_collections.ConfigDict`. Its arg is a comma-separated list: a bare word
picks a preset, `key=value` overrides a (dotted) key, e.g.
`configs/gpt.py:tiny,optim.lr=3e-3,model.num_layers=2`. A key the config lacks fails naming the
nearest one it has (`nearest`). `load_with_base` also gives the family's base config (the values
before the preset's training settings and the overrides), which `transformer.config_keys` lists
beside each key's meaning.
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


def init_from_model(run: str, config_file: str) -> dict:
    """config.model of the run a post-training config file (`config_file`) starts from: its config.json's."""
    if not run:
        raise ValueError(f"{config_file} needs the run it trains: {config_file}:init_from=WORKDIR")
    path = os.path.join(run, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"init_from={run}: no {path} (a trained or converted run's workdir)")
    return from_json(path).model.to_dict()


def save_json(config: ml_collections.ConfigDict, path: str) -> None:
    with open(path, "w") as f:
        f.write(config.to_json(indent=2, sort_keys=True))


def finish(c: ml_collections.ConfigDict, training: dict, overrides: dict) -> ml_collections.ConfigDict:
    """The end of every get_config: adds mesh and init_from, then the preset's `training` settings
    ({section: values}) and the arg's overrides; locks the config. (The training task is the
    model's: its family names it, by the model's head.)"""
    c.mesh = mesh_config()
    c.init_from = ""  # a run directory (a trained or converted run) whose weights this run starts from
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
        rank=0,                # the adapters' rank R (0: no adapters, every weight trains)
        alpha=16.0,            # the adapters' update is scaled by alpha / R
        dropout=0.0,           # dropout of each adapter's input, in training (peft's lora_dropout)
        targets="attention",   # kernels adapted: attention, mlp, experts (comma-separated) or regexes of paths
    ))


def mesh_config() -> ml_collections.ConfigDict:
    """Pure data parallelism over every device; rules give FSDP / context / tensor / expert parallelism
    when sized."""
    return ml_collections.ConfigDict(dict(
        data=-1,     # devices of the mesh's data axis, each a replica fed its share of the batch (-1: the rest)
        fsdp=1,      # devices the params and optimizer state are sharded over (ZeRO-3 / FSDP), also splitting the batch
        context=1,   # devices the sequence is split over (ring attention: model.attention=ring)
        tensor=1,    # devices each weight matrix is split over (Megatron tensor parallelism)
        expert=1,    # devices the experts of a mixture-of-experts layer are split over
        rules=[[name, list(axes) if isinstance(axes, tuple) else axes]  # logical axis -> mesh axes (sharding.py)
               for name, axes in sharding.DEFAULT_RULES],
    ))


def optim_config(**overrides) -> ml_collections.ConfigDict:
    """The optimizer, its learning-rate schedule and clipping (transformer/training/optim.py); the
    batch's gradient accumulated over `accum_steps` microbatches."""
    return ml_collections.ConfigDict(dict(dict(
        optimizer="adamw",          # adamw | muon | adafactor | lion
        lr=3e-4,                    # peak learning rate (muon: of its hidden matrices)
        warmup_steps=100,           # linear warmup from 0 to lr
        schedule="cosine",          # cosine | constant | wsd | linear | inverse_sqrt, after the warmup
        final_lr_fraction=0.1,      # cosine, linear and wsd end at lr x this
        decay_fraction=0.2,         # wsd: the final fraction of the steps, in (0, 1], that decays
        cooldown="linear",          # wsd's decay: linear | 1-sqrt
        b1=0.9, b2=0.95, eps=1e-8,  # AdamW's betas and epsilon (and muon's AdamW part's)
        weight_decay=0.1,           # decoupled (lr x weight_decay x w), never on biases and norm scales
        clip_norm=1.0,              # global gradient-norm clipping (0: none)
        accum_steps=1,              # microbatches each step's batch is split into, their gradients summed
        muon_momentum=0.95,         # muon: momentum (Nesterov) of its matrices
        muon_ns_steps=5,            # muon: Newton-Schulz iterations orthogonalising the momentum
        muon_rms=0.2,               # muon: the update's RMS, AdamW's (0: Keller Jordan's sqrt(max(1, out/in)) scale)
        muon_adamw_lr_scale=1.0,    # muon: the lr of its AdamW part (embeddings, head, norms, biases) / lr
        adafactor_decay_rate=0.8,   # adafactor: second-moment decay 1 - step^-rate
        adafactor_clip=1.0,         # adafactor: update clipping threshold, >= 1 (0: none)
        adafactor_momentum=0.0,     # adafactor: first-moment decay (0: none, T5's)
        lion_b1=0.9,                # lion: the interpolation of momentum and gradient in the update
        lion_b2=0.99,               # lion: the momentum's decay
    ), **overrides))


def train_config(**overrides) -> ml_collections.ConfigDict:
    """The loop's schedule (transformer/training/loop.py); a family's config adds its own keys."""
    return ml_collections.ConfigDict(dict(dict(
        steps=1000,             # optimizer steps of the run (the learning-rate schedule spans them)
        log_every=50,           # steps between train/* metrics (they leave the device only then)
        eval_every=250,         # steps between evaluations (and one at the end)
        checkpoint_every=500,   # steps between checkpoints (and one at the end, or on Ctrl-C)
        keep_checkpoints=3,     # the latest checkpoints kept
        seed=0,                 # the seed of the params' init, dropout and the data order
        sample_prompt="",       # a prompt continued at each eval (language models; '': an eval document's first line)
        sample_tokens=0,        # tokens sampled from sample_prompt at each eval, up to a document's end (0: none)
        z_loss=0.0,             # language models: the loss adds this x mean(logsumexp(logits)^2), PaLM's (0: none)
        stop_at=0,              # > 0: this launch stops after that step (schedule unchanged); a later one resumes
        memory_limit_gb=0.0,    # a device's memory a step may take (0: the device's own; training/memory.py)
        profile_start=10,       # the first step the profiler traces (with profile_steps)
        profile_steps=0,        # > 0: steps traced into WORKDIR/profile (transformer.profile)
        load_balance_weight=0.01,  # a mixture of experts' load-balancing loss in the objective, times this
        router_z_weight=0.001,  # a mixture of experts' router z-loss in the objective, times this
        router_bias_rate=0.0,   # > 0: a sigmoid router's bias moves by this x sign(mean load - load) each step (0: off)
        harness_tasks="",       # language models: lm-evaluation-harness tasks (comma-separated) scored during training
        harness_every=0,        # steps between harness scores, logged as eval/harness/TASK/METRIC (0: eval_every)
        harness_num_fewshot=-1,  # shots in each harness prompt (-1: each task's own)
        harness_limit=0.0,      # at most this many documents per harness task (< 1: a fraction; 0: all)
        harness_include_path="",  # a folder of local harness task YAML files (and their data)
    ), **overrides))
