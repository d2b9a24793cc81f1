"""Hugging Face interop: run a local transformers checkpoint here, and write one back.

    model, params, config = hf.load_pretrained("path/to/hf_dir")
    logits = model.apply({"params": params}, tokens)       # the family's usual outputs
    hf.save_pretrained(params, config, "path/to/out")       # transformers' from_pretrained loads it

A model directory holds config.json and model.safetensors (or its shards, or
pytorch_model.bin, which needs torch). Supported, by transformers class:

  gpt     GPT2LMHeadModel (logits), GPT2Model (head='none': hidden states)
  bert    BertForMaskedLM, BertForPreTraining, BertForSequenceClassification,
          BertForTokenClassification, BertModel (head='none': hidden and pooled)
  vit     ViTForImageClassification, ViTModel; images are [B, H, W, C] here, not [B, C, H, W]
  encdec  BartForConditionalGeneration (logits of the decoder)

Anything else, or a config option the family cannot express, fails in one line naming it.
`python -m transformer.convert` turns a directory into a run directory.
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from transformer import config as config_lib, models
from transformer.interop.hf_families import ARCHITECTURES, Architecture, Unsupported, architecture_for
from transformer.models import common

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
def read_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: is {path} a Hugging Face model directory?")
    with open(config_path) as f:
        return json.load(f)


def _load_safetensors(path: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as float32 numpy arrays (read through jax: numpy has no bfloat16)."""
    from safetensors import safe_open

    with safe_open(path, framework="flax") as f:
        return {k: np.asarray(f.get_tensor(k).astype(jnp.float32)) for k in f.keys()}


def read_weights(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in `path`, by name, as float32 numpy arrays."""
    file = lambda name: os.path.join(path, name)
    if os.path.isfile(file("model.safetensors")):
        return _load_safetensors(file("model.safetensors"))
    if os.path.isfile(file("model.safetensors.index.json")):
        with open(file("model.safetensors.index.json")) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for s in shards for k, v in _load_safetensors(file(s)).items()}
    if os.path.isfile(file("pytorch_model.bin")):
        try:
            import torch
        except ImportError:
            raise ImportError(f"{file('pytorch_model.bin')} needs torch to read: pip install torch") from None
        state = torch.load(file("pytorch_model.bin"), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise FileNotFoundError(f"no weights in {path}: expected model.safetensors, model.safetensors.index.json "
                            "or pytorch_model.bin")


def architecture_of(hf_config: dict) -> tuple[Architecture, str]:
    """The architecture (and so the family here) of a transformers config.json, and its class."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise Unsupported(f"config.json: model_type={model_type!r} is not supported (choose one of "
                          f"{', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[model_type]
    classes = hf_config.get("architectures") or [next(iter(arch.heads))]
    if classes[0] not in arch.heads:
        raise Unsupported(f"config.json: architectures={classes!r} is not supported (for {model_type}: "
                          f"{', '.join(arch.heads)})")
    return arch, classes[0]


def _base_names(weights: dict, arch: Architecture) -> dict:
    """Checkpoint names relative to the base model (its prefix dropped), head names unchanged."""
    prefix = arch.prefix + "."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()}


def model_config(hf_config: dict, weight_names: set) -> ml_collections.ConfigDict:
    """config.model for a transformers config.json (and the names of its checkpoint's tensors)."""
    arch, hf_class = architecture_of(hf_config)
    fields = {**arch.to_ours(hf_config, weight_names), **arch.heads[hf_class]}
    family = models.family(arch.family)
    return ml_collections.ConfigDict({**family.model_config(next(iter(family.presets))), **fields})


def param_shapes(model_config) -> dict:
    """Flat {'a/b/kernel': ShapeDtypeStruct} of the (unscanned) params of `model_config`."""
    return traverse_util.flatten_dict(nn.unbox(models.param_shapes(model_config)), sep="/")


def load_pretrained(path: str):
    """(model, params, config) of the transformers model directory `path`.

    `config` is a full run config (the family's config file with this model; config.model
    alone where configs/ is not at hand); `params` are float32 and unscanned.
    """
    hf_config = read_config(path)
    arch, _ = architecture_of(hf_config)
    weights = _base_names(read_weights(path), arch)
    model_cfg = model_config(hf_config, set(weights))
    params = params_from_weights(weights, arch, model_cfg)
    return models.build(model_cfg), params, run_config(model_cfg)


def params_from_weights(weights: dict, arch: Architecture, model_cfg) -> dict:
    """The param tree of `model_cfg` from checkpoint tensors (names relative to the base model)."""
    shapes, out, used = param_shapes(model_cfg), {}, set()
    for rule in arch.rules(model_cfg.to_dict()):
        if rule.theirs not in weights:
            if rule.optional:
                out.update({o: np.zeros(shapes[o].shape, np.float32) for o in rule.ours})
                continue
            raise ValueError(f"the checkpoint has no {rule.theirs} (needed for {rule.ours[0]})")
        used.add(rule.theirs)
        out.update(zip(rule.ours, rule.to_ours(weights[rule.theirs])))
    for name, value in out.items():
        if value.shape != shapes[name].shape:
            raise ValueError(f"{name}: the checkpoint gives {value.shape}, the model needs {shapes[name].shape}")
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"no checkpoint tensor maps onto {', '.join(missing[:3])}")
    unused = sorted(k for k in set(weights) - used if not arch.is_ignored(k))
    if unused:
        raise Unsupported(f"the checkpoint holds tensors this model has no place for: {', '.join(unused[:3])}"
                          f"{' ...' if len(unused) > 3 else ''}")
    return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(out, sep="/"))


def run_config(model_cfg) -> ml_collections.ConfigDict:
    """A full run config: the family's config file with `model_cfg` and an 'hf' tokenizer."""
    spec = run_config_spec(model_cfg)
    if not os.path.isdir(CONFIGS):
        return ml_collections.ConfigDict({"model": model_cfg})
    config = config_lib.load(os.path.join(CONFIGS, spec))
    config.unlock()
    config.model = model_cfg
    data = config.data
    if "tokenizer" in data:
        data.tokenizer, data.tokenizer_path = "hf", ""
    for key in ("seq_len", "source_len", "target_len"):
        if key in data:
            data[key] = min(data[key], model_cfg.max_len)
    config.lock()
    return config


def run_config_spec(model_cfg) -> str:
    """The config file and arg (under configs/) a converted model of config.model starts from."""
    family = models.family(model_cfg.family)
    return family.config_file(family.build(model_cfg))


def save_pretrained(params, config, path: str) -> None:
    """Writes config.json and model.safetensors for transformers' `from_pretrained`.

    `config` is a run config or its `model` section; scanned layer stacks are unstacked.
    """
    from safetensors.numpy import save_file

    model_cfg = config.model if "model" in config else config
    arch = architecture_for(model_cfg.family)
    m = model_cfg.to_dict()
    unscanned = ml_collections.ConfigDict({**m, "scan_layers": False})
    target = traverse_util.unflatten_dict(param_shapes(unscanned), sep="/")
    flat = traverse_util.flatten_dict(common.match_layers(jax.device_get(params), target), sep="/")
    hf_class = arch.class_of(m)
    prefix = "" if hf_class == arch.base_class else arch.prefix + "."
    tensors = {}
    for rule in arch.rules(m):
        name = rule.theirs if arch.is_head_key(rule.theirs) else prefix + rule.theirs
        tensors[name] = np.ascontiguousarray(rule.to_theirs(*(np.asarray(flat[o], np.float32) for o in rule.ours)))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf_config = {"model_type": arch.model_type, "architectures": [hf_class], **arch.to_theirs(m)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
