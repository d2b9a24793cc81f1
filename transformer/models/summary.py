"""A config's model on paper, allocating nothing: its weights grouped by kind, parameter totals, FLOPs
per token (models/flops.py) and the memory of its training state. `python -m transformer.inspect`
prints it.

    s = summarize(config)            # {'rows', 'total', 'active', 'matmul', 'forward_flops', 'param_gib', ...}
    print(format_summary(s))

Shapes come from `jax.eval_shape(model.init, ...)`, so even a 175B model takes seconds.
Weights are grouped into kinds across layers: a path loses its layer index
(`block_3/self_attn/query/kernel`), any `*_norm` module reads as `norm`, and the last two
names pick a readable kind from KINDS; an unknown path keeps its joined names. A mixture of experts
counts all its parameters in the total, and only those a token uses (k of E experts) as active, in
`matmul` and in the FLOPs.
"""

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from transformer import models
from transformer.layers import lora
from transformer.models.flops import FLOPS_FORMULA, forward_flops, is_matrix

# (module, parameter) -> kind; rows print in this order.
KINDS = {
    ("embed", "embedding"): "embedding",
    ("pos_embed", "embedding"): "positions",
    ("query", "kernel"): "query",
    ("key", "kernel"): "key",
    ("value", "kernel"): "value",
    ("out", "kernel"): "output",
    ("up", "kernel"): "mlp up",
    ("gate", "kernel"): "mlp gate",
    ("down", "kernel"): "mlp down",
    ("unembed", "kernel"): "unembedding",
    ("proj", "kernel"): "patch embedding",
    ("head", "kernel"): "classifier head",
    ("type_embed", "embedding"): "token types",
    ("pooler", "kernel"): "pooler",
    ("mlm_transform", "kernel"): "mlm transform",
    ("classifier", "kernel"): "classifier head",
    ("proj", "bias"): "patch embedding bias",
    ("head", "bias"): "classifier head bias",
    ("query", "bias"): "query bias",
    ("key", "bias"): "key bias",
    ("value", "bias"): "value bias",
    ("out", "bias"): "output bias",
    ("up", "bias"): "mlp up bias",
    ("gate", "bias"): "mlp gate bias",
    ("down", "bias"): "mlp down bias",
    ("router", "kernel"): "router",
    ("mlp", "router_bias"): "router bias",
    ("mlp", "up"): "expert up",
    ("mlp", "gate"): "expert gate",
    ("mlp", "down"): "expert down",
    ("mlp", "up_bias"): "expert up bias",
    ("mlp", "gate_bias"): "expert gate bias",
    ("mlp", "down_bias"): "expert down bias",
    ("shared_gate", "kernel"): "shared expert gate",
    ("norm", "scale"): "norm scale",
    ("norm", "bias"): "norm bias",
}
CONTEXTS = {"cross_attn": "cross-attention ", "shared": "shared expert "}  # modules that qualify the kinds below
LAYER_INDEX = re.compile(r"(block|layer|layers)_\d+")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Row:
    """One kind of weight: `count` instances of `shape`."""

    kind: str
    shape: tuple[int, ...]
    count: int
    axes: tuple[str | None, ...]
    dtype: jnp.dtype
    matrix: bool  # a kernel or the token embedding (not a bias, norm or position table)

    @property
    def parameters(self) -> int:
        return self.count * math.prod(self.shape)


def kind_of(path: tuple[str, ...]) -> tuple[int, str]:
    """('block_3', 'self_attn', 'query', 'kernel') -> (rank in KINDS, 'query')."""
    names = tuple("norm" if n.endswith("_norm") else n for n in path if not LAYER_INDEX.fullmatch(n))
    if names[-2:] not in KINDS:
        return len(KINDS), "/".join(names)
    context = "".join(CONTEXTS.get(n, "") for n in names[:-2])
    return list(KINDS).index(names[-2:]), context + KINDS[names[-2:]]


