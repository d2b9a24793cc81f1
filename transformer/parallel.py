"""Device mesh, logical-axis sharding rules and multi-host start.

The mesh has axes ('data', 'fsdp', 'tensor'); `config.mesh` gives their sizes
(-1 takes the devices left over). Parameters carry logical axis names
(embed, heads, kv, mlp, vocab, length, norm) and `config.mesh.rules` maps each to
mesh axes. The batch is split over data x fsdp. With the default sizes
(data=-1, fsdp=1, tensor=1) this is plain data parallelism: the successor of
`jax.pmap`, written as `jax.jit` over a `Mesh` with `NamedSharding`s.
"""

import math

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

DEFAULT_RULES = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("length", None),
    ("norm", None),
    ("classes", None),
    ("types", None),
)


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, ...]:
    """Sizes of (data, fsdp, tensor) with one -1 resolved to the remaining devices."""
    sizes = [int(mesh_config[a]) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"config.mesh: at most one of {MESH_AXES} may be -1, got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"config.mesh: {num_devices} devices do not divide by the fixed axes {sizes}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"there are {num_devices}")
    return tuple(sizes)


def make_mesh(mesh_config, devices=None) -> Mesh:
    """A mesh over `devices` (default: all of them, every host) shaped by config.mesh."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh_config, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def rules_of(mesh_config) -> tuple:
    """config.mesh.rules (a list of [logical, mesh axes]) as the tuple flax expects."""
    return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
                 for name, axes in mesh_config.rules)


def logical_shardings(abstract_tree, mesh: Mesh, rules) -> object:
    """NamedShardings for a tree whose leaves may be boxed with logical axis names."""
    specs = nn.get_partition_spec(abstract_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp, the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(local_batch, mesh: Mesh):
    """This process's rows of a batch (a tree of numpy arrays) -> global arrays split over the batch axes."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)


def batch_divisor(mesh: Mesh) -> int:
    """How many ways the batch is split: the global batch must be a multiple of it."""
    return mesh.shape["data"] * mesh.shape["fsdp"]
