"""Hugging Face interop: run a local transformers checkpoint here, and write one back.

    model, params, config = hf.load_pretrained("path/to/hf_dir")
    logits = model.apply({"params": params}, tokens)       # the family's usual outputs
    hf.save_pretrained(params, config, "path/to/out", tokenizer)  # transformers' from_pretrained loads it

A model directory holds config.json and model.safetensors (or its shards, or
pytorch_model.bin, which needs torch). Supported, by transformers class:

  gpt     GPT2LMHeadModel (logits), GPT2Model (head='none': hidden states); LlamaForCausalLM,
          LlamaModel, MistralForCausalLM, MistralModel, Qwen2ForCausalLM, Qwen2Model,
          Qwen3ForCausalLM, Qwen3Model, and with a mixture of experts MixtralForCausalLM,
          MixtralModel, Qwen3MoeForCausalLM, Qwen3MoeModel (interop/hf_decoders.py; a GPT with
          rotary positions or RMSNorm exports to these); BloomForCausalLM, BloomModel
          (interop/hf_bloom.py; a GPT with ALiBi positions exports to these)
  bert    BertForMaskedLM, BertForPreTraining, BertForSequenceClassification,
          BertForTokenClassification, BertModel (head='none': hidden and pooled)
  vit     ViTForImageClassification, ViTModel; images are [B, H, W, C] here, not [B, C, H, W];
          IJepaForImageClassification, IJepaModel (interop/hf_ijepa.py; a ViT with pool='mean'
          exports to these)
  encdec  BartForConditionalGeneration (logits of the decoder), BartModel (head='none': the
          decoder's hidden states); T5ForConditionalGeneration, T5EncoderModel (head='encoder'),
          v1.0 and v1.1 (interop/hf_t5.py; an encoder-decoder with relative positions exports to these);
          MarianMTModel (interop/hf_marian.py; one with sinusoidal positions exports to it)

Anything else, or a config option the family cannot express, fails in one line naming it.
`python -m transformer.convert` turns a directory into a run directory (--hf_dir), and a run into a
directory (--to_hf: `hf_export`, through `save_pretrained`).
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from transformer import config as config_lib
from transformer import console, models, sharding
from transformer.interop import hf_bloom, hf_decoders, hf_families, hf_ijepa, hf_inputs, hf_marian, hf_t5
from transformer.interop.hf_families import Architecture, Unsupported
from transformer.models import common

ARCHITECTURES = {**hf_families.ARCHITECTURES,
                 **{a.model_type: a for a in (*hf_decoders.ARCHITECTURES, hf_t5.T5, hf_bloom.BLOOM, hf_marian.MARIAN,
                                              hf_ijepa.IJEPA)}}


def read_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: is {path} a Hugging Face model directory?")
    with open(config_path) as f:
        return json.load(f)


def _checkpoint_files(path: str) -> list[str]:
    """The weight files of the checkpoint in `path`: model.safetensors, its shards, or pytorch_model.bin."""
    file = lambda name: os.path.join(path, name)  # noqa: E731
    if os.path.isfile(file("model.safetensors")):
        return [file("model.safetensors")]
    if os.path.isfile(file("model.safetensors.index.json")):
        with open(file("model.safetensors.index.json")) as f:
            return [file(s) for s in sorted(set(json.load(f)["weight_map"].values()))]
    if os.path.isfile(file("pytorch_model.bin")):
        return [file("pytorch_model.bin")]
    raise FileNotFoundError(f"no weights in {path}: expected model.safetensors, model.safetensors.index.json "
                            "or pytorch_model.bin")


def _torch_state(path: str) -> dict:
    """The tensors of a pytorch_model.bin, memory-mapped: a tensor's data is read when it is used, so
    `checkpoint_index` reads none of it (a file in torch's legacy, pre-zip format is read whole)."""
    try:
        import torch
    except ImportError:
        raise ImportError(f"{path} needs torch to read: pip install torch") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _to_numpy(tensor) -> np.ndarray:
    """A torch tensor as numpy in its own dtype (bfloat16 through ml_dtypes: numpy has none)."""
    import torch
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy()


SAFETENSORS_DTYPES = {"BF16": jnp.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
                      "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _safetensors_header(file) -> tuple[dict, int]:
    """({name: {'dtype', 'shape', 'data_offsets'}}, where the data starts) of an open .safetensors file."""
    size = int.from_bytes(file.read(8), "little")
    header = json.loads(file.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def read_tensors(path: str):
    """(name, array) of every tensor of the checkpoint in `path`, one at a time, file by file, each in its
    stored dtype. A .safetensors tensor is read straight into its array (no memory map: the process holds
    one tensor of the checkpoint at a time, whatever the size of its files)."""
    for name in _checkpoint_files(path):
        if name.endswith(".bin"):
            yield from ((k, _to_numpy(v)) for k, v in _torch_state(name).items())
            continue
        with open(name, "rb") as f:
            header, start = _safetensors_header(f)
            for key, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                f.seek(start + info["data_offsets"][0])
                dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
                yield key, np.fromfile(f, dtype, int(np.prod(info["shape"]))).reshape(info["shape"])


def checkpoint_index(path: str) -> dict[str, str]:
    """{tensor name: stored dtype name} of the checkpoint in `path`, from the files' headers."""
    index = {}
    for name in _checkpoint_files(path):
        if name.endswith(".bin"):
            index.update({k: str(_to_numpy(v[:0]).dtype) for k, v in _torch_state(name).items()})
            continue
        with open(name, "rb") as f:
            header, _ = _safetensors_header(f)
        index.update({k: str(np.dtype(SAFETENSORS_DTYPES[v["dtype"]])) for k, v in header.items()})
    return index


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


def exporter(m: dict) -> Architecture:
    """The transformers architecture that expresses config.model `m` (its family's, by its options)."""
    gpt = lambda m: hf_bloom.exports(m) or hf_decoders.exports(m)  # noqa: E731
    encdec = lambda m: hf_t5.exports(m) or hf_marian.exports(m)  # noqa: E731
    specific = {"gpt": gpt, "encdec": encdec, "vit": hf_ijepa.exports}.get(m["family"], lambda m: None)(m)
    arch = specific or hf_families.architecture_for(m["family"])
    if m.get("num_experts") and not arch.experts:
        raise Unsupported(f"config.model.num_experts={m['num_experts']} has no equivalent in transformers' "
                          f"{arch.model_type} (needs 0)")
    return arch


def export_class(m: dict) -> str:
    """The transformers class a run of config.model `m` exports as (`save_pretrained`'s checks, no weights read);
    Unsupported naming the key where no class expresses it."""
    if m.get("parametrization", "sp") != "sp":
        raise Unsupported(f"config.model.parametrization={m['parametrization']}: transformers' classes have no muP "
                          "scales (attention 1/Dh, logits x mup_base_width / d_model)")
    arch = exporter(m)
    arch.check_head(m)
    arch.to_theirs(m)
    arch.rules(m)
    return arch.class_of(m)


def export_line(model_config) -> str:
    """What a run's first lines say of its export: the transformers class `convert --to_hf` writes it as, or why
    none expresses it."""
    try:
        return f"export: convert --to_hf writes this run as transformers' {export_class(model_config.to_dict())}"
    except Unsupported as e:
        return f"export: no transformers class expresses this run, so convert --to_hf will refuse it: {e}"


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


def load_pretrained(path: str, mesh=None, rules=(), param_dtype: str | None = None, configs: str = config_lib.CONFIGS):
    """(model, params, config) of the transformers model directory `path`.

    `config` is a full run config (the family's config file under the directory `configs`, by default
    the working directory's configs/, with this model and the config.train keys config.json sets: a
    mixture's load_balance_weight; config.model alone where there is no such directory); `params` are
    unscanned, in `param_dtype` (default: the checkpoint's stored dtype, which config.model.param_dtype
    then records). The checkpoint is read a tensor at a time and each param
    placed as it is made: on `mesh` by the logical `rules` (FSDP, tensor parallelism), else on the
    default device; no float32 copy of the whole.
    """
    hf_config = read_config(path)
    arch, _ = architecture_of(hf_config)
    stored = checkpoint_index(path)
    model_cfg = model_config(hf_config, set(_base_names(stored, arch)))
    model_cfg.param_dtype = param_dtype or _stored_dtype(stored)
    placements = None
    if mesh is not None:
        boxed = models.param_shapes(model_cfg)
        placements = traverse_util.flatten_dict(sharding.logical_shardings(boxed, mesh, rules), sep="/")
    tensors = console.progress(read_tensors(path), total=len(stored), desc=f"reading {path}", unit="tensor",
                               leave=False)
    params = params_from_tensors(tensors, arch, model_cfg, placements)
    return models.build(model_cfg), params, run_config(model_cfg, configs, arch.train_to_ours(hf_config))


def _stored_dtype(index: dict[str, str]) -> str:
    """The dtype most of the checkpoint's values are stored in (float32 for float64)."""
    kinds = {}
    for dtype in index.values():
        kinds[dtype] = kinds.get(dtype, 0) + 1
    dtype = max(kinds, key=kinds.get)
    return "float32" if dtype == "float64" else dtype


def params_from_tensors(tensors, arch: Architecture, model_cfg, placements: dict | None = None) -> dict:
    """The param tree of `model_cfg` from (checkpoint name, array) pairs, each converted by its rule, cast
    to config.model.param_dtype and placed (`placements`: flat {path: sharding}; None: the default device)
    as it comes; one expert's tensor fills its slice of a host buffer of the stacked param [E, ...], placed
    once its last expert has come."""
    shapes, rules = param_shapes(model_cfg), {r.theirs: r for r in arch.rules(model_cfg.to_dict())}
    dtype, prefix = jnp.dtype(model_cfg.param_dtype), arch.prefix + "."
    out, unused, stacks = {}, [], {}
    for name, tensor in tensors:
        base = name[len(prefix):] if name.startswith(prefix) else name
        rule = rules.pop(base, None)
        if rule is None:
            unused += [] if arch.is_ignored(base) else [base]
            continue
        for ours, value in zip(rule.ours, rule.to_ours(tensor)):
            if rule.index is not None:
                value = _stacked(stacks, ours, rule.index, value, shapes[ours].shape, dtype)
                if value is None:
                    continue
            if value.shape != shapes[ours].shape:
                raise ValueError(f"{ours}: the checkpoint gives {value.shape}, the model needs {shapes[ours].shape}")
            value = np.ascontiguousarray(value, dtype)  # one copy at most: transposed, cast
            out[ours] = jax.device_put(value, placements[ours] if placements else None).block_until_ready()
        del tensor, value  # before the next tensor is read: one tensor's copies at a time
    for theirs, rule in rules.items():
        if not rule.optional:
            raise ValueError(f"the checkpoint has no {theirs} (needed for {rule.ours[0]})")
        out.update({o: jnp.zeros(shapes[o].shape, dtype, device=placements[o] if placements else None)
                    for o in rule.ours})
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"no checkpoint tensor maps onto {', '.join(missing[:3])}")
    if unused:
        raise Unsupported(f"the checkpoint holds tensors this model has no place for: {', '.join(sorted(unused)[:3])}"
                          f"{' ...' if len(unused) > 3 else ''}")
    return traverse_util.unflatten_dict(out, sep="/")


def _stacked(stacks: dict, ours: str, index: int, value: np.ndarray, shape: tuple, dtype) -> np.ndarray | None:
    """Slice `index` of the stacked param `ours` [E, ...] (one expert's tensor) written into its host
    buffer in `stacks`; the whole buffer once its E slices have come, else None."""
    if value.shape != shape[1:]:
        raise ValueError(f"{ours}[{index}]: the checkpoint gives {value.shape}, the model needs {shape[1:]}")
    buffer, left = stacks.setdefault(ours, (np.empty(shape, dtype), set(range(shape[0]))))
    buffer[index] = value
    left.discard(index)
    return None if left else stacks.pop(ours)[0]


def run_config(model_cfg, configs: str = config_lib.CONFIGS, train: dict | None = None) -> ml_collections.ConfigDict:
    """A full run config: the family's config file (under the directory `configs`) with `model_cfg`, the
    config.train values `train` and an 'hf' tokenizer; config.model alone where `configs` is no directory."""
    spec = run_config_spec(model_cfg)
    if not os.path.isdir(configs):
        return ml_collections.ConfigDict({"model": model_cfg})
    config = config_lib.load(os.path.join(configs, spec))
    config.unlock()
    config.model = model_cfg
    config.train.update(train or {})
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


def checkpoint_name(arch: Architecture, hf_class: str, theirs: str) -> str:
    """A rule's tensor name as the transformers class `hf_class` holds it (under the base model's prefix but
    for a head's and the base class's own)."""
    if arch.is_head_key(theirs) or hf_class == arch.base_class or not arch.prefix:
        return theirs
    return f"{arch.prefix}.{theirs}"


def save_pretrained(params, config, path: str, tokenizer=None, labels: list[str] | None = None,
                    statistics: tuple | None = None) -> None:
    """Writes config.json and model.safetensors for transformers' `from_pretrained`, and what reads the
    model's inputs (`hf_inputs`): the files of `tokenizer` for AutoTokenizer (its special-token ids in
    config.json), the preprocessor_config.json of an image classifier's `statistics` (mean [C], std [C]) for
    AutoImageProcessor. `labels`: a classifier's names by id (id2label).

    `config` is a run config (its config.train keys that transformers' config.json holds are written too: a
    mixture's router_aux_loss_coef; an image processor crops as config.data.crop_fraction says) or its `model`
    section; scanned layer stacks are unstacked; weights are written in config.model.param_dtype. A
    config.model value no transformers class expresses fails first, naming it.
    """
    from safetensors.numpy import save_file

    model_cfg = config.model if "model" in config else config
    m = model_cfg.to_dict()
    arch = exporter(m)
    arch.check_head(m)
    hf_class = arch.class_of(m)
    named = {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}} if labels else {}
    train = arch.train_to_theirs(config.train.to_dict(), m) if "train" in config else {}
    hf_config = {"model_type": arch.model_type, "architectures": [hf_class], **arch.to_theirs(m), **train,
                 "dtype": m.get("param_dtype", "float32"), **named,
                 **(hf_inputs.token_ids(tokenizer, arch) if tokenizer is not None else {})}
    dtype = jnp.dtype(m.get("param_dtype", "float32"))
    unscanned = ml_collections.ConfigDict({**m, "scan_layers": False})
    target = traverse_util.unflatten_dict(param_shapes(unscanned), sep="/")
    flat = traverse_util.flatten_dict(common.match_layers(jax.device_get(params), target), sep="/")
    tensors = {}
    for rule in arch.rules(m):
        values = (np.asarray(flat[o], dtype) for o in rule.ours)
        tensors[checkpoint_name(arch, hf_class, rule.theirs)] = np.ascontiguousarray(rule.to_theirs(*values))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        hf_inputs.save_tokenizer(tokenizer, path, arch.wraps, m.get("max_len"))
    if statistics is not None:
        crop_fraction = config.data.get("crop_fraction", 1.0) if "data" in config else 1.0
        hf_inputs.save_image_processor(path, m["image_size"], crop_fraction, *statistics)
