"""Logical axis names, the rules that map them onto the mesh, and activation constraints.

This is what the layers import. Parameters and activations name each dimension by a
logical axis (the constants below: a misspelt constant fails at import, where a misspelt
string would leave the dimension replicated without a word); `config.mesh.rules` maps each
name onto mesh axes. The rules are tried in order and a mesh axis serves one dimension
only, so an activation [batch, length, embed] takes data x fsdp x expert for the batch and leaves
embed whole, while a weight [embed, mlp] is split over fsdp x tensor (FSDP: gathered by
the compiler where it is used) and a mixture's expert weights [expert, embed, mlp] over
expert x fsdp x tensor: outside the mixture-of-experts layers the expert axis is one more
data-parallel axis. `constrain` places an activation while a step is traced
inside `sharding_context`; outside it (init, generation on one device) it does nothing.

The mesh itself, the batch's placement and multi-host start live in `transformer.parallel`.
"""

import contextlib
import contextvars

import flax.linen as nn
import jax
from jax.sharding import Mesh

# Logical axes (the glossary's letters in brackets).
BATCH = "batch"        # [B]
LENGTH = "length"      # [L], [S] (split over the context axis); also a position table's rows
EMBED = "embed"        # [D]
HEADS = "heads"        # [H] query heads, and [K] kv heads in k/v projections
HEAD_DIM = "head_dim"  # [Dh]
MLP = "mlp"            # [F]
VOCAB = "vocab"        # [V]
NORM = "norm"          # a norm's scale and bias
CLASSES = "classes"    # a classifier's outputs
TYPES = "types"        # BERT's token types
LAYERS = "layers"      # the stacked layer axis of scanned layers
EXPERT = "expert"      # [E] a mixture of experts' stacked experts
AXES = (BATCH, LENGTH, EMBED, HEADS, HEAD_DIM, MLP, VOCAB, NORM, CLASSES, TYPES, LAYERS, EXPERT)

# Names of earlier versions, and what they are called now.
RENAMED = {"kv": HEAD_DIM}

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")  # the expert axis holds experts, and splits the batch like data elsewhere

DEFAULT_RULES = (
    (BATCH, BATCH_AXES),
    (EMBED, "fsdp"),
    (VOCAB, "tensor"),
    (HEADS, "tensor"),
    (MLP, "tensor"),
    (HEAD_DIM, None),
    (LENGTH, "context"),
    (NORM, None),
    (CLASSES, None),
    (TYPES, None),
    (LAYERS, None),
    (EXPERT, "expert"),
)


def rules_of(mesh_config) -> tuple:
    """config.mesh.rules (a list of [logical, mesh axes]) as the tuple flax expects."""
    return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
                 for name, axes in mesh_config.rules)


def check_rules(mesh_config) -> None:
    """Every logical axis has a rule, and every rule names a logical axis and mesh axes that exist;
    a mistake fails naming config.mesh.rules (flax would leave an unmatched name replicated)."""
    named = []
    for rule in mesh_config.rules:
        name, axes = rule
        if name in RENAMED:
            raise ValueError(f"config.mesh.rules: the logical axis {name!r} is now called {RENAMED[name]!r}; "
                             "rename it in the rules")
        if name not in AXES:
            raise ValueError(f"config.mesh.rules: unknown logical axis {name!r}; choose from {', '.join(AXES)}")
        for axis in (axes if isinstance(axes, (list, tuple)) else [axes]):
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(f"config.mesh.rules: {name!r} maps onto {axis!r}, not a mesh axis "
                                 f"({', '.join(MESH_AXES)})")
        named.append(name)
    missing = [name for name in AXES if name not in named]
    if missing:
        raise ValueError(f"config.mesh.rules: no rule for the logical axes {', '.join(missing)} "
                         "(map them onto a mesh axis or None)")


def logical_shardings(abstract_tree, mesh: Mesh, rules) -> object:
    """NamedShardings for a tree whose leaves may be boxed with logical axis names."""
    specs = nn.get_partition_spec(abstract_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("transformer_sharding", default=None)


@contextlib.contextmanager
def sharding_context(mesh: Mesh | None, rules):
    """While tracing a step inside it, `constrain` places activations on `mesh` by `rules`."""
    token = _ACTIVE.set(None if mesh is None else (mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, tuple] | None:
    """The (mesh, rules) of the step being traced, or None outside `sharding_context`."""
    return _ACTIVE.get()


def mesh_spec(axes: tuple[str | None, ...], rules) -> jax.sharding.PartitionSpec:
    """The mesh PartitionSpec that logical `axes` map to under `rules`."""
    return nn.logical_to_mesh_axes(axes, rules)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """`x` constrained to the sharding its logical `axes` map to; unchanged outside `sharding_context`.

    (Flax's own global-mesh route also constrains boxed parameters, which breaks DenseGeneral.)
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return nn.with_logical_constraint(x, axes, rules=rules, mesh=mesh)