def parameter_table(config) -> list[Row]:
    """One Row per kind of weight of `build(config.model)`, from shapes only."""
    boxed = models.param_shapes(config.model)
    shapes = traverse_util.flatten_dict(nn.unbox(boxed))
    axes = traverse_util.flatten_dict(nn.get_partition_spec(boxed))
    counts = {}
    for path, leaf in shapes.items():
        rank, kind = kind_of(path)
        key = (rank, kind, tuple(leaf.shape), tuple(axes[path]), jnp.dtype(leaf.dtype), is_matrix(path))
        counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: item[0][:2])
    return [Row(kind, shape, count, axes, dtype, matrix)
            for (_, kind, shape, axes, dtype, matrix), count in ordered]


def adapter_parameters(config) -> int:
    """The parameters of config.lora's adapters (0 without them), from shapes only."""
    settings = lora.Lora.of(config.get("lora"))
    if not settings.rank:
        return 0
    boxed = models.param_shapes(config.model)
    adapters = jax.eval_shape(lambda: lora.init_adapters(settings, boxed, jax.random.key(0)))
    return sum(x.size for x in jax.tree.leaves(nn.unbox(adapters)))


def summarize(config) -> dict:
    """Rows, parameter totals, FLOPs per token and training-state memory (GiB)."""
    rows = parameter_table(config)
    total = sum(r.parameters for r in rows)
    flops = forward_flops(config)
    adapters = adapter_parameters(config)
    trainable = adapters or total
    param_gib = (sum(r.parameters * r.dtype.itemsize for r in rows) + 4 * adapters) / GIB
    optimizer_gib = 2 * trainable * 4 / GIB  # AdamW: two float32 moments per trained parameter
    return dict(
        rows=rows, total=total, adapters=adapters, trainable=trainable,
        active=flops["active"], matrices=sum(r.parameters for r in rows if r.matrix),
        matmul=flops["matmul"],
        context=flops["context"], forward_flops=flops["per_token"], training_flops=3 * flops["per_token"],
        param_dtypes=sorted({str(r.dtype) for r in rows}),
        param_gib=param_gib, optimizer_gib=optimizer_gib, training_state_gib=param_gib + optimizer_gib,
    )


def format_table(rows: list[Row]) -> list[str]:
    """Aligned text lines: kind | shape | count | parameters | logical axes."""
    cells = [("kind", "shape", "count", "parameters", "logical axes")] + [
        (r.kind, " x ".join(map(str, r.shape)), str(r.count), f"{r.parameters:,}",
         ", ".join(str(a) for a in r.axes)) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    align = ("<", "<", ">", ">", "<")
    lines = [" | ".join(f"{c:{a}{w}}" for c, a, w in zip(cell, align, widths)).rstrip() for cell in cells]
    return [lines[0], "-" * len(max(lines, key=len))] + lines[1:]


def format_summary(s: dict) -> str:
    """The table, then totals, FLOPs per token and memory, one figure a line."""
    figures = [
        ("total parameters", f"{s['total']:,}"),
        *([("LoRA adapters' parameters (alone trained)", f"{s['adapters']:,}")] if s["adapters"] else []),
        *([("active parameters (per token: k of E experts)", f"{s['active']:,}")] if s["active"] != s["total"] else []),
        ("matrices (kernels + token embedding)", f"{s['matrices']:,}"),
        ("matmul parameters N", f"{s['matmul']:,}"),
        (f"forward FLOPs per token ({s['context']})", f"{s['forward_flops']:,}"),
        ("training FLOPs per token", f"{s['training_flops']:,}"),
        (f"parameters ({', '.join(s['param_dtypes'])}), GiB", f"{s['param_gib']:,.2f}"),
        ("AdamW moments (2 x float32), GiB", f"{s['optimizer_gib']:,.2f}"),
        ("training state (no gradients, activations), GiB", f"{s['training_state_gib']:,.2f}"),
    ]
    label_width, value_width = (max(len(f[i]) for f in figures) for i in (0, 1))
    lines = [f"{label:<{label_width}}  {value:>{value_width}}" for label, value in figures]
    return "\n".join(format_table(s["rows"]) + [""] + lines + ["", "FLOPs: " + FLOPS_FORMULA])
