"""A run's LoRA adapters out as a PEFT adapter, and a PEFT adapter in onto a converted base.

    python -m transformer.convert --workdir runs/gpt2-lora --to_hf out/gpt2 --adapter out/gpt2-adapter
    python -m transformer.convert --hf_dir out/gpt2 --adapter out/gpt2-adapter --workdir runs/gpt2-adapted

    base = transformers.AutoModelForCausalLM.from_pretrained("out/gpt2")      # the base, unmerged
    model = peft.PeftModel.from_pretrained(base, "out/gpt2-adapter")

Shapes: D width, R rank (config.lora.rank), r a module's rank in peft, K / N a kernel's contracted / output
features flattened.

Out: adapter_config.json (peft's LoraConfig: r = R, lora_alpha = alpha, lora_dropout, the adapted modules by full
name, fan_in_fan_out where they are GPT-2's Conv1D, use_rslora false: peft scales by lora_alpha / r as
config.lora scales by alpha / R) and adapter_model.safetensors (base_model.model.MODULE.lora_A.weight [r, in] and
lora_B.weight [out, r], as peft saves them: x A B is lora_B(lora_A(x)) for a Linear and a Conv1D alike).

Which module holds a kernel is the exporter's own mapping (`hf_families.Rule`): a rule of one kernel is one
module; a rule fusing several kernels along the output features (GPT-2's c_attn: query, key, value) is one
module for all of them. A rank-R adapter on each of n fused kernels is exactly one rank-nR adapter on the fused
module, A = [A_q A_k A_v] [D, nR] and B block-diagonal [nR, nD], since x A B = [x A_q B_q, x A_k B_k, x A_v B_v];
its rank_pattern entry is nR and its alpha_pattern n alpha, keeping the scale alpha / R. Llama's and Qwen's
q_proj, k_proj, v_proj are modules of their own.

In: the reverse, onto the run `hf_import.convert` writes (config.lora set, the adapters in params["lora"]). A
fused module's adapter whose B is block-diagonal in n equal blocks splits into its n kernels' adapters; any other
(one trained in peft) gives each kernel the whole A and its rows of B, as exact. Adapters of several ranks or
scales come in at the largest rank, zero-padded, each scale folded into its B.
"""

import dataclasses
import json
import math
import os
import re

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from flax import traverse_util

from transformer import config as config_lib
from transformer import models
from transformer.interop import hf
from transformer.interop.hf_families import Unsupported
from transformer.layers import lora
from transformer.models import common

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TASK_TYPES = {"lm": "CAUSAL_LM"}  # config.model.head -> peft's task_type (others: none)
REFUSED = {"use_dora": (True,), "bias": ("all", "lora_only"), "modules_to_save": None,
           "target_parameters": None, "layer_replication": None}  # adapter_config.json keys this cannot express


@dataclasses.dataclass(frozen=True)
class Module:
    """A transformers module (its full name) and our kernels whose concatenated outputs it computes: each
    kernel's output features N (`features`) and contracted dims (`contracted`: K its first ones); `conv1d`:
    GPT-2's Conv1D (weight [in, out]) rather than a Linear."""

    name: str
    kernels: tuple[str, ...]
    features: tuple[int, ...]
    contracted: tuple[int, ...]
    conv1d: bool


def modules(m: dict) -> dict[str, Module]:
    """{kernel path: its Module} of config.model `m` (unscanned paths), from the exporter's rules: the kernels
    whose transformers weight is a Linear's or a Conv1D's of their [K, N] (experts', BLOOM's fused heads: none)."""
    arch = hf.exporter(m)
    boxed = traverse_util.flatten_dict(models.param_shapes(_unscanned(m)), sep="/")
    out, layouts = {}, {}
    for rule in arch.rules(m):
        if rule.index is not None or not all(o.endswith("/kernel") and isinstance(boxed.get(o), nn.Partitioned)
                                             for o in rule.ours):
            continue
        splits = [lora.split(tuple(boxed[o].names)) for o in rule.ours]
        shapes = [boxed[o].value.shape for o in rule.ours]
        if any(s for s, _ in splits) or len({math.prod(x[:k]) for (_, k), x in zip(splits, shapes)}) != 1:
            continue
        key = (re.sub(r"\d+", "#", rule.theirs), tuple(shapes))
        if key not in layouts:
            layouts[key] = _layout(rule, shapes, math.prod(shapes[0][:splits[0][1]]))
        if layouts[key] is None:
            continue
        name = hf.checkpoint_name(arch, arch.class_of(m), rule.theirs).removesuffix(".weight")
        module = Module(name, rule.ours, tuple(math.prod(x[k:]) for (_, k), x in zip(splits, shapes)),
                        tuple(k for _, k in splits), layouts[key])
        out.update({o: module for o in rule.ours})
    return out


