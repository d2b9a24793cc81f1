"""Parameter counts, FLOPs per token and training memory of a config, allocating nothing; the
FLOPs formula and the device peaks that MFU is measured against (here, bench and the loop).

    python -m transformer.inspect --config configs/gpt.py:gpt3-175b
    python -m transformer.inspect --config configs/gpt.py:gpt2-small --config.model.num_layers=2

Shapes come from `jax.eval_shape(model.init, ...)`, so even a 175B model takes seconds.
Weights are grouped into kinds across layers: a path loses its layer index
(`block_3/self_attn/query/kernel`), any `*_norm` module reads as `norm`, and the last two
names pick a readable kind from KINDS; an unknown path keeps its joined names.
"""

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import functools
import statistics
import time

from flax import traverse_util

from transformer import cli, models

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
    ("norm", "scale"): "norm scale",
    ("norm", "bias"): "norm bias",
}
CONTEXTS = {"cross_attn": "cross-attention "}  # modules that qualify the kinds below them
LAYER_INDEX = re.compile(r"(block|layer|layers)_\d+")
GIB = 2**30
FLOPS_FORMULA = ("forward = 2 x (each matrix's parameters x the tokens it multiplies) + 4 x (each attention\n"
                 "layer's query width x the (query, key) pairs it scores), per example, / its tokens; training =\n"
                 "3 x forward. PaLM's 2N + 4LTD (Chowdhery et al. 2022, app. B) for a decoder; a lookup is not a\n"
                 "matmul; auto and dense score every pair (causal masking is not discounted), blockwise only the\n"
                 "blocks its mask leaves (about half for causal, about L x W for a window W)")


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


def is_matrix(path: tuple[str, ...]) -> bool:
    """A kernel, or the token embedding (position and type tables are lookups only)."""
    return path[-1] == "kernel" or path[-2:] == ("embed", "embedding")


def forward_flops(config) -> dict:
    """The one FLOPs formula (FLOPS_FORMULA) for the model and lengths of `config`.

    Returns {'per_example', 'tokens' (per example), 'per_token' (exact where it divides),
    'matmul' (parameters of the matrices that multiply tokens), 'context' (the lengths)}.
    """
    family = models.family(config.model.family)
    model = family.build(config.model)
    cost = family.cost(model, config)
    shapes = traverse_util.flatten_dict(nn.unbox(models.param_shapes(config.model)))
    matrices = {path: leaf.size for path, leaf in shapes.items() if is_matrix(path)}
    weights = sum(2 * size * cost.weight_tokens(path) for path, size in matrices.items())
    attention = sum(4 * a.layers * a.width * a.pairs for a in cost.attention)
    total = weights + attention
    per_token, rest = divmod(total, cost.tokens)
    return dict(per_example=total, tokens=cost.tokens, per_token=per_token if rest == 0 else total / cost.tokens,
                matmul=sum(size for path, size in matrices.items() if cost.weight_tokens(path)),
                context=cost.context)


def summarize(config) -> dict:
    """Rows, parameter totals, FLOPs per token and training-state memory (GiB)."""
    rows = parameter_table(config)
    total = sum(r.parameters for r in rows)
    flops = forward_flops(config)
    param_gib = sum(r.parameters * r.dtype.itemsize for r in rows) / GIB
    optimizer_gib = 2 * total * 4 / GIB  # AdamW: two float32 moments per parameter
    return dict(
        rows=rows, total=total, matrices=sum(r.parameters for r in rows if r.matrix), matmul=flops["matmul"],
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


# Nominal dense peak FLOP/s per device by compute dtype (vendor datasheets; float32 on NVIDIA
# is the TF32 tensor-core rate, on TPU the default-precision matmul rate, i.e. bf16 passes).
PEAK_FLOPS = {
    "h100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "h200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "a100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "tpu v4": {"bfloat16": 275e12, "float32": 275e12},
    "tpu v5 lite": {"bfloat16": 197e12, "float32": 197e12},  # v5e reports "TPU v5 lite"
    "tpu v5e": {"bfloat16": 197e12, "float32": 197e12},
    "tpu v5p": {"bfloat16": 459e12, "float32": 459e12},
    "tpu v5": {"bfloat16": 459e12, "float32": 459e12},
}


def nominal_peak(device_kind: str, dtype: str) -> float | None:
    """The datasheet peak for `device_kind` (e.g. 'NVIDIA H100 80GB HBM3') in `dtype`; None if unknown."""
    kind = device_kind.lower()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "tpu v5 lite" before "tpu v5"
        if key in kind:
            return PEAK_FLOPS[key].get(dtype)
    return None


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@functools.cache
def measured_matmul_peak(dtype: str, n: int | None = None, reps: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (float32 accumulation) on one device, median of `reps`."""
    n = n or (1024 if jax.devices()[0].platform == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    mm(a, a).block_until_ready()
    return 2 * n**3 / median_time(lambda: mm(a, a).block_until_ready(), reps)


def device_peak(dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device in `dtype`, what it is): the datasheet's where known, else
    (CPUs, unknown accelerators) a matmul measured now."""
    kind = jax.devices()[0].device_kind
    peak = nominal_peak(kind, dtype)
    if peak:
        return peak, f"nominal {kind} {dtype} peak {peak / 1e12:,.0f} TFLOP/s"
    peak = measured_matmul_peak(dtype)
    return peak, f"a {dtype} matmul measured on one {kind} device at start-up: {peak / 1e9:,.1f} GFLOP/s"


def main(argv: list[str]) -> None:
    from absl import flags

    print(format_summary(summarize(flags.FLAGS.config)))


if __name__ == "__main__":
    cli.define_config("Config file, e.g. configs/gpt.py:gpt3-175b.")
    cli.run(main)
