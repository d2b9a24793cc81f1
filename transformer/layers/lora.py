"""Low-rank adapters (LoRA) on named kernels, for any family: `config.lora`.

A kernel W [S..., K..., N...] (S stacked: scanned layers, experts; K contracted; N output features) is
adapted as W + (alpha / rank) A B with A [S..., K..., R] and B [S..., R, N...] (R the rank): B starts at
zero, so a fresh adapter changes nothing, and A as peft draws it (uniform within 1 / sqrt(K)). The
adapters live in the params under `ADAPTERS`, keyed by the kernel's path; A and B take the kernel's
logical axes (so they shard like it), the rank axis replicated.

`Adapted` wraps a built model: `init` adds the adapters, `apply` runs the model on the kernels with
their adapters folded in (the base kept out of the gradient), so every task, decoding and evaluation
runs it unchanged; `merged` folds them into the base for good. Only the adapters train:
`trainable_only` gives the optimizer the adapters' moments alone.

`dropout` p drops the adapter's input as peft does, y = x W + (alpha / R) drop(x) A B, in training alone
(`deterministic=False`): there each adapted Dense kernel runs beside its adapter, unmerged (`unmerged_apply`);
evaluation and decoding run the merged kernels, where drop is the identity.

Which kernels: `targets`, a comma-separated list of the names in `TARGETS` (attention, mlp, experts)
or regular expressions searched in a kernel's path ("self_attn/(query|value)").
"""

import dataclasses
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from transformer import sharding

ADAPTERS = "lora"
TARGETS = {
    "attention": r"attn/(query|key|value|out|qkv|kv)/kernel$",
    "mlp": r"mlp/(up|gate|down|wi|wi_0|wi_1|wo)/kernel$",
    "experts": r"(experts|moe)/[^/]*kernel$",
}
STACKED = (sharding.LAYERS, sharding.EXPERT)
DEFAULTS = {"rank": 0, "alpha": 16.0, "dropout": 0.0, "targets": "attention"}
SUFFIXES = ("_lora_a", "_lora_b")  # a kernel's adapters beside it in the params, for `unmerged_apply`