def _layout(rule, shapes: list[tuple], inputs: int) -> bool | None:
    """Whether the rule writes its kernels' [K, N] concatenated along N as they are (a Conv1D: True) or
    transposed (a Linear: False); None for any other layout (which a low-rank adapter may not keep)."""
    rng = np.random.default_rng(0)
    kernels = [rng.normal(size=shape).astype(np.float32) for shape in shapes]
    fused = np.concatenate([k.reshape(inputs, -1) for k in kernels], axis=1)  # [K, sum N]
    theirs = np.asarray(rule.to_theirs(*kernels))
    for conv1d, expected in ((True, fused), (False, fused.T)):
        if theirs.shape == expected.shape and np.array_equal(theirs, expected):
            return conv1d
    return None


def unstacked(adapters: dict, m: dict) -> dict:
    """Flat {kernel path: (A [K, R], B [R, N])} of params["lora"], its layer stacks unstacked."""
    target = traverse_util.unflatten_dict(hf.param_shapes(_unscanned(m)), sep="/")
    flat = traverse_util.flatten_dict(common.match_layers(jax.device_get(adapters), target), sep="/")
    out = {}
    for path in {p.rsplit("/", 1)[0] for p in flat}:
        a, b = np.asarray(flat[f"{path}/a"], np.float32), np.asarray(flat[f"{path}/b"], np.float32)
        out[path] = a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1)
    return out


