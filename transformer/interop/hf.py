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
from transformer.interop.hf_families import FAMILIES, Family, Unsupported
from transformer.models import common

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
# The config file (configs/...) a converted run starts from, by family; the BERT task by head.
RUN_CONFIGS = {"gpt": "gpt.py:gpt2-small", "bert": "bert.py:bert-base,task={task}", "vit": "vit.py:b16",
               "encdec": "encdec.py:vaswani-base"}
BERT_TASKS = {"pretrain": "mlm", "sequence": "sequence_classification", "token": "token_classification",
              "none": "mlm"}


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


def family_of(hf_config: dict) -> tuple[Family, str]:
    """The family that runs a transformers config.json, and its transformers class."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise Unsupported(f"config.json: model_type={model_type!r} is not supported (choose one of "
                          f"{', '.join(FAMILIES)})")
    family = FAMILIES[model_type]
    classes = hf_config.get("architectures") or [next(iter(family.heads))]
    if classes[0] not in family.heads:
        raise Unsupported(f"config.json: architectures={classes!r} is not supported (for {model_type}: "
                          f"{', '.join(family.heads)})")
    return family, classes[0]


def _base_names(weights: dict, family: Family) -> dict:
    """Checkpoint names relative to the base model (its prefix dropped), head names unchanged."""
    prefix = family.prefix + "."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()}


def model_config(hf_config: dict, weight_names: set) -> ml_collections.ConfigDict:
    """config.model for a transformers config.json (and the names of its checkpoint's tensors)."""
    family, hf_class = family_of(hf_config)
    fields = {**family.to_ours(hf_config, weight_names), **family.heads[hf_class]}
    return ml_collections.ConfigDict({**models.family(family.family).default_model_config(
        _any_preset(family.family)), **fields, "family": family.family})


def _any_preset(family: str) -> str:
    return next(iter(models.family(family).PRESETS))


def param_shapes(model_config) -> dict:
    """Flat {'a/b/kernel': ShapeDtypeStruct} of the (unscanned) params of `model_config`."""
    model = models.build(model_config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), *models.family(model_config.family).example_inputs(model))
    return traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")


def load_pretrained(path: str):
    """(model, params, config) of the transformers model directory `path`.

    `config` is a full run config (the family's config file with this model; config.model
    alone where configs/ is not at hand); `params` are float32 and unscanned.
    """
    hf_config = read_config(path)
    family, _ = family_of(hf_config)
    weights = _base_names(read_weights(path), family)
    model_cfg = model_config(hf_config, set(weights))
    params = params_from_weights(weights, family, model_cfg)
    return models.build(model_cfg), params, run_config(model_cfg)


def params_from_weights(weights: dict, family: Family, model_cfg) -> dict:
    """The param tree of `model_cfg` from checkpoint tensors (names relative to the base model)."""
    shapes, out, used = param_shapes(model_cfg), {}, set()
    for rule in family.rules(model_cfg.to_dict()):
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
    unused = sorted(k for k in set(weights) - used if not family.is_ignored(k))
    if unused:
        raise Unsupported(f"the checkpoint holds tensors this model has no place for: {', '.join(unused[:3])}"
                          f"{' ...' if len(unused) > 3 else ''}")
    return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(out, sep="/"))


def run_config(model_cfg) -> ml_collections.ConfigDict:
    """A full run config: the family's config file with `model_cfg` and an 'hf' tokenizer."""
    spec = RUN_CONFIGS[model_cfg.family].format(task=BERT_TASKS.get(model_cfg.get("head"), ""))
    if not os.path.isdir(CONFIGS):
        return ml_collections.ConfigDict({"model": model_cfg})
    config = config_lib.load(os.path.join(CONFIGS, spec))
    config.unlock()
    config.model = model_cfg
    data = config.data
    if "tokenizer" in data:
        data.tokenizer, data.tokenizer_path, data.vocab_size = "hf", "", model_cfg.vocab_size
    for key in ("seq_len", "source_len", "target_len"):
        if key in data:
            data[key] = min(data[key], model_cfg.max_len)
    config.lock()
    return config


def save_pretrained(params, config, path: str) -> None:
    """Writes config.json and model.safetensors for transformers' `from_pretrained`.

    `config` is a run config or its `model` section; scanned layer stacks are unstacked.
    """
    from safetensors.numpy import save_file

    model_cfg = config.model if "model" in config else config
    family = next((f for f in FAMILIES.values() if f.family == model_cfg.family), None)
    if family is None:
        raise Unsupported(f"config.model.family={model_cfg.family!r} has no transformers export")
    m = model_cfg.to_dict()
    unscanned = ml_collections.ConfigDict({**m, "scan_layers": False})
    target = traverse_util.unflatten_dict(param_shapes(unscanned), sep="/")
    flat = traverse_util.flatten_dict(common.match_layers(jax.device_get(params), target), sep="/")
    hf_class = family.class_of(m)
    prefix = "" if hf_class == family.base_class else family.prefix + "."
    tensors = {}
    for rule in family.rules(m):
        name = rule.theirs if family.is_head_key(rule.theirs) else prefix + rule.theirs
        tensors[name] = np.ascontiguousarray(rule.to_theirs(*(np.asarray(flat[o], np.float32) for o in rule.ours)))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf_config = {"model_type": family.model_type, "architectures": [hf_class], **family.to_theirs(m)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
