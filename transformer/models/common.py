"""What every family file shares: its common fields, the family record, typed construction and
checks, FLOPs terms.

A family file (models/NAME.py) holds its flax module, its size presets and one `Family`
record, `FAMILY`, which is everything the rest of the code needs to know about it: how to
build and check it, its example inputs, its training task, whether and how it generates,
and what its FLOPs are made of. `transformer.models` finds the records by importing the
files of this package, so adding a family touches models/ and configs/ only. A family's module
extends `Shared` (or `TextShared`), where the fields the families have in common are declared, to have
them (and their checks: `Family.build`); a module that does not (a test's toy family) has its own alone.

The experts' keys of config.model are one record, `Shared.mixture` (layers/moe.Mixture), which `Family.make`
builds from them and `fields_of` lists them from. A family whose Blocks hold a mixture of experts gives its
router losses to the train step through `sowing`: inside it, the forward passes (`model.apply`) keep what their
mixture-of-experts layers sow (layers/moe.py), so no task has to ask for it; `auxiliary` is what the step does
with them.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer.layers.attention import IMPLEMENTATIONS, Mask
from transformer.layers.block import NORMS, PLACEMENTS, REMAT_POLICIES, make_blocks, make_norm
from transformer.layers.embeddings import POSITIONS
from transformer.layers.mlp import ACTIVATIONS
from transformer.layers.moe import COLLECTION, Mixture, Routing
from transformer.layers.parametrization import Parametrization

_NOT_FIELDS = ("parent", "name")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

# The choices of the fields that several families share; a family's record narrows them.
CHOICES = {
    "activation": tuple(ACTIVATIONS),
    "norm": tuple(NORMS),
    "norm_placement": PLACEMENTS,
    "positions": tuple(POSITIONS),
    "dtype": FLOAT_DTYPES,
    "param_dtype": FLOAT_DTYPES,
    "remat": (*REMAT_POLICIES, "auto"),
    "attention": tuple(IMPLEMENTATIONS),
}

# How a family generates: it continues a --prompt, or translates an --input.
GENERATIONS = ("prompt", "input")


class Shared(nn.Module):
    """The fields every family has, declared once: a family's module extends this class (or
    `TextShared`) and redeclares a field only to change its default. They are keys of `config.model`,
    each with its meaning on its line (`python -m transformer.inspect --keys` lists them): a stack of
    Blocks (layers/block.py).
    """

    num_layers: int = 12           # Blocks of the stack (an encoder-decoder's encoder)
    d_model: int = 768             # the model's width D
    num_heads: int = 12            # attention heads H of each Block
    mlp_dim: int = 3072            # the mlp's hidden width F
    activation: str = "gelu"       # the mlp's: gelu | gelu_exact | relu | swiglu | geglu ... (layers/mlp.py)
    norm: str = "layernorm"        # layernorm | rmsnorm
    norm_epsilon: float = 1e-5     # the norms' epsilon
    dropout: float = 0.0           # the rate of every dropout (0: none)
    dtype: str = "float32"         # what the layers compute in: float32 | bfloat16 | float16
    param_dtype: str = "float32"   # what the params are stored in
    remat: str = "none"            # recompute in the backward pass: none | full | save_dots | auto (fits the memory)
    scan_layers: bool = False      # compile one Block for all (jax.lax.scan): faster compiles, same numbers
    attention: str = "auto"        # the attention implementation: auto | dense | blockwise | ring | flash
    attention_block: int = 512     # the query and key block of blockwise, ring and flash attention
    qk_norm: bool = False          # RMSNorm over each head's query and key before rotary (Qwen3; epsilon norm_epsilon)
    mixture: Mixture = Mixture()   # the mixture-of-experts keys, one record (layers/moe.Mixture)
    scaling: Parametrization = Parametrization()  # sp | muP's keys, one record (layers/parametrization.py)

    @nn.nowrap
    def apply(self, variables, *args, mutable=False, **kwargs):
        """flax's `apply`; inside `sowing`, with mutable=False, it also keeps the 'moe' collection its
        mixture-of-experts layers sow, appended to the list `sowing` gives, and returns the output alone."""
        sown = _SOWN.get()
        if sown is None or mutable is not False or not self.mixture.num_experts:
            return super().apply(variables, *args, mutable=mutable, **kwargs)
        out, state = super().apply(variables, *args, mutable=[COLLECTION], **kwargs)
        sown.append(state.get(COLLECTION, {}))
        return out

    def stack(self, name: str, num_layers: int, init_shrinks: bool = False, **fields) -> list[nn.Module]:
        """`num_layers` Blocks named after `name` (`layers/block.make_blocks`) with the shared fields set;
        `fields` are the family's own (head width, biases, positions, caches, initializers), scaled by the
        parametrization (`init_shrinks`: the family's kernel init already shrinks as 1/sqrt(fan_in))."""
        fields = self.scaling.block_fields(self.d_model, num_layers, fields, init_shrinks)
        return make_blocks(
            name, num_layers, self.remat, self.scan_layers, self.mixture,
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            activation=self.activation,
            norm=self.norm,
            norm_epsilon=self.norm_epsilon,
            dropout=self.dropout,
            attention=self.attention,
            attention_block=self.attention_block,
            qk_norm=self.qk_norm,
            dtype=jnp.dtype(self.dtype),
            param_dtype=jnp.dtype(self.param_dtype),
            **fields,
        )

    def readout(self, x: jax.Array) -> jax.Array:
        """The hidden state x [..., D] as an output head takes it (muP's 1/m; under sp x itself)."""
        return self.scaling.readout(x, self.d_model)

    def make_norm(self, name: str) -> nn.Module:
        """A `norm` layer named `name`, in the family's dtypes and with its epsilon."""
        dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
        return make_norm(self.norm, name, dtype, param_dtype, self.norm_epsilon)


_SOWN: contextvars.ContextVar[list | None] = contextvars.ContextVar("sown", default=None)


@contextlib.contextmanager
def sowing() -> Iterator[list]:
    """A list that every `Shared.apply` inside the block appends its 'moe' collection to (a tree of the
    values the mixture-of-experts layers sow: `layers/moe.collect` reads it); empty without experts."""
    sown = []
    token = _SOWN.set(sown)
    try:
        yield sown
    finally:
        _SOWN.reset(token)


@contextlib.contextmanager
def not_sowing() -> Iterator[None]:
    """A block whose applies keep nothing for an enclosing `sowing`: a function jitted on its own (a
    decoder's loop) whose values cannot leave its trace."""
    token = _SOWN.set(None)
    try:
        yield
    finally:
        _SOWN.reset(token)


class TextShared(Shared):
    """`Shared`, plus what the families over token sequences (gpt, bert, encdec) have: where the
    norm sits, `norm_placement` pre | post (layers/block.py), an attention `window` (> 0: its
    family's docstring says its shape; 0: none) and a soft cap on the logits over the vocabulary
    (`layers/embeddings.softcap`)."""

    norm_placement: str = "pre"  # where each Block's norms sit: pre | post (of each residual branch)
    window: int = 0              # > 0: each token attends within a window of this many (its family's shape)
    logit_softcap: float = 0.0   # > 0: logits over the vocabulary are cap x tanh(logits / cap) (Gemma 2; 0: none)

    def stack(self, name: str, num_layers: int, init_shrinks: bool = False, **fields) -> list[nn.Module]:
        return super().stack(name, num_layers, init_shrinks, norm_placement=self.norm_placement, **fields)


@dataclasses.dataclass(frozen=True)
class Attention:
    """`layers` attention layers of query width H x Dh = `width`, each scoring `pairs` (query, key)
    pairs: queries x keys, less the blocks a blockwise implementation skips (see `scored_pairs`)."""

    layers: int
    width: int
    pairs: int


def scored_pairs(model: nn.Module, mask: Mask, queries: int, keys: int) -> int:
    """The (query, key) pairs one of `model`'s attention layers computes under `mask`'s static parts."""
    return mask.computed_pairs(queries, keys, getattr(model, "attention", "auto"),
                               getattr(model, "attention_block", 512))


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a family's forward pass on one example computes, for the one FLOPs formula
    (`transformer.models.flops.forward_flops`): each matrix (a kernel, or an embedding used as the
    output projection) times the tokens it multiplies, and the attention score matmuls."""

    tokens: int                                   # tokens of one example (what MFU counts per step)
    weight_tokens: Callable[[tuple[str, ...]], int]  # a matrix's param path -> tokens it multiplies
    attention: tuple[Attention, ...]
    context: str                                  # the lengths, for the reader: 'L = 1,024'


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's record: what generate, convert, bench, inspect and the loop need from it."""

    name: str
    module: type[nn.Module]
    presets: dict[str, dict]
    example_inputs: Callable[[nn.Module], tuple]  # abstract inputs for `model.init` (shapes only)
    validate: Callable[[nn.Module], None]          # relational checks, naming config.model keys
    task: Callable[[nn.Module], str]               # the training task (transformer/training/tasks/)
    cost: Callable[[nn.Module, object], Cost]      # (model, run config) -> its FLOPs terms
    choices: dict[str, tuple] = dataclasses.field(default_factory=dict)  # narrowed field choices
    generation: str | None = None                  # one of GENERATIONS, or None
    no_generation: str = ""                        # the one-line refusal where generation is None ({workdir}:
                                                   # the run's path)
    config_file: Callable[[nn.Module], str] | None = None  # configs/ spec a converted model starts from
    lens_entry: tuple[str, ...] = ()               # logit lens: the first of these modules met after the
                                                   # last block reads each layer's output instead
    no_lens: str = ""                              # the one-line refusal where lens_entry is ()

    def model_config(self, preset: str) -> dict:
        """Every field of the module with the preset's sizes filled in, plus `family`."""
        if preset not in self.presets:
            raise ValueError(f"unknown {self.name} preset {preset!r}; choose one of {', '.join(self.presets)}")
        return {"family": self.name, **fields_of(self.module), **self.presets[preset]}

    def make(self, model_config) -> nn.Module:
        """config.model (a dict-like with `family`) -> the module, its values unchecked; unknown keys fail
        naming them."""
        fields = {k: v for k, v in dict(model_config).items() if k != "family"}
        unknown = sorted(set(fields) - set(fields_of(self.module)))
        if unknown:
            raise ValueError(f"unknown config.model keys for the {self.name} family: {', '.join(unknown)}")
        for name, record in _records(self.module).items():
            keys = [f.name for f in dataclasses.fields(record) if f.name in fields]
            fields[name] = record(**{key: fields.pop(key) for key in keys})
        return self.module(**fields)

    def build(self, model_config) -> nn.Module:
        """config.model (a dict-like with `family`) -> the module; unknown or bad keys fail naming them."""
        model = self.make(model_config)
        check_choices(model, {**CHOICES, **self.choices})
        self.validate(model)
        if isinstance(model, Shared):
            model.mixture.check(model.num_layers)
            model.scaling.check()
        return model


def fields_of(cls: type[nn.Module]) -> dict:
    """Every config.model key of a module class with its default: its fields, a field that holds a record of
    keys (`_records`: the experts' `Mixture`) standing for the record's fields."""
    found = {}
    for f in dataclasses.fields(cls):
        if f.name in _records(cls):
            found.update({g.name: g.default for g in dataclasses.fields(f.default)})
        elif f.name not in _NOT_FIELDS:
            found[f.name] = f.default
    return found


def _records(cls: type[nn.Module]) -> dict[str, type]:
    """The fields of a module class that hold a frozen record of config.model keys, by name: their record class."""
    return {f.name: type(f.default) for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(f.default) and not isinstance(f.default, type)}


def auxiliary(config) -> Routing:
    """What a train step does with the auxiliary losses the run's model sows (layers/moe.Routing: weighs its
    router losses into the objective and balances its routers after each update; nothing for a dense model)."""
    return Routing.of(config)


NO_AUXILIARY = Routing()  # a step's default: a model that sows nothing


def check_choices(model: nn.Module, choices: dict[str, tuple]) -> None:
    """Each field the model has among `choices` holds one of its values, else a ValueError naming it."""
    for key, allowed in choices.items():
        if hasattr(model, key) and getattr(model, key) not in allowed:
            raise ValueError(f"config.model.{key}={getattr(model, key)!r}: choose one of {', '.join(allowed)}")


def check(checks: list[tuple[bool, str]]) -> None:
    """Raises ValueError with the message of the first failed (ok, message) check."""
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def shape_checks(model: nn.Module, *names: str) -> list[tuple[bool, str]]:
    """The sizes `names` that a config file may leave to the data (0 there) are positive."""
    return [(getattr(model, name) > 0, f"config.model.{name}={getattr(model, name)} must be positive (a config's 0 is "
             "the data's, filled in as a run starts: transformer/training/shapes.py)") for name in names]


def head_width_checks(model: nn.Module) -> list[tuple[bool, str]]:
    """Heads divide the width (or head_dim is set) and grouped kv heads divide the heads."""
    head_dim = getattr(model, "head_dim", 0)
    kv = getattr(model, "num_kv_heads", 0) or model.num_heads
    return [
        (model.num_heads >= 1, f"config.model.num_heads={model.num_heads} must be at least 1"),
        (bool(head_dim) or model.d_model % model.num_heads == 0,
         f"config.model.d_model={model.d_model} is not divisible by num_heads={model.num_heads}"
         + (" (or set config.model.head_dim)" if hasattr(model, "head_dim") else "")),
        (model.num_heads % kv == 0,
         f"config.model.num_heads={model.num_heads} is not a multiple of num_kv_heads={kv}"),
    ]


def attention_checks(model: nn.Module) -> list[tuple[bool, str]]:
    """Positive attention blocks; windows, global tokens and the logits' cap (where a family has them) not
    negative."""
    return [
        (model.attention_block >= 1, f"config.model.attention_block={model.attention_block} must be positive"),
        *[(getattr(model, key) >= 0, f"config.model.{key}={getattr(model, key)} must be >= 0 (0: none)")
          for key in ("window", "global_tokens", "logit_softcap") if hasattr(model, key)],
    ]


def stack_layers(params: dict, name: str, num_layers: int) -> dict:
    """Unscanned params ({name}_0 ... {name}_{N-1}) -> the scanned layout ({name}s/block, leading [N])."""
    layers = [params[f"{name}_{i}"] for i in range(num_layers)]
    rest = {k: v for k, v in params.items() if k not in {f"{name}_{i}" for i in range(num_layers)}}
    return {**rest, f"{name}s": {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}}


def unstack_layers(params: dict, name: str, take: Callable = lambda x, i: x[i]) -> dict:
    """The scanned layout ({name}s/block, leading [N]) -> unscanned params ({name}_0 ...), layer i of each leaf
    `take(leaf, i)`."""
    stacked = params[f"{name}s"]["block"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != f"{name}s"}
    return {**rest, **{f"{name}_{i}": jax.tree.map(lambda x, i=i: take(x, i), stacked) for i in range(num_layers)}}


def decoding_form(model: nn.Module, params: dict, take: Callable = lambda x, i: x[i]) -> tuple[nn.Module, dict]:
    """(model, params) with a scanned layer stack (`scan_layers`) as separate layers, where the params hold no
    other stack (LoRA's adapters): a decode step then updates each layer's cache in place, where a scanned
    stack's is written anew at every step (one more cache in memory, its whole size written a token). The
    params are sliced once (`take`), a copy."""
    if not getattr(model, "scan_layers", False) or "blocks" not in params or "lora" in params:
        return model, params
    return model.clone(scan_layers=False), unstack_layers(params, "block", take)


def match_layers(source: dict, target: dict) -> dict:
    """`source` params with each layer stack put in `target`'s layout (scanned or unscanned)."""
    for key in target:
        name = key[:-1]
        if key.endswith("s") and f"{name}_0" in source and key not in source:
            count = sum(1 for k in source if k.startswith(f"{name}_") and k[len(name) + 1:].isdigit())
            source = stack_layers(source, name, count)
        elif key.endswith("_0") and f"{key[:-2]}s" in source and key not in source:
            source = unstack_layers(source, key[:-2])
    return source