def save_adapter(params: dict, config, path: str, base: str = "") -> dict:
    """Writes the adapters of `params` (a run's, config.lora's) as a PEFT adapter directory `path` for the base
    that `hf.save_pretrained` writes of the same config (`base`: its directory, recorded as
    base_model_name_or_path); returns {'modules', 'rank'}."""
    from safetensors.numpy import save_file

    settings, m = lora.Lora.of(config.get("lora")), config.model.to_dict()
    if not settings.rank or lora.ADAPTERS not in params:
        raise ValueError("the run has no LoRA adapters (config.lora.rank=0): export it without --adapter")
    adapters, mapping = unstacked(params[lora.ADAPTERS], m), modules(m)
    unmapped = sorted(set(adapters) - set(mapping))
    if unmapped:
        raise Unsupported(f"the adapted kernel {unmapped[0]} has no transformers module a PEFT adapter expresses: "
                          "leave it out of config.lora.targets")
    tensors, ranks, conv1d = {}, {}, set()
    for module in dict.fromkeys(mapping[p] for p in sorted(adapters)):
        a, b = fused(module, adapters, settings.rank)
        tensors[f"{PREFIX}{module.name}.lora_A.weight"] = np.ascontiguousarray(a.T)  # [r, in]
        tensors[f"{PREFIX}{module.name}.lora_B.weight"] = np.ascontiguousarray(b.T)  # [out, r]
        ranks[module.name] = a.shape[1]
        conv1d.add(module.conv1d)
    if len(conv1d) > 1:
        raise Unsupported("the adapted kernels mix Conv1D and Linear modules, which one fan_in_fan_out cannot say")
    patterns = {name: r for name, r in ranks.items() if r != settings.rank}
    adapter_config = {
        "peft_type": "LORA", "task_type": TASK_TYPES.get(m.get("head", "lm")), "base_model_name_or_path": base,
        "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
        "target_modules": sorted(ranks), "rank_pattern": patterns,
        "alpha_pattern": {name: settings.alpha * r / settings.rank for name, r in patterns.items()},
        "fan_in_fan_out": conv1d.pop(), "bias": "none", "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
    return {"modules": len(ranks), "rank": settings.rank}


def fused(module: Module, adapters: dict, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The module's adapter (A [K, nR], B [nR, sum N]) of its n adapted kernels: A side by side, B block-diagonal
    (a kernel without adapters: zero columns of B)."""
    present = [i for i, k in enumerate(module.kernels) if k in adapters]
    offsets = np.cumsum((0, *module.features))
    a = np.concatenate([adapters[module.kernels[i]][0] for i in present], axis=1)
    b = np.zeros((len(present) * rank, offsets[-1]), np.float32)
    for j, i in enumerate(present):
        b[j * rank:(j + 1) * rank, offsets[i]:offsets[i + 1]] = adapters[module.kernels[i]][1]
    return a, b


def read_adapter(path: str) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(adapter_config.json, {module: (A [in, r], B [r, out])}) of a PEFT LoRA adapter directory; what this
    cannot express fails naming the key."""
    from safetensors.numpy import load_file

    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise FileNotFoundError(f"--adapter {path}: no {os.path.basename(needed)} (a PEFT LoRA adapter directory "
                                    "holds adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.load(open(config_path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not JSON ({e.msg}, line {e.lineno} column {e.colno}): write it as "
                         "peft's save_pretrained does") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object of peft's LoraConfig keys")
    if config.get("peft_type") != "LORA":
        raise Unsupported(f"{config_path}: peft_type={config.get('peft_type')!r} is not supported (needs 'LORA')")
    for key, values in REFUSED.items():
        if config.get(key) and (values is None or config[key] in values):
            raise Unsupported(f"{config_path}: {key}={config[key]!r} is not supported")
    pairs, names = {}, {}
    for name, tensor in load_file(weights_path).items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", name)
        if match is None:
            raise Unsupported(f"{weights_path}: {name} is not a LoRA weight of a Linear or Conv1D module")
        pairs.setdefault(match[1], {})[match[2]] = np.asarray(tensor, np.float32)
        names[match[1], match[2]] = name
    for module, ab in sorted(pairs.items()):
        check_pair(config, module, ab, {side: names.get((module, side), side) for side in "AB"}, weights_path)
    return config, {module: (ab["A"].T, ab["B"].T) for module, ab in pairs.items()}


def check_pair(config: dict, module: str, ab: dict, names: dict, where: str) -> None:
    """A ValueError naming the file `where` and the tensor where a module's lora_A [r, in] and lora_B [out, r]
    are not both there, are not matrices, or are of another rank than adapter_config.json's r (or rank_pattern)
    gives the module, or where its target_modules leave the module out."""
    missing = [side for side in "AB" if side not in ab]
    if missing:
        given = names["B" if missing == ["A"] else "A"]
        raise ValueError(f"{where}: {given} has no lora_{missing[0]} beside it: an adapter holds both of a module")
    for side in "AB":
        if ab[side].ndim != 2:
            raise ValueError(f"{where}: {names[side]} is of shape {list(ab[side].shape)}, not a matrix")
    r, targets = rank_of(config, module), config.get("target_modules")
    for side, rank in (("A", ab["A"].shape[0]), ("B", ab["B"].shape[1])):
        if rank != r:
            raise ValueError(f"{where}: {names[side]} is of shape {list(ab[side].shape)}, rank {rank}, but "
                             f"{CONFIG_FILE} gives {module} r={r}: set its r (or rank_pattern) to the weights' rank")
    if (isinstance(targets, str) and targets != "all-linear" and not re.fullmatch(targets, module)) or (
            isinstance(targets, list) and not any(module == t or module.endswith(f".{t}") for t in targets)):
        raise ValueError(f"{where}: {names['A']} adapts {module}, which {CONFIG_FILE}'s target_modules "
                         f"{targets!r} leave out: add it there, or remove its weights")


def scale_of(config: dict, module: str) -> float:
    """peft's scale of `module`: its lora_alpha / r, or / sqrt(r) with use_rslora (alpha_pattern and rank_pattern
    matched as peft matches them)."""
    r = rank_of(config, module)
    return _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)) / (
        math.sqrt(r) if config.get("use_rslora") else r)


def rank_of(config: dict, module: str) -> int:
    """peft's rank of `module`: its rank_pattern entry, else r."""
    return _pattern(config.get("rank_pattern") or {}, module, config.get("r", 8))