@dataclasses.dataclass(frozen=True)
class Lora:
    """The adapters' settings: rank R (0: none), alpha (the update is scaled by alpha / R), dropout (of the
    adapter's input, in training), targets."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "attention"

    @classmethod
    def of(cls, settings) -> "Lora":
        settings = dict(settings or {})
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"unknown config.lora keys: {', '.join(unknown)} (known: {', '.join(DEFAULTS)})")
        lora = cls(**{**DEFAULTS, **settings})
        if lora.rank < 0:
            raise ValueError(f"config.lora.rank={lora.rank} must be 0 (off) or positive")
        if not 0 <= lora.dropout < 1:
            raise ValueError(f"config.lora.dropout={lora.dropout} must be in [0, 1)")
        lora.patterns()
        return lora

    @property
    def scale(self) -> float:
        """alpha / R (0 without adapters)."""
        return self.alpha / self.rank if self.rank else 0.0

    def patterns(self) -> list[re.Pattern]:
        out = []
        for name in filter(None, (t.strip() for t in self.targets.split(","))):
            try:
                out.append(re.compile(TARGETS.get(name, name)))
            except re.error as e:
                raise ValueError(f"config.lora.targets: {name!r} is neither one of {', '.join(TARGETS)} "
                                 f"nor a regular expression ({e})") from None
        return out

    def targeted(self, path: str) -> bool:
        return path.endswith("kernel") and any(p.search(path) for p in self.patterns())


def split(names: tuple) -> tuple[int, int]:
    """(stacked dims S, contracted dims K) of a kernel by its logical axis names: K is the first axis after
    the stacked ones, or the heads and head_dim of an output projection."""
    s = 0
    while s < len(names) and names[s] in STACKED:
        s += 1
    k = 2 if names[s:s + 2] == (sharding.HEADS, sharding.HEAD_DIM) and len(names) > s + 2 else 1
    return s, k


def init_adapters(lora: Lora, boxed_params, rng: jax.Array) -> dict:
    """The adapters (a tree like the params': {...kernel: {"a", "b"}}) of the targeted kernels of
    `boxed_params` (a model's init, its logical-axis boxes kept), boxed alike. Fails naming the targets
    when they match no kernel."""
    flat = traverse_util.flatten_dict(boxed_params, sep="/")
    out = {}
    for i, (path, box) in enumerate(sorted(flat.items())):
        if not lora.targeted(path):
            continue
        value = nn.unbox(box)
        names = tuple(box.names) if isinstance(box, nn.Partitioned) else (None,) * value.ndim
        s, k = split(names)
        fan_in = math.prod(value.shape[s:s + k])
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(rng, i), (*value.shape[:s + k], lora.rank), jnp.float32,
                               -bound, bound)
        b = jnp.zeros((*value.shape[:s], lora.rank, *value.shape[s + k:]), jnp.float32)
        out[f"{path}/a"] = _boxed(box, a, (*names[:s + k], None))
        out[f"{path}/b"] = _boxed(box, b, (*names[:s], None, *names[s + k:]))
    if not out:
        raise ValueError(f"config.lora.targets={lora.targets!r} matches no kernel of this model "
                         f"(e.g. {next((p for p in sorted(flat) if p.endswith('kernel')), 'none')})")
    return traverse_util.unflatten_dict(out, sep="/")


def _boxed(like, value: jax.Array, names: tuple):
    """`value` boxed as `like` is (its logical names `names`), or bare where `like` is."""
    return dataclasses.replace(like, value=value, names=names) if isinstance(like, nn.Partitioned) else value


def delta(a: jax.Array, b: jax.Array, kernel_ndim: int) -> jax.Array:
    """A [S..., K..., R] B [S..., R, N...] -> [S..., K..., N...], summed over R."""
    s = b.ndim - 1 - (kernel_ndim - (a.ndim - 1))  # stacked dims
    k = a.ndim - 1 - s
    letters = "abcdefghijklmnopq"
    S, K, N = letters[:s], letters[s:s + k], letters[s + k:kernel_ndim]
    return jnp.einsum(f"{S}{K}r,{S}r{N}->{S}{K}{N}", a, b)


def merged(params: dict, scale: float, frozen: bool = False) -> dict:
    """`params` with their adapters folded into their kernels and removed (`frozen`: the base kept out of
    the gradient)."""
    if ADAPTERS not in params:
        return params
    params = dict(params)
    adapters = traverse_util.flatten_dict(params.pop(ADAPTERS), sep="/")
    flat = traverse_util.flatten_dict(params, sep="/")
    for path in {p.rsplit("/", 1)[0] for p in adapters}:
        w = flat[path]
        base = jax.lax.stop_gradient(w) if frozen else w
        flat[path] = (base + scale * delta(adapters[f"{path}/a"], adapters[f"{path}/b"], w.ndim)).astype(w.dtype)
    if frozen:
        flat = {p: v if f"{p}/a" in adapters else jax.lax.stop_gradient(v) for p, v in flat.items()}
    return traverse_util.unflatten_dict(flat, sep="/")


class Adapted:
    """A built model with low-rank adapters: `init` and `apply` as the model's (its params plus `ADAPTERS`),
    every other attribute the model's."""

    def __init__(self, model: nn.Module, lora: Lora):
        self.model, self.lora = model, lora

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __eq__(self, other) -> bool:  # equal adapted models are one static argument of a jitted function
        return isinstance(other, Adapted) and (self.model, self.lora) == (other.model, other.lora)

    def __hash__(self) -> int:
        return hash((self.model, self.lora))

    def clone(self, **updates) -> "Adapted":
        return Adapted(self.model.clone(**updates), self.lora)

    def init(self, rng, *args, **kwargs) -> dict:
        variables = dict(self.model.init(rng, *args, **kwargs))
        params = dict(variables["params"])
        params[ADAPTERS] = init_adapters(self.lora, params, jax.random.fold_in(rng, 7919))
        return {**variables, "params": params}

    def apply(self, variables, *args, **kwargs):
        if self.lora.dropout and not kwargs.get("deterministic", True):
            return unmerged_apply(self.model, self.lora, variables, *args, **kwargs)
        params = merged(variables["params"], self.lora.scale, frozen=True)
        return self.model.apply({**variables, "params": params}, *args, **kwargs)


def unmerged_apply(model: nn.Module, lora: Lora, variables, *args, **kwargs):
    """`model.apply` with each adapted kernel's adapters beside it (`{kernel}_lora_a`, `_lora_b`) and every
    Dense layer holding them computing x W + scale drop(x) A B (drop: the identity unless `deterministic=False`;
    the base kept out of the gradient). Fails naming a targeted kernel no Dense layer applies (the experts'),
    which this form cannot adapt."""
    params = dict(variables["params"])
    adapters = traverse_util.flatten_dict(params.pop(ADAPTERS), sep="/")
    flat = {p: jax.lax.stop_gradient(v) for p, v in traverse_util.flatten_dict(params, sep="/").items()}
    for path, value in adapters.items():
        kernel, which = path.rsplit("/", 1)
        flat[kernel + SUFFIXES[which == "b"]] = value
    applied: set[str] = set()
    rate = 0.0 if kwargs.get("deterministic", True) else lora.dropout
    with nn.intercept_methods(functools.partial(_beside, lora.scale, rate, applied)):
        out = model.apply({**variables, "params": traverse_util.unflatten_dict(flat, sep="/")}, *args, **kwargs)
    missing = {p.rsplit("/", 1)[0] for p in adapters} - applied
    if missing:
        raise ValueError(f"config.lora.dropout applies to Dense kernels, and {min(missing)} is none: set "
                         "config.lora.dropout=0 or leave it out of config.lora.targets")
    return out


def _beside(scale: float, rate: float, applied: set, next_fun, args, kwargs, context):
    """A Flax interceptor: a Dense layer holding adapters (`unmerged_apply`) adds scale drop(x) A B to its
    output (drop: dropout of `rate`), x [M..., K...], A [K..., R], B [R, N...]; records the kernel's path in
    `applied`."""
    module = context.module
    if (context.method_name != "__call__" or not isinstance(module, (nn.Dense, nn.DenseGeneral))
            or not module.has_variable("params", "kernel" + SUFFIXES[0])):
        return next_fun(*args, **kwargs)
    applied.add("/".join((*module.path, "kernel")))
    a, b = (module.get_variable("params", "kernel" + suffix) for suffix in SUFFIXES)
    y, x = next_fun(*args, **kwargs), args[0]
    if rate:
        x = jnp.where(jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rate, x.shape), x / (1.0 - rate), 0)
    h = jnp.tensordot(x.astype(y.dtype), a.astype(y.dtype), axes=a.ndim - 1)  # [M..., R]
    return y + scale * jnp.tensordot(h, b.astype(y.dtype), axes=1)  # [M..., N...]


def trainable_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` on the adapters alone: every other parameter gets a zero update and no optimizer state."""
    def labels(params):
        return {k: jax.tree.map(lambda _, label="train" if k == ADAPTERS else "frozen": label, v)
                for k, v in params.items()}
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def count(params) -> tuple[int, int]:
    """(trainable, total) parameter counts: the adapters' when there are any, else every parameter."""
    total = sum(x.size for x in jax.tree.leaves(params))
    if ADAPTERS not in params:
        return total, total
    return sum(x.size for x in jax.tree.leaves(params[ADAPTERS])), total
