"""Model families, one file each (gpt, bert, vit, encdec), each holding its module, its presets and
one `Family` record, `FAMILY`; beside them common.py (the Family record, the fields every family
shares), flops.py (the one FLOPs formula) and summary.py (the parameter table).

The records are found by importing the modules of this package, so a new family is a new
file here (and its config file in configs/): nothing else in the code names a family.

What `model.apply({'params': params}, ...)` returns, by family (to call a model yourself):
  gpt      logits float32 [B, L, V] (with `targets=`: each target's cross entropy [B, L])
  bert     a dict: {'logits'} [B, C] (head 'sequence'), [B, L, C] ('token'); {'mlm_logits' [B, L, V],
           'nsp_logits' [B, 2] with nsp} ('pretrain'); {'hidden' [B, L, D], 'pooled' [B, D]} ('none')
  vit      logits float32 [B, C] (head 'classifier'), else a dict of hidden states
  encdec   logits float32 [B, L, V] of (src [B, S], tgt_in [B, L], src_valid [B, S])
"""

import copy
import functools
import importlib
import inspect
import pkgutil

import flax.linen as nn
import jax

from transformer.layers import lora as lora_lib
from transformer.models.common import Family

_NOT_FAMILIES = ("common", "flops", "summary")


@functools.cache
def families() -> dict[str, Family]:
    """Every family record of this package, by name."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _NOT_FAMILIES:
            record = importlib.import_module(f"{__name__}.{info.name}").FAMILY
            found[record.name] = record
    return found


def family(name: str) -> Family:
    if name not in families():
        raise ValueError(f"config.model.family={name!r}: choose one of {', '.join(sorted(families()))}")
    return families()[name]


def build(model_config, lora=None) -> nn.Module:
    """config.model -> its family's module, checked (unknown or inconsistent keys fail naming them); with
    config.lora of a positive rank, wrapped in its adapters (`layers/lora.Adapted`)."""
    model = family(model_config["family"]).build(model_config)
    settings = lora_lib.Lora.of(lora)
    return lora_lib.Adapted(model, settings) if settings.rank else model


def computes_loss(model) -> bool:
    """Whether `model` takes `targets` and hands back each position's cross entropy itself (GPT's blockwise
    head: the [B, L, V] logits never whole); an adapted model (`lora.Adapted`) answers for its base."""
    base = model.model if isinstance(model, lora_lib.Adapted) else model
    return "targets" in inspect.signature(type(base).__call__).parameters


def task_of(model_config) -> str:
    """The training task of config.model (its family's, by its head; its sizes may be left to the data)."""
    fam = family(model_config["family"])
    return fam.task(fam.make(model_config))


def param_shapes(model_config):
    """The params of `build(model_config)` as boxed ShapeDtypeStructs (nothing allocated)."""
    fam = family(model_config["family"])
    model = fam.build(model_config)
    return jax.eval_shape(model.init, jax.random.key(0), *fam.example_inputs(model))["params"]


def count_params(model_config) -> int:
    """The number of parameters of `build(model_config)`, from shapes alone; traced with the layers scanned
    where the family scans (the same parameters, stacked: one layer's trace, not num_layers')."""
    if "scan_layers" in model_config and not model_config["scan_layers"]:
        model_config = copy.deepcopy(model_config)
        model_config["scan_layers"] = True
    return sum(x.size for x in jax.tree.leaves(nn.unbox(param_shapes(model_config))))