def _pattern(patterns: dict, module: str, default):
    """The value of the first key of `patterns` that matches `module` as peft matches them, else `default`."""
    key = next((k for k in patterns if re.match(rf"(.*\.)?({k})$", module)), None)
    return patterns[key] if key is not None else default


def split(module: Module, a: np.ndarray, b: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{kernel: (A [K, r'], B [r', N])} of a module's adapter (A [K, r], B [r, sum N]): its n equal diagonal blocks
    where B is block-diagonal, else the whole A for each kernel with its columns of B."""
    n, r = len(module.kernels), a.shape[1]
    offsets = np.cumsum((0, *module.features))
    columns = [b[:, offsets[i]:offsets[i + 1]] for i in range(n)]
    if r % n == 0 and all(not np.any(np.delete(c.reshape(n, r // n, -1), i, axis=0)) for i, c in enumerate(columns)):
        return {k: (a[:, i * r // n:(i + 1) * r // n], c[i * r // n:(i + 1) * r // n])
                for i, (k, c) in enumerate(zip(module.kernels, columns))}
    return {k: (a, c) for k, c in zip(module.kernels, columns)}


def import_adapter(path: str, config, params: dict) -> tuple[ml_collections.ConfigDict, dict]:
    """(config with config.lora set, `params` with params["lora"]) of the PEFT adapter in `path` onto the converted
    base (`config`, `params`: unscanned, as `hf.load_pretrained` gives them)."""
    adapter_config, weights = read_adapter(path)
    m = config.model.to_dict()
    by_name = {module.name: module for module in modules(m).values()}
    kernels, shapes = {}, hf.param_shapes(_unscanned(m))
    for name, (a, b) in sorted(weights.items()):
        if name not in by_name:
            raise Unsupported(f"{path}: the adapted module {name} is none of this model's Linear or Conv1D kernels "
                              f"(e.g. {next(iter(by_name), 'none')})")
        module = by_name[name]
        wanted = (math.prod(shapes[module.kernels[0]].shape[:module.contracted[0]]), sum(module.features))
        for side, size, want, axis in (("A", a.shape[0], wanted[0], "in"), ("B", b.shape[1], wanted[1], "out")):
            if size != want:
                raise ValueError(f"{os.path.join(path, WEIGHTS_FILE)}: {name}.lora_{side}.weight has {size} {axis} "
                                 f"features where the model's {name} has {want}: an adapter of another base model")
        for kernel, (ka, kb) in split(by_name[name], a, b).items():
            kernels[kernel] = ka, kb * scale_of(adapter_config, name)
    rank = max(a.shape[1] for a, _ in kernels.values())
    alpha = scale_of({**adapter_config, "alpha_pattern": {}, "rank_pattern": {}}, "") * rank
    names, flat = {_layerless(k) for k in kernels}, {}
    for kernel, module in modules(m).items():
        if _layerless(kernel) not in names:
            continue
        i, shape = module.kernels.index(kernel), shapes[kernel].shape
        k = module.contracted[i]
        a, b = kernels.get(kernel, (np.zeros((math.prod(shape[:k]), rank)), np.zeros((rank, module.features[i]))))
        pad = rank - a.shape[1]  # a kernel no layer of the adapter adapts here: zeros (no change)
        flat[f"{kernel}/a"] = np.pad(a, ((0, 0), (0, pad))).reshape(*shape[:k], rank).astype(np.float32)
        flat[f"{kernel}/b"] = (np.pad(b, ((0, pad), (0, 0))) * rank / alpha).reshape(rank, *shape[k:]).astype(
            np.float32)
    config = config.copy_and_resolve_references()
    config.unlock()
    if "lora" not in config:
        config.lora = config_lib.lora_config()
    config.lora.update(rank=rank, alpha=alpha, dropout=float(adapter_config.get("lora_dropout", 0.0)),
                       targets=f"(^|/)({'|'.join(map(re.escape, sorted(names)))})$")
    config.lock()
    return config, {**params, lora.ADAPTERS: traverse_util.unflatten_dict(flat, sep="/")}


def _unscanned(m: dict) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({**m, "scan_layers": False})


def _layerless(kernel: str) -> str:
    """A kernel's path without its layer ('block_3/self_attn/query/kernel' -> 'self_attn/query/kernel')."""
    return re.sub(r"(^|/)[a-z_]+_\d+/", r"\1", kernel)
